"""Several choices in one request, through the official ``openai`` client against a live server
(the bundled demo model, bf16 KV, CPU): a batch of prompts (strings or token-id lists), as
lm-eval's ``local-completions`` sends them, and ``n`` choices per prompt; streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_demo import DEMO, MODEL

from oscarkv.engine import SamplingParams
from oscarkv.engine.llm import LLM
from oscarkv.server.launch import RunningServer

PROMPTS = ["Once upon a time", "The cat sat", "In the beginning"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEMO, kv_dtype="bf16", device="cpu", max_running=4, kv_budget_gb=0.25)


def _client(s: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def test_a_batch_of_prompts_answers_each_in_order(srv: RunningServer, llm: LLM) -> None:
    refs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    c = _client(srv)
    r = c.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [o.text for o in refs]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    assert r.usage.completion_tokens == 18
    ids = [list(o.prompt_token_ids) for o in refs]
    r2 = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [ch.text for ch in r2.choices] == [o.text for o in refs]
    assert srv.async_engine.num_live == 0


def test_n_choices_per_prompt(srv: RunningServer) -> None:
    c = _client(srv)
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 1.0, "seed": 3}
    r = c.completions.create(prompt=PROMPTS[:2], n=3, **kw)
    texts = [ch.text for ch in r.choices]
    assert [ch.index for ch in r.choices] == list(range(6))
    assert len(set(texts[:3])) > 1  # choice j samples with seed + j
    assert texts == [ch.text for ch in c.completions.create(prompt=PROMPTS[:2], n=3, **kw).choices]
    one = c.completions.create(prompt=PROMPTS[1], **{**kw, "seed": 4})  # the second choice's seed
    assert one.choices[0].text == texts[4]
    prompt_tokens = c.completions.create(prompt=PROMPTS[:2], max_tokens=1, model=MODEL).usage.prompt_tokens
    assert r.usage.prompt_tokens == prompt_tokens  # each prompt counted once, not n times
    assert r.usage.completion_tokens == len(texts) * 12
    greedy = c.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=8, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_streamed_choices_merge_and_match_the_whole_answers(srv: RunningServer) -> None:
    c = _client(srv)
    kw = {"model": MODEL, "prompt": PROMPTS, "n": 2, "max_tokens": 7, "temperature": 1.0, "seed": 11}
    full = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    got: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        got[choice.index] = got.get(choice.index, "") + choice.text
        if choice.finish_reason:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
    assert got == {ch.index: ch.text for ch in full.choices} and set(finishes) == set(range(6))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_n_choices(srv: RunningServer) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    c = _client(srv)
    r = c.chat.completions.create(model=MODEL, messages=msgs, n=3, max_tokens=8, temperature=1.0, seed=5)  # type: ignore[arg-type]
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len({ch.message.content for ch in r.choices}) > 1
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, n=3, max_tokens=8, temperature=1.0,  # type: ignore[arg-type]
                                            seed=5, stream=True))  # fmt: skip
    roles = [ch.choices[0].index for ch in chunks if ch.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2]
    text: dict[int, str] = {}
    for ch in chunks:
        text[ch.choices[0].index] = text.get(ch.choices[0].index, "") + (ch.choices[0].delta.content or "")
    assert text == {ch.index: ch.message.content for ch in r.choices}


def test_logit_bias_is_applied_not_ignored(srv: RunningServer, llm: LLM) -> None:
    c = _client(srv)
    plain = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    tok = llm.tokenizer.encode(" the")[-1]
    r = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logit_bias={str(tok): 100}
    )
    ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, logit_bias=((tok, 100.0),)))[0]
    assert r.choices[0].text == ref.text != plain.choices[0].text and list(ref.token_ids) == [tok] * 6
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,  # type: ignore[arg-type]
                                     temperature=0, logit_bias={str(tok): 100})  # fmt: skip
    assert chat.choices[0].message.content == llm.tokenizer.decode([tok] * 3)
    for bias, words in [
        ({"x": 1}, "token ids"),
        ({str(tok): 101}, "logit_bias"),
        ({"99999999": 1}, "vocabulary"),
    ]:
        resp = httpx.post(
            srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "logit_bias": bias}
        )
        assert resp.status_code == 400 and words in resp.json()["error"]["message"], (bias, resp.text)


def test_logprobs_on_both_endpoints_streamed_and_not(srv: RunningServer, llm: LLM) -> None:
    """The sampled tokens' log-probabilities and the top k, in OpenAI's two shapes, equal the
    engine's own (``SamplingParams.logprobs``); the stream's pieces add up to the whole."""
    c = _client(srv)
    ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x for x, _ in ref.logprobs], abs=1e-6)
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert [len(d) for d in lp.top_logprobs] == [2] * 6
    assert all(
        max(d.values()) == pytest.approx(v, abs=1e-6)
        for d, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                       stream=True))  # fmt: skip
    streamed = [
        v for ch in chunks for v in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    msgs = [{"role": "user", "content": "hello there"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True,  # type: ignore[arg-type]
                                     top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6) for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    plain = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    assert plain.choices[0].logprobs is None
    bad = httpx.post(
        srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "top_logprobs": 2}
    )
    assert bad.status_code == 400 and "logprobs: true" in bad.json()["error"]["message"]


def test_echo_returns_the_prompt_scored_as_lm_eval_reads_it(srv: RunningServer, llm: LLM) -> None:
    """``echo`` with ``logprobs``: the text starts with the prompt, and the logprobs list every
    prompt token (the first unscored) then the output's, as lm-eval's loglikelihood reads them
    (``token_logprobs[ctxlen:-1]``); scores equal the engine's ``prompt_logprobs``; a batch of
    id lists, and the stream, answer the same."""
    c = _client(srv)
    ref = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    )[0]
    n = len(ref.prompt_token_ids)
    r = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    ch = r.choices[0]
    assert ch.text == PROMPTS[0] + ref.text
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([x for x, _ in ref.prompt_logprobs[1:]], abs=1e-6)
    assert lp.token_logprobs[n] == pytest.approx(ref.logprobs[0][0], abs=1e-6)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n] == len(PROMPTS[0])
    assert all(len(d) == 1 for d in lp.top_logprobs[1:])
    assert lp.model_extra["prompt_scoring"] == "bf16"  # what the scores attended to
    batch = c.completions.create(model=MODEL, prompt=[ref.prompt_token_ids] * 2, max_tokens=1, temperature=0,
                                 logprobs=1, echo=True)  # fmt: skip
    for b in batch.choices:  # batched with another prompt: fp32 sums in another order
        assert b.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
        assert b.text == llm.tokenizer.decode(ref.prompt_token_ids) + ref.text
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=1,
                                       echo=True, stream=True))  # fmt: skip
    assert chunks[0].choices[0].text == PROMPTS[0]
    assert chunks[0].choices[0].logprobs.model_extra["prompt_scoring"] == "bf16"
    streamed = [
        v
        for k in chunks
        for v in (k.choices[0].logprobs.token_logprobs if k.choices and k.choices[0].logprobs else [])
    ]
    assert len(streamed) == n + 3 and streamed[0] is None
    assert streamed[1 : n + 1] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    text_only = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2, temperature=0, echo=True)
    assert text_only.choices[0].text.startswith(PROMPTS[1]) and text_only.choices[0].logprobs is None
