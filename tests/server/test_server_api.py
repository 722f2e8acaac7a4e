"""The OpenAI-compatible server, end to end: the official ``openai`` client against a live
server on 127.0.0.1 (a free port) over the bundled demo model (bf16 KV, CPU)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_demo import DEMO, MODEL, TEMPLATE, engine_config, wait_idle

import oscarkv
from oscarkv.config import ServerConfig
from oscarkv.config.base import SpecError
from oscarkv.engine import SamplingParams
from oscarkv.engine.llm import LLM
from oscarkv.engine.tokenizer import apply_chat
from oscarkv.server.launch import RunningServer, start_server

KEY = "sk-test-0123456789"
PROMPT = "Once upon a time"


_engine_cfg = engine_config


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """No chat template, an API key, a 2000-byte body limit."""
    key = tmp_path_factory.mktemp("key") / "key.txt"
    key.write_text(KEY + "\n")
    s = start_server(_engine_cfg(), ServerConfig(port=0, api_key_file=str(key), max_body_bytes=2000))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEMO, kv_dtype="bf16", device="cpu", max_running=4, kv_budget_gb=0.25)


def _client(s: RunningServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# ---- completions -------------------------------------------------------------------------
def test_models_and_health(srv: RunningServer) -> None:
    assert [m.id for m in _client(srv).models.list().data] == [MODEL]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_completion_matches_llm_generate(srv: RunningServer, llm: LLM) -> None:
    r = _client(srv).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids) == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ids = llm.tokenizer.encode(PROMPT)
    r2 = _client(srv).completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == ref.text and r2.usage.prompt_tokens == len(ids)


def test_completion_stream_matches_non_stream(srv: RunningServer) -> None:
    c = _client(srv)
    full = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))  # fmt: skip
    text_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_sse_wire_format(srv: RunningServer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ") and json.loads(ev[6:])["object"] == "text_completion"


def test_stop_string(srv: RunningServer) -> None:
    c = _client(srv)
    full = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text and full.startswith(r.choices[0].text)


def test_seed_reproducible(srv: RunningServer) -> None:
    c = _client(srv)
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0}
    a = c.completions.create(seed=7, **kw).choices[0].text
    assert a == c.completions.create(seed=7, **kw).choices[0].text
    others = {c.completions.create(seed=s, **kw).choices[0].text for s in (8, 9, 10)}
    assert others != {a}


# ---- chat ----------------------------------------------------------------------------------
def test_chat_matches_llm(srv: RunningServer, llm: LLM) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    c = _client(srv)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    ids = apply_chat(llm.tokenizer, msgs, TEMPLATE)
    ref = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0))[0]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             msgs[1]]  # fmt: skip
    r2 = c.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r2.choices[0].message.content == ref.text


def test_chat_stream(srv: RunningServer) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    c = _client(srv)
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [ch for ch in chunks if ch.choices]
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in with_choices) == full.choices[0].message.content
    )
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_without_template_is_400(secured: RunningServer) -> None:
    r = httpx.post(secured.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert "--chat-template" in _assert_error(r, 400)["message"]


# ---- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, None),  # prompt + max_tokens > max_model_len
        ({"prompt": [5, 2048]}, "prompt"),  # id >= vocab
        ({"prompt": ""}, "prompt"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[5, 2048]]}, "prompt"),  # an id >= vocab in a batch
        ({"prompt": ["fine", ""]}, "prompt"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"repetition_penalty": 0}, "repetition_penalty"),  # vLLM's extension, in (0, 2]
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"min_p": 0.1}, "min_p"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True, "max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),  # a string is not a number, even when it reads as one
        ({"temperature": True}, "temperature"),
        ({"top_p": "1"}, "top_p"),
        ({"stream": "yes"}, "stream"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"echo": "false"}, "echo"),
        ({"user": 5}, "user"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),  # a digit to str.isdigit, not to int
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # past int()'s digit limit
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"stop_token_ids": [2048]}, "stop_token_ids"),  # outside the vocabulary
    ],
)
def test_bad_parameters_are_400(srv: RunningServer, extra: dict, param: str | None) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **extra}
    _assert_error(httpx.post(srv.url + "/v1/completions", json=body), 400, param)


def test_chat_refuses_echo_by_name(srv: RunningServer) -> None:
    """Completions' echo returns the prompt; chat has no such field (vLLM's chat echo repeats the
    last message, which this server does not do): refused by name, never ignored."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert "completions" in _assert_error(httpx.post(srv.url + "/v1/chat/completions", json={**chat, "echo": True}),
                                          400, "echo")["message"]  # fmt: skip
    assert httpx.post(srv.url + "/v1/chat/completions", json={**chat, "echo": False}).status_code == 200


def test_error_messages_do_not_echo_a_huge_value(srv: RunningServer) -> None:
    chat = {"model": MODEL, "messages": [{"role": "x" * 500_000, "content": "hi"}]}
    r = httpx.post(srv.url + "/v1/chat/completions", json=chat)
    err = _assert_error(r, 400, "messages")
    assert "role" in err["message"] and len(err["message"]) < 1100 and len(r.content) < 2000


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300])
def test_a_vanishing_temperature_samples_the_most_likely_token(
    srv: RunningServer, temperature: float
) -> None:
    """``logits / T`` would overflow to inf (and softmax to NaN, token 0): the sampler takes the
    limit instead, the greedy choice."""
    c = _client(srv)
    greedy = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=temperature, logprobs=1)
    assert r.choices[0].text == greedy.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(greedy.choices[0].logprobs.token_logprobs)


def test_a_vanishing_repetition_penalty_does_not_sample_nan(srv: RunningServer) -> None:
    """``repetition_penalty`` 1e-300 divides every seen positive logit by ~0: those logits are
    held at fp32's largest, so the draw is among the prompt's own tokens, never NaN's token 0."""
    prompt = [17, 250, 901, 33, 1200]
    texts = {srv.engine.tokenizer.decode([t]) for t in prompt}
    for temperature in (0, 1.0):
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                       "temperature": temperature, "seed": 1, "repetition_penalty": 1e-300, "logprobs": 1})  # fmt: skip
        assert r.status_code == 200
        got = r.json()["choices"][0]["logprobs"]["tokens"]
        assert got and all(t in texts for t in got), (temperature, got)


def test_too_long_prompt_is_400(srv: RunningServer) -> None:
    body = {"model": MODEL, "prompt": [5] * 2048, "max_tokens": 1}
    assert (
        "max_model_len" in _assert_error(httpx.post(srv.url + "/v1/completions", json=body), 400)["message"]
    )


def test_openai_client_sees_400_and_404(srv: RunningServer) -> None:
    c = _client(srv)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt=PROMPT)


def test_unknown_model_malformed_json_unknown_route(srv: RunningServer) -> None:
    err = _assert_error(
        httpx.post(srv.url + "/v1/completions", json={"model": "x", "prompt": "a"}), 404, "model"
    )
    assert err["code"] == "model_not_found"
    r = httpx.post(
        srv.url + "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    _assert_error(r, 422)
    _assert_error(httpx.post(srv.url + "/v1/completions", json=[1, 2]), 422)
    _assert_error(httpx.get(srv.url + "/v1/nothing"), 404)


def test_auth_401(secured: RunningServer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    _assert_error(httpx.post(secured.url + "/v1/completions", json=body), 401)
    r = httpx.post(secured.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    _assert_error(r, 401)
    _assert_error(httpx.get(secured.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        _client(secured, "wrong").models.list()
    assert _client(secured, KEY).completions.create(**body).usage.completion_tokens == 2
    assert httpx.get(secured.url + "/health").status_code == 200


def test_body_too_large_413(secured: RunningServer) -> None:
    h = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({"model": MODEL, "prompt": "a" * 5000}).encode()
    _assert_error(httpx.post(secured.url + "/v1/completions", content=big, headers=h), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streamed
        for i in range(0, len(big), 500):
            yield big[i : i + 500]

    _assert_error(httpx.post(secured.url + "/v1/completions", content=chunks(), headers=h), 413)


def test_non_loopback_host_needs_key() -> None:
    with pytest.raises(SpecError, match="api-key-file"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", insecure_no_api_key=True).host == "0.0.0.0"
    with pytest.raises(SpecError, match="port"):
        ServerConfig(port=70000)


# ---- cancellation and responsiveness ---------------------------------------------------------
def test_stream_disconnect_aborts(srv: RunningServer) -> None:
    wait_idle(srv)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: ") for x in got)
    wait_idle(srv)
    assert srv.engine.stats["decode_tokens"] < 10_000


def test_non_stream_disconnect_aborts(srv: RunningServer) -> None:
    wait_idle(srv)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
    t0 = time.monotonic()
    wait_idle(srv)
    assert time.monotonic() - t0 < 15


def test_health_and_metrics_during_long_prefill(srv: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    wait_idle(srv)
    runner = srv.engine.runner
    real, in_prefill = runner.launch, threading.Event()

    def slow(batch: Any, host: Any = None) -> Any:
        if not batch.is_decode:
            in_prefill.set()
            time.sleep(3.0)
        return real(batch, host)

    monkeypatch.setattr(runner, "launch", slow)
    res: dict = {}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    t = threading.Thread(
        target=lambda: res.update(r=httpx.post(srv.url + "/v1/completions", json=body, timeout=60))
    )
    t.start()
    assert in_prefill.wait(10)
    t0 = time.monotonic()
    assert httpx.get(srv.url + "/health", timeout=2).status_code == 200
    m = httpx.get(srv.url + "/metrics", timeout=2)
    assert time.monotonic() - t0 < 1.5 and in_prefill.is_set()
    assert m.status_code == 200 and "oscarkv_requests_running" in m.text
    t.join(30)
    assert res["r"].status_code == 200
    monkeypatch.undo()
    text = httpx.get(srv.url + "/metrics").text
    assert 'finish_reason="length"' in text or "finish_reason" in text


def test_queue_full_503_and_engine_death(tmp_path: Path) -> None:
    s = start_server(_engine_cfg(), ServerConfig(port=0, max_queued=1))
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a collected iterator closes the connection
            next(lines)
            r2 = httpx.post(
                s.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
            )
            assert _assert_error(r2, 503)["type"] == "service_unavailable"
            assert r2.headers["retry-after"] == "1"
            assert s.async_engine.num_live == 1
        wait_idle(s)

        def boom(batch: Any, host: Any = None) -> Any:
            raise RuntimeError("simulated device failure")

        s.engine.runner.launch = boom  # type: ignore[method-assign]
        r3 = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert "simulated" not in _assert_error(r3, 503)["message"]
        assert httpx.get(s.url + "/health").status_code == 503
        r4 = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        _assert_error(r4, 503)
        assert r4.headers["retry-after"] == "1"
    finally:
        s.stop()


def test_cli_serve_refuses_bad_setups(capsys: pytest.CaptureFixture[str]) -> None:
    from oscarkv.cli import main

    assert main(["serve", "--model", DEMO, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--rotations" in err and "--kv-dtype bf16" in err
    assert main(["serve", "--model", DEMO, "--kv-dtype", "bf16", "--host", "0.0.0.0"]) == 2
    assert "--api-key-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--kv-dtype", "bf16"])  # --model is required


def test_key_and_template_files_are_checked_before_the_model_loads(tmp_path: Path, monkeypatch) -> None:
    """An empty or missing key file, or a missing template, fails before any engine is built."""
    import oscarkv.server.launch as launch

    def no_engine(cfg: Any) -> Any:
        raise AssertionError("the engine was built before the server's files were checked")

    monkeypatch.setattr(launch, "Engine", no_engine)
    empty = tmp_path / "key.txt"
    empty.write_text("\n")
    for cfg, words in [
        (ServerConfig(port=0, api_key_file=str(empty)), "is empty"),
        (ServerConfig(port=0, api_key_file=str(tmp_path / "none.txt")), "none.txt"),
        (ServerConfig(port=0, chat_template=str(tmp_path / "none.jinja")), "none.jinja"),
    ]:
        for run in (launch.serve, launch.start_server):
            with pytest.raises(oscarkv.errors.InputError, match=words):
                run(_engine_cfg(), cfg)


def test_concurrent_requests(srv: RunningServer) -> None:
    import asyncio

    async def main() -> list[Any]:
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        jobs = [c.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=6 + i, temperature=0)
                for i in range(8)]  # fmt: skip
        return await asyncio.gather(*jobs)

    for i, r in enumerate(asyncio.run(main())):
        assert r.usage.completion_tokens == 6 + i and r.choices[0].finish_reason == "length"
    wait_idle(srv)
