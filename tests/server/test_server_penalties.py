"""``presence_penalty``, ``frequency_penalty`` and vLLM's ``repetition_penalty`` through the
official ``openai`` client against a live server (the bundled demo model, bf16 KV, CPU): applied
as ``LLM.generate`` applies them, in completions and chat, streamed and not; out-of-range or
mistyped values are a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from serve_demo import DEMO, MODEL, TEMPLATE

from oscarkv.engine import SamplingParams
from oscarkv.engine.llm import LLM
from oscarkv.engine.tokenizer import apply_chat
from oscarkv.server.launch import RunningServer

PROMPT = "def add(a, b):"
PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 1.5, "repetition_penalty": 1.6}


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(DEMO, kv_dtype="bf16", device="cpu", max_running=4) as m:
        yield m


def _client(s: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_completion_penalties_match_llm_generate(srv: RunningServer, llm: LLM) -> None:
    c = _client(srv)
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    r = c.completions.create(presence_penalty=0.8, frequency_penalty=1.5,
                             extra_body={"repetition_penalty": 1.6, "ignore_eos": True}, **kw)  # fmt: skip
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **PENALTIES))[0]
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == 24
    assert ref.text != plain.text  # the penalties change this greedy text
    chunks = list(c.completions.create(presence_penalty=0.8, frequency_penalty=1.5, stream=True,
                                       extra_body={"repetition_penalty": 1.6, "ignore_eos": True}, **kw))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    for name, v in PENALTIES.items():  # each alone reaches the engine as LLM.generate takes it
        one = c.completions.create(extra_body={name: v, "ignore_eos": True}, **kw).choices[0].text
        want = llm.generate(
            PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **{name: v})
        )[0]
        assert one == want.text, name


def test_chat_penalties_match_llm(srv: RunningServer, llm: LLM) -> None:
    msgs = [{"role": "user", "content": "count with me: one two one two one two"}]
    r = _client(srv).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, presence_penalty=-0.5, frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3},
    )  # type: ignore[arg-type]  # fmt: skip
    ids = apply_chat(llm.tokenizer, msgs, TEMPLATE)
    p = SamplingParams(max_tokens=16, temperature=0, presence_penalty=-0.5, frequency_penalty=1.0,
                       repetition_penalty=1.3)  # fmt: skip
    ref = llm.generate(ids, p)[0]
    assert r.choices[0].message.content == ref.text
    assert ref.text != llm.generate(ids, SamplingParams(max_tokens=16, temperature=0))[0].text


def test_seeded_sampling_with_penalties_is_reproducible(srv: RunningServer, llm: LLM) -> None:
    c = _client(srv)
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 5,
          "frequency_penalty": 1.0, "extra_body": {"repetition_penalty": 1.2}}  # fmt: skip
    a = c.completions.create(**kw).choices[0].text
    assert a == c.completions.create(**kw).choices[0].text
    p = SamplingParams(max_tokens=16, temperature=0.9, seed=5, frequency_penalty=1.0, repetition_penalty=1.2)
    assert a == llm.generate(PROMPT, p)[0].text


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3),
     ("frequency_penalty", -5.0), ("repetition_penalty", 0), ("repetition_penalty", -1),
     ("repetition_penalty", 2.5), ("presence_penalty", "1"), ("repetition_penalty", "1.2"),
     ("frequency_penalty", True)],
)  # fmt: skip
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_penalties_are_400_naming_the_field(
    srv: RunningServer, field: str, value: object, route: str
) -> None:
    body: dict = {"model": MODEL, "max_tokens": 2, field: value}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = PROMPT
    r = httpx.post(f"{srv.url}/v1/{'chat/' if route == 'chat' else ''}completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and "Traceback" not in err["message"]


def test_openai_client_sees_400_for_a_bad_penalty(srv: RunningServer) -> None:
    c = _client(srv)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, presence_penalty=2.5)
    assert e.value.status_code == 400 and "presence_penalty" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  extra_body={"repetition_penalty": 0})  # fmt: skip


def test_neutral_values_change_nothing(srv: RunningServer, llm: LLM) -> None:
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    c = _client(srv)
    r = c.completions.create(
        presence_penalty=0, frequency_penalty=0.0, extra_body={"repetition_penalty": 1}, **kw
    )
    assert r.choices[0].text == llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].text
