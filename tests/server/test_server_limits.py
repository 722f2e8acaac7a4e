"""Bounded work per request (live server, demo model, CPU): a request's fan-out (prompts x n)
counted where it lands, capped per request in choices and tokens; one request's choices taking
at most their share of the running slots; every choice aborted when the client leaves; large
answers built off the event loop, so ``/health`` and a short request beside a huge one are
served."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_demo import MODEL, engine_config, serve_with_template, wait_idle

from oscarkv.config import ServerConfig
from oscarkv.server.launch import RunningServer, start_server

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv() -> Iterator[RunningServer]:
    """4 running slots, a request's choices 2 of them at a time (the default share, 0.5)."""
    s = start_server(engine_config(), ServerConfig(port=0))
    assert s.async_engine.group_slots == 2
    yield s
    s.stop()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


# ---- fan-out: counted in choices, capped per request --------------------------------------------
def test_a_fan_out_of_millions_is_refused_at_once_and_leaves_nothing_behind(srv: RunningServer) -> None:
    """195,000 one-token prompts x n=16 (975 KB): 3.12 M choices, refused before any is added;
    the server is idle at once and its memory where it was."""
    body = json.dumps({"model": MODEL, "prompt": [[1]] * 195_000, "n": 16, "max_tokens": 1})
    assert len(body) < 1_000_000  # under --max-body-bytes: the request is read and parsed
    httpx.post(srv.url + "/v1/completions", content=body, headers=JSON, timeout=60)  # warm the parser
    gc.collect()
    before = _rss_mb()
    for _ in range(3):
        r = httpx.post(srv.url + "/v1/completions", content=body, headers=JSON, timeout=30)
        err = _error(r, 400, "n")
        assert err["code"] == "too_many_choices" and "--max-request-choices" in err["message"]
        assert wait_idle(srv, timeout=5) < 5
    gc.collect()
    assert _rss_mb() < before * 1.05


def test_max_queued_counts_choices_not_requests() -> None:
    s = start_server(engine_config(), ServerConfig(port=0, max_queued=4))
    try:
        # 8 one-token choices never fit 4 places, even though each would finish before the next
        ids = [[5, 6, 7]] * 8
        r = httpx.post(
            s.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=60
        )
        assert "--max-queued" in _error(r, 400, "prompt")["message"]
        long = {"model": MODEL, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=60) as held:
            lines = held.iter_lines()
            next(lines)  # one choice live: 3 places left
            body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2}
            busy = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert _error(busy, 503, None)["code"] == "unavailable" and busy.headers["retry-after"] == "1"
            assert s.async_engine.num_live == 1  # none of the four was added
            ok = httpx.post(
                s.url + "/v1/completions", json={**body, "n": 1, "prompt": ["a", "b", "c"]}, timeout=60
            )
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 3
        wait_idle(s)
    finally:
        s.stop()


def test_a_request_is_capped_in_choices_and_tokens_naming_the_field(tmp_path: Path) -> None:
    s = serve_with_template(tmp_path, engine=engine_config(), max_request_choices=6, max_request_tokens=100)
    try:
        url = s.url + "/v1/completions"
        r = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 4, "n": 2, "max_tokens": 1})
        assert "8 choices" in _error(r, 400, "n")["message"]
        _error(httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 7, "max_tokens": 1}), 400, "prompt")
        # 2 choices of 60 prompt tokens + 1 = 122 tokens > 100
        r = httpx.post(url, json={"model": MODEL, "prompt": [5] * 60, "n": 2, "max_tokens": 1})
        err = _error(r, 400, "n")
        assert err["code"] == "too_many_tokens" and "--max-request-tokens" in err["message"]
        _error(httpx.post(url, json={"model": MODEL, "prompt": [5] * 60, "max_tokens": 50}), 400, "prompt")
        assert (
            httpx.post(url, json={"model": MODEL, "prompt": [5] * 40, "n": 2, "max_tokens": 1}).status_code
            == 200
        )
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}
        chat_url = s.url + "/v1/chat/completions"
        assert _error(httpx.post(chat_url, json={**chat, "n": 2}), 400, "n")["code"] == "too_many_tokens"
        _error(httpx.post(chat_url, json={**chat, "max_tokens": 120}), 400, "messages")
        _error(httpx.post(chat_url, json={**chat, "max_tokens": 1, "n": 7}), 400, "n")
        assert httpx.post(chat_url, json={**chat, "n": 1}).status_code == 200
        assert s.async_engine.num_live == 0
    finally:
        s.stop()
    assert ServerConfig().max_request_tokens is None  # unset: 64 x max_model_len


# ---- the share of the running slots -----------------------------------------------------------
def test_one_request_runs_at_most_its_share_of_the_slots(srv: RunningServer) -> None:
    """n=6 long choices run two at a time (the rest wait in the server, in order); a second
    request beside them is admitted at once and done long before them; all six finish."""
    wait_idle(srv)
    phase, seen, stop = ["big"], [], threading.Event()

    def sample() -> None:  # the engine's running count every 5 ms, with what had been sent
        while not stop.is_set():
            seen.append((phase[0], srv.engine.load().running))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    big = {
        "model": MODEL,
        "prompt": "Once upon",
        "n": 6,
        "max_tokens": 40,
        "ignore_eos": True,
        "temperature": 0,
    }
    res: dict[str, Any] = {}
    t = threading.Thread(target=lambda: res.update(r=httpx.post(srv.url + "/v1/completions", json=big, timeout=120)),
                         daemon=True)  # fmt: skip
    try:
        sampler.start()
        t.start()
        t0 = time.monotonic()
        while srv.engine.load().running < 2:
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
        assert srv.async_engine.num_live == 6  # all six added at once, two of them in the engine
        time.sleep(0.3)
        phase[0] = "both"
        small = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        assert httpx.post(srv.url + "/v1/completions", json=small, timeout=60).status_code == 200
        assert t.is_alive()  # the small request did not wait for the big one's choices
        t.join(120)
    finally:
        stop.set()
    r = res["r"]
    assert r.status_code == 200 and [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 6
    assert len({c["text"] for c in r.json()["choices"]}) == 1  # greedy: the same text, held back or not
    assert max(n for p, n in seen if p == "big") == 2
    assert max(n for p, n in seen) <= 3
    wait_idle(srv)


def test_a_short_request_beside_a_huge_echo_request_is_served_at_once(srv: RunningServer) -> None:
    """A 2,047-token prompt echoed with 20 log-probabilities per token, n=8: eight full prompts
    to score and megabytes to answer. A short request sent beside it gets its first token from
    the next engine step but one (the one running when it came, then its own: the huge
    request's later choices wait for it), and /health answers within 1 s throughout, also
    while the huge answer is built (off the event loop)."""
    wait_idle(srv)
    huge = {"model": MODEL, "prompt": [(7 * j) % 2000 + 3 for j in range(2047)], "echo": True, "logprobs": 20,
            "n": 8, "max_tokens": 1}  # fmt: skip
    res: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: res.update(r=httpx.post(srv.url + "/v1/completions", json=huge, timeout=300))
    )
    t.start()
    t0 = time.monotonic()
    while srv.engine.load().running < 2:  # the huge request's first two choices are prefilling
        assert time.monotonic() - t0 < 30
        time.sleep(0.01)
    short = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
    steps, t1 = srv.engine.stats["steps"], time.monotonic()
    with httpx.stream("POST", srv.url + "/v1/completions", json=short, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        took_steps, ttft = srv.engine.stats["steps"] - steps, time.monotonic() - t1
        assert json.loads(first[6:])["choices"][0]["text"] is not None
    health = []
    while t.is_alive():
        h0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        health.append(time.monotonic() - h0)
        time.sleep(0.05)
    t.join()
    big = res["r"]
    assert big.status_code == 200 and len(big.content) > 5_000_000
    choices = big.json()["choices"]
    assert len(choices) == 8 and all(len(c["logprobs"]["tokens"]) == 2048 for c in choices)
    print(
        f"\nshort request: first token after {ttft:.2f} s, {took_steps} steps; /health at most {max(health):.2f} s"
    )
    assert took_steps <= 2, took_steps
    assert max(health) < 1.0, health


# ---- a client that leaves: every choice aborted -------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_aborts_every_choice(stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 choices of 200 tokens, each engine step slowed to 20 ms (a busy device): the server
    is idle within 5 s of the client leaving, whether it waited for a whole answer or read a
    stream, and however many of its choices had started."""
    s = start_server(
        engine_config(), ServerConfig(port=0, max_request_choices=1000, max_request_tokens=10**6)
    )
    real = s.engine.runner.launch

    def slow(batch: Any, host: Any = None) -> Any:
        time.sleep(0.02)
        return real(batch, host)

    monkeypatch.setattr(s.engine.runner, "launch", slow)
    try:
        body = {"model": MODEL, "prompt": [[5, 6, 7 + i % 100] for i in range(250)], "n": 4, "max_tokens": 200,
                "ignore_eos": True, "stream": stream}  # fmt: skip
        with contextlib.suppress(httpx.ReadTimeout):  # the client gives up after 2 s, or one event
            if stream:
                with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=2) as r:
                    assert r.status_code == 200 and next(r.iter_lines()).startswith("data: ")
            else:
                r = httpx.post(s.url + "/v1/completions", json=body, timeout=2)
                raise AssertionError(f"answered before the client left: {r.text[:200]}")
        assert wait_idle(s, timeout=5) < 5
        assert s.engine.stats["decode_tokens"] < 200 * 1000 // 10  # far from every choice's tokens
        ok = httpx.post(
            s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert ok.status_code == 200
    finally:
        s.stop()
