"""`benchmarks/bench_serving.py` against a fake OpenAI SSE server (uvicorn + FastAPI in a thread)
that streams known chunks with known delays: token counts, TTFT / ITL / TPOT, the concurrency cap,
Poisson arrivals, errors (HTTP 500) and the results file."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
FIRST, GAP = 0.05, 0.01  # the fake server's delay before the first chunk and between chunks


class Fake:
    """What the fake server saw."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.inflight = self.max_inflight = 0
        self.bodies: list[dict[str, Any]] = []
        self.auth: set[str | None] = set()


def fake_app(seen: Fake) -> Any:
    """``model`` picks the behaviour: ``fake`` streams; ``fail3`` answers every third request with
    500; ``nousage`` streams without a usage chunk."""
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    async def handle(request: fastapi.Request, chat: bool) -> Any:
        body = await request.json()
        seen.bodies.append(body)
        seen.auth.add(request.headers.get("authorization"))
        model = body["model"]
        n = seen.count[model] = seen.count.get(model, 0) + 1
        if model == "fail3" and n % 3 == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        k = int(body["max_tokens"])

        def chunk(text: str, finish: str | None = None) -> str:
            c = {"index": 0, "finish_reason": finish}
            c.update({"delta": {"content": text}} if chat else {"text": text})
            return f"data: {json.dumps({'choices': [c]})}\n\n"

        async def gen() -> Any:
            seen.inflight += 1
            seen.max_inflight = max(seen.max_inflight, seen.inflight)
            try:
                await asyncio.sleep(FIRST)
                for i in range(k):
                    if i:
                        await asyncio.sleep(GAP)
                    yield chunk(f" w{i}")
                yield chunk("", "length")
                if model != "nousage" and body.get("stream_options", {}).get("include_usage"):
                    p = body.get("prompt") or body["messages"][0]["content"]
                    n_in = len(p) if isinstance(p, list) else len(p.split())
                    usage = {"prompt_tokens": n_in, "completion_tokens": k, "total_tokens": n_in + k}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                seen.inflight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request) -> Any:
        return await handle(request, chat=True)

    return app


@pytest.fixture
def server() -> Iterator[tuple[str, Fake]]:
    seen = Fake()
    cfg = uvicorn.Config(fake_app(seen), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    srv = uvicorn.Server(cfg)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t = time.monotonic()
    while not srv.started:
        assert th.is_alive() and time.monotonic() - t < 10, "fake server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", seen
    srv.should_exit = True
    th.join(5)


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(BENCH))
    import _harness

    monkeypatch.setattr(_harness, "RESULTS", tmp_path)
    monkeypatch.setattr(_harness, "HISTORY", tmp_path / "history.csv")
    monkeypatch.setattr(_harness, "git_commit", lambda: "test")
    import bench_serving

    yield bench_serving
    for mod in ("bench_serving", "_harness"):
        sys.modules.pop(mod, None)


def test_streams_are_timed_and_counted(server, bench) -> None:
    url, seen = server
    specs = bench.make_requests(6, 8, 5, range_ratio=0.4, seed=3)
    assert len({s.output_len for s in specs}) > 1 and all(3 <= s.output_len <= 7 for s in specs)
    results, duration = asyncio.run(bench.run_load(url, "fake", specs, concurrency=3, api_key="k"))
    assert seen.max_inflight == 3 and seen.auth == {"Bearer k"}
    assert next(b["max_tokens"] for b in seen.bodies if b["prompt"] == specs[0].prompt) == specs[0].output_len
    for spec, r in zip(specs, results, strict=True):
        assert r.ok and not r.error
        assert r.output_tokens == spec.output_len and len(r.itl) == spec.output_len - 1
        assert FIRST * 0.9 <= r.ttft < r.e2e
        # single gaps may coalesce in the socket buffers; their sum cannot
        assert sum(r.itl) >= (spec.output_len - 1) * GAP * 0.8
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / (spec.output_len - 1)) and r.tpot >= GAP * 0.8
    # 6 requests, 3 at a time: two waves of at least FIRST + 2 gaps each
    assert duration >= 2 * (FIRST + 2 * GAP)
    s = bench.summarize(results, duration)
    assert s["completed"] == 6 and s["errors"] == 0
    assert s["output_tokens"] == sum(x.output_len for x in specs)
    assert s["input_tokens"] == sum(x.input_len for x in specs)
    assert s["output_throughput"] == pytest.approx(s["output_tokens"] / duration)
    for k in ("ttft", "tpot", "itl", "e2e"):
        assert s[k]["p50_ms"] <= s[k]["p90_ms"] <= s[k]["p99_ms"]
    assert FIRST * 1e3 * 0.9 <= s["ttft"]["p50_ms"] < s["e2e"]["p50_ms"]
    assert GAP * 1e3 * 0.8 <= s["tpot"]["p50_ms"] < s["ttft"]["p50_ms"]


def test_chat_token_ids_and_chunk_counting(server, bench) -> None:
    url, seen = server
    specs = bench.make_requests(3, 12, 4, prompt_type="token-ids", vocab_size=50)
    res, _ = asyncio.run(bench.run_load(url, "nousage", specs))  # tokens counted from chunks
    assert [r.output_tokens for r in res] == [4, 4, 4] and all(r.ok for r in res)
    sent = [b["prompt"] for b in seen.bodies]
    assert all(isinstance(p, list) and len(p) == 12 and all(10 <= t < 50 for t in p) for p in sent)
    res, _ = asyncio.run(bench.run_load(url + "/v1/", "fake", specs[:2], chat=True))
    assert [r.output_tokens for r in res] == [4, 4] and all(r.ttft is not None for r in res)
    assert seen.bodies[-1]["messages"][0]["role"] == "user"


def test_http_500_is_counted_as_an_error(server, bench) -> None:
    url, _ = server
    specs = bench.make_requests(6, 4, 3)
    res, duration = asyncio.run(bench.run_load(url, "fail3", specs, concurrency=1))
    s = bench.summarize(res, duration)
    assert s["errors"] == 2 and s["completed"] == 4
    assert [r.ok for r in res] == [True, True, False, True, True, False]
    assert s["output_tokens"] == 4 * 3 and any("HTTP 500" in e for e in s["error_samples"])
    # nothing listening: every request is an error, not a crash
    res, _ = asyncio.run(bench.run_load("http://127.0.0.1:9", "fake", specs[:2], timeout_s=5))
    assert [r.ok for r in res] == [False, False] and all(r.error for r in res)


def test_poisson_arrivals_are_seeded_and_respected(server, bench) -> None:
    a = bench.arrival_times(4000, 20.0, seed=1)
    assert a == bench.arrival_times(4000, 20.0, seed=1) != bench.arrival_times(4000, 20.0, seed=2)
    assert a[0] == 0 and all(x <= y for x, y in itertools.pairwise(a))
    assert a[-1] / (len(a) - 1) == pytest.approx(1 / 20.0, rel=0.08)
    assert bench.arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    url, _ = server
    specs = bench.make_requests(5, 4, 2)
    res, duration = asyncio.run(bench.run_load(url, "fake", specs, request_rate=40.0, seed=4))
    times = bench.arrival_times(5, 40.0, seed=4)
    assert all(r.ok and r.start >= t - 1e-3 for r, t in zip(res, times, strict=True))
    assert duration >= times[-1] + FIRST


def test_main_saves_results_and_history(server, bench, tmp_path) -> None:
    url, _ = server
    s = bench.main(["--url", url, "--num-requests", "4", "--concurrency", "2", "--input-len", "6",
                    "--output-len", "3", "--no-progress", "--name", "smoke"])  # fmt: skip
    assert s["completed"] == 4 and s["errors"] == 0 and s["output_tokens"] == 12
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["model"] == "fake" and saved["env"]["commit"] == "test"
    assert saved["summary"]["output_tokens"] == 12 and len(saved["requests"]) == 4
    assert "TTFT" in (tmp_path / "smoke.md").read_text()
    rows = (tmp_path / "history.csv").read_text().splitlines()
    assert any(",smoke,4x6x3@c2rinf,output_throughput," in r for r in rows)


def test_start_demo_against_the_real_server(bench, tmp_path) -> None:
    launch = pytest.importorskip("oscarkv.server.launch")
    if not hasattr(launch, "start_server"):
        pytest.skip("oscarkv.server.launch has no start_server yet")
    s = bench.main(["--start-demo", "--num-requests", "3", "--concurrency", "3", "--input-len", "8",
                    "--output-len", "4", "--ignore-eos", "--prompt-type", "token-ids", "--no-progress",
                    "--name", "demo"])  # fmt: skip
    assert s["errors"] == 0 and s["completed"] == 3 and s["output_tokens"] == 12


def test_demo_server_metrics_match_the_load(bench) -> None:
    """The load generator and the server's /metrics agree on what was served."""
    launch = pytest.importorskip("oscarkv.server.launch")
    if not hasattr(launch, "start_server"):
        pytest.skip("oscarkv.server.launch has no start_server yet")
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from oscarkv.config import EngineConfig
    from oscarkv.config.server import ServerConfig
    from oscarkv.demo import demo_model_path
    from oscarkv.server.metrics import ServerMetrics

    m = ServerMetrics()
    cfg = EngineConfig(model=str(demo_model_path()), kv_dtype="bf16", device="cpu")
    srv = launch.start_server(cfg, ServerConfig(port=0), metrics=m)
    try:
        model = asyncio.run(bench.first_model(srv.url, None))
        specs = bench.make_requests(4, 20, 5, prompt_type="token-ids", seed=1)
        res, _ = asyncio.run(bench.run_load(srv.url, model, specs, concurrency=2, extra={"ignore_eos": True}))
        text = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    assert all(r.ok for r in res) and sum(r.output_tokens for r in res) == 20
    assert got[("oscarkv_generation_tokens_total", ())] == 20
    assert got[("oscarkv_prompt_tokens_total", ())] == 80
    assert got[("oscarkv_requests_finished_total", (("finish_reason", "length"),))] == 4
    assert got[("oscarkv_time_to_first_token_seconds_count", ())] == 4
    assert got[("oscarkv_requests_running", ())] == got[("oscarkv_requests_waiting", ())] == 0
    assert got[("oscarkv_kv_pages_used", (("tier", "hp"),))] == 0
    assert got[("oscarkv_engine_decode_tokens_total", ())] > 0
