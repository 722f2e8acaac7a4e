"""Soak: 64 concurrent streaming clients against a live server over the demo model (BF16 pages,
and INT2 with a random rotation artifact), a quarter of them hanging up mid-stream. Afterwards
every completed stream is well formed and equals ``LLM.generate`` on the same prompts, the engine
is idle with every page back, and ``/metrics`` counts exactly what the clients saw."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_demo import wait_idle

from conftest import random_rotation_set
from oscarkv import LLM, EngineConfig, QuantSpec, SamplingParams, save_rotations
from oscarkv.config import ServerConfig
from oscarkv.demo import demo_model_path
from oscarkv.server.launch import start_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # tiny tensors

SPEC = QuantSpec(sink_tokens=16, recent_tokens=32, demote_block=8)
VOCAB = 2048  # the demo tokenizer's
CLIENTS, PER_CLIENT = 64, 3
MAX_TOKENS = 8  # completed requests
HANGUP_MAX_TOKENS = 400  # far more than a hang-up can see: the server must abort it
HANGUP_AFTER = 2  # chunks read before closing the response
STOPS = ["e", " t"]


@dataclass
class Req:
    i: int
    prompt: list[int]
    body: dict
    hangup: bool


@dataclass
class Seen:
    """What one client saw of one request."""

    chunks: list[dict] = field(default_factory=list)
    done: bool = False  # got ``data: [DONE]``
    status: int = 0


@pytest.fixture(scope="module")
def rotations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rs = random_rotation_set(4, 128, SPEC)
    d = tmp_path_factory.mktemp("rot")
    save_rotations(rs, d)
    return d


def _cfg(kv: str, rotations: Path) -> EngineConfig:
    kw: dict = {"rotations": str(rotations), "spec": SPEC} if kv == "int2" else {}
    return EngineConfig(model=str(demo_model_path()), kv_dtype=kv, device="cpu", max_running=16,
                        page_tokens=8, **kw)  # fmt: skip


def _requests() -> list[Req]:
    """Distinct prompts (no shared page-sized prefix); half greedy, half seeded sampling; every
    fourth request hangs up; one in ten carries stop strings."""
    rng = random.Random(1234)
    out = []
    for i in range(CLIENTS * PER_CLIENT):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))]
        hangup = i % 4 == 1
        body: dict = {"model": "demo-model", "prompt": prompt, "stream": True,
                      "stream_options": {"include_usage": True}}  # fmt: skip
        if i % 2:
            body |= {"temperature": 0}
        else:
            body |= {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
        if hangup:
            body |= {"max_tokens": HANGUP_MAX_TOKENS, "ignore_eos": True}
        else:
            body |= {"max_tokens": MAX_TOKENS}
            if i % 10 == 0:
                body |= {"stop": STOPS}
        out.append(Req(i, prompt, body, hangup))
    return out


async def _one(client: httpx.AsyncClient, r: Req) -> Seen:
    seen = Seen()
    async with client.stream("POST", "/v1/completions", json=r.body) as resp:
        seen.status = resp.status_code
        if resp.status_code != 200:
            await resp.aread()
            return seen
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            if data == "[DONE]":
                seen.done = True
                continue
            assert not seen.done, "data after [DONE]"
            seen.chunks.append(json.loads(data))
            if r.hangup and len(seen.chunks) >= HANGUP_AFTER:
                break  # leaving the block closes the response mid-stream
    return seen


async def _soak(url: str, reqs: list[Req]) -> list[Seen]:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker(c: int) -> list[tuple[int, Seen]]:
            mine = [r for r in reqs if r.i % CLIENTS == c]
            return [(r.i, await _one(client, r)) for r in mine]

        results = await asyncio.gather(*(worker(c) for c in range(CLIENTS)))
    seen: list[Seen | None] = [None] * len(reqs)
    for rows in results:
        for i, s in rows:
            seen[i] = s
    assert all(s is not None for s in seen)
    return seen  # type: ignore[return-value]


def _check_stream(r: Req, s: Seen) -> tuple[str, str, dict]:
    """A completed stream is well formed; returns its text, finish reason and usage."""
    assert s.status == 200 and s.done, (r.i, s.status)
    ids = {ch["id"] for ch in s.chunks}
    assert len(ids) == 1 and all(ch["object"] == "text_completion" for ch in s.chunks)
    *texts, last = s.chunks
    assert last["choices"] == [] and last["usage"] is not None, last  # the usage-only chunk
    assert texts and all(len(ch["choices"]) == 1 for ch in texts)
    assert all(ch["usage"] is None for ch in texts)
    finishes = [ch["choices"][0]["finish_reason"] for ch in texts]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] in ("stop", "length"), finishes
    text = "".join(ch["choices"][0]["text"] for ch in texts)
    u = last["usage"]
    assert u["prompt_tokens"] == len(r.prompt)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 1 <= u["completion_tokens"] <= r.body["max_tokens"]
    if finishes[-1] == "length":
        assert u["completion_tokens"] == r.body["max_tokens"]
    return text, finishes[-1], u


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    body = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }


@pytest.mark.parametrize("kv", ["bf16", "int2"])
def test_soak_concurrent_streams_with_hangups(kv: str, rotations: Path) -> None:
    cfg = _cfg(kv, rotations)
    reqs = _requests()
    t0 = time.monotonic()
    with start_server(cfg, ServerConfig(port=0)) as srv:
        seen = asyncio.run(_soak(srv.url, reqs))
        t_soak = time.monotonic() - t0
        wait_idle(srv)
        got = _metrics(srv.url)
        assert srv.engine.q is None if kv == "bf16" else srv.engine.q is not None

    # ---- every stream: hang-ups saw their chunks, completed ones are well formed
    done: dict[int, tuple[str, str, dict]] = {}
    for r, s in zip(reqs, seen, strict=True):
        if r.hangup:
            assert s.status == 200 and not s.done and len(s.chunks) == HANGUP_AFTER, r.i
            assert all(ch["choices"][0]["finish_reason"] is None for ch in s.chunks)
        else:
            done[r.i] = _check_stream(r, s)
    hangups = sum(r.hangup for r in reqs)
    assert hangups == len(reqs) // 4 and len(done) == len(reqs) - hangups

    # ---- the same prompts through LLM.generate (one batch, another composition) agree exactly
    todo = [r for r in reqs if not r.hangup]
    params = [
        SamplingParams(
            max_tokens=r.body["max_tokens"],
            temperature=r.body["temperature"],
            top_p=r.body.get("top_p", 1.0),
            seed=r.body.get("seed"),
            stop=tuple(r.body.get("stop", ())),
        )
        for r in todo
    ]
    t1 = time.monotonic()
    refs = LLM.from_config(cfg).generate([r.prompt for r in todo], params)
    t_ref = time.monotonic() - t1
    for r, ref in zip(todo, refs, strict=True):
        text, finish, usage = done[r.i]
        assert (text, finish) == (ref.text, ref.finish_reason), (r.i, r.body, text, ref.text)
        assert usage["completion_tokens"] == len(ref.token_ids)
    stopped = [r for r in todo if "stop" in r.body]
    assert any(done[r.i][1] == "stop" for r in stopped), "no stop string ever matched"
    assert all(s not in done[r.i][0] for r in stopped for s in STOPS)

    # ---- /metrics equals what the clients saw
    def val(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    reasons = [f for _, f, _ in done.values()]
    assert val("oscarkv_requests_finished_total", finish_reason="stop") == reasons.count("stop")
    assert val("oscarkv_requests_finished_total", finish_reason="length") == reasons.count("length")
    assert val("oscarkv_requests_finished_total", finish_reason="abort") == hangups
    assert val("oscarkv_e2e_request_latency_seconds_count") == len(reqs)
    assert val("oscarkv_prompt_tokens_total") == sum(len(r.prompt) for r in reqs)
    gen_done = sum(u["completion_tokens"] for _, _, u in done.values())
    gen = val("oscarkv_generation_tokens_total")
    # a hang-up generated at least one token per chunk it saw, and fewer than it asked for
    assert gen_done + HANGUP_AFTER * hangups <= gen < gen_done + HANGUP_MAX_TOKENS * hangups
    assert val("oscarkv_preemptions_total") == 0  # 8191 pages: nothing recomputed from cached pages
    assert val("oscarkv_prefix_hit_tokens_total") == 0  # distinct prompts share no page
    for tier in ("hp", "int2"):
        assert val("oscarkv_kv_pages_used", tier=tier) == 0
    assert val("oscarkv_kv_pages_capacity", tier="int2") == (0 if kv == "bf16" else srv.engine.q.capacity)
    assert val("oscarkv_requests_running") == val("oscarkv_requests_waiting") == 0
    print(f"\n{kv}: soak {t_soak:.1f} s for {len(reqs)} requests ({hangups} hang-ups), "
          f"reference {t_ref:.1f} s, {int(gen)} tokens generated")  # fmt: skip
