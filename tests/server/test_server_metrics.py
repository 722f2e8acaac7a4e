"""`ServerMetrics` over a real demo-model engine (BF16 pages, CPU): the rendered Prometheus text
equals what the requests did (tokens, finish reasons, prefix hits, engine totals, idle pages)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oscarkv import LLM, SamplingParams
from oscarkv.demo import demo_model_path
from oscarkv.engine.load import EngineLoad, PoolLoad
from oscarkv.engine.request import RequestOutput
from oscarkv.server.metrics import ServerMetrics

PROMPT = list(range(100, 140))  # 40 token ids: two full 16-token pages can be reused


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, ctype = metrics.render()
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(got: dict, name: str, **labels: str) -> float:
    return got[(name, tuple(sorted(labels.items())))]


def tpot(o: RequestOutput) -> float | None:
    n = len(o.token_ids)
    if o.ttft_s is None or o.e2e_s is None or n < 2:
        return None
    return (o.e2e_s - o.ttft_s) / (n - 1)


def observe(m: ServerMetrics, o: RequestOutput) -> None:
    m.observe_finished(len(o.prompt_token_ids), len(o.token_ids), o.num_cached_tokens,
                       o.finish_reason or "", o.ttft_s, tpot(o), o.e2e_s or 0.0)  # fmt: skip


def drain(llm: LLM, m: ServerMetrics, done: list[RequestOutput]) -> None:
    eng = llm.engine
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done.append(o)
                observe(m, o)
        m.update_engine(eng)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_model_path()), kv_dtype="bf16", device="cpu", kv_budget_gb=0.01)


def test_metrics_mirror_a_real_engine(llm: LLM) -> None:
    eng, m = llm.engine, ServerMetrics()
    greedy = dict(temperature=0.0)
    done: list[RequestOutput] = []

    # two requests in flight: the gauges see them and their pages
    eng.add_request(PROMPT, SamplingParams(max_tokens=4, **greedy))
    eng.add_request(list(range(300, 320)), SamplingParams(max_tokens=3, **greedy))
    m.update_engine(eng)
    got = samples(m)
    assert value(got, "oscarkv_requests_waiting") + value(got, "oscarkv_requests_running") == 2
    for o in eng.step():
        assert not o.finished
    m.update_engine(eng)
    got = samples(m)
    used = eng.hp.capacity - eng.hp.n_free
    assert used > 0 and value(got, "oscarkv_kv_pages_used", tier="hp") == used
    assert value(got, "oscarkv_requests_running") == len(eng.scheduler.running) > 0
    load = eng.load()  # the engine's public read of the same state
    assert (load.running, load.waiting) == (len(eng.scheduler.running), len(eng.scheduler.waiting))
    assert load.pools["hp"] == PoolLoad(eng.hp.n_free, eng.hp.n_cached, eng.hp.capacity)
    assert "int2" not in load.pools  # bf16 engine: no INT2 pool
    drain(llm, m, done)
    first = next(o for o in done if o.prompt_token_ids == PROMPT)

    # the same prompt again: a prefix hit; then a stop token id; then an abort mid-flight
    eng.add_request(PROMPT, SamplingParams(max_tokens=3, **greedy))
    drain(llm, m, done)
    assert done[-1].num_cached_tokens == 32
    eng.add_request(PROMPT, SamplingParams(max_tokens=8, stop_token_ids=(first.token_ids[1],), **greedy))
    drain(llm, m, done)
    assert done[-1].finish_reason == "stop"
    rid = eng.add_request(list(range(500, 530)), SamplingParams(max_tokens=50, **greedy))
    for _ in range(3):
        eng.step()
    eng.abort(rid)
    drain(llm, m, done)
    m.update_engine(eng)  # a second read with nothing new must not add to the counters

    got = samples(m)
    assert len(done) == 5
    for reason in ("stop", "length", "abort"):
        n = sum(o.finish_reason == reason for o in done)
        assert (
            value(got, "oscarkv_requests_finished_total", finish_reason=reason)
            == n
            == (3 if reason == "length" else 1)
        )
    assert value(got, "oscarkv_prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in done)
    assert value(got, "oscarkv_generation_tokens_total") == sum(len(o.token_ids) for o in done)
    hits = sum(o.num_cached_tokens for o in done)
    assert value(got, "oscarkv_prefix_hit_tokens_total") == hits == eng.stats["cached_tokens"] >= 64
    for key, name in (("steps", "engine_steps"), ("prefill_tokens", "engine_prefill_tokens"),
                      ("decode_tokens", "engine_decode_tokens"), ("preemptions", "preemptions")):  # fmt: skip
        assert value(got, f"oscarkv_{name}_total") == eng.stats[key]
    assert eng.stats["steps"] > 0 and eng.stats["decode_tokens"] > 0

    # histograms: one observation per request (TPOT only with two tokens or more)
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    tpots = [t for t in map(tpot, done) if t is not None]
    assert value(got, "oscarkv_time_to_first_token_seconds_count") == len(ttfts) >= 4
    assert value(got, "oscarkv_time_to_first_token_seconds_sum") == pytest.approx(sum(ttfts))
    assert value(got, "oscarkv_time_per_output_token_seconds_count") == len(tpots) >= 4
    assert value(got, "oscarkv_time_per_output_token_seconds_sum") == pytest.approx(sum(tpots))
    assert value(got, "oscarkv_e2e_request_latency_seconds_count") == 5
    assert value(got, "oscarkv_e2e_request_latency_seconds_bucket", le="+Inf") == 5

    # idle: every page back to free (the prompts' full pages stay cached), no int2 tier in bf16
    assert value(got, "oscarkv_requests_running") == value(got, "oscarkv_requests_waiting") == 0
    assert value(got, "oscarkv_kv_pages_used", tier="hp") == 0
    assert value(got, "oscarkv_kv_pages_free", tier="hp") == eng.hp.capacity > 0
    assert value(got, "oscarkv_kv_pages_capacity", tier="hp") == eng.hp.capacity
    assert value(got, "oscarkv_kv_pages_cached", tier="hp") == eng.hp.n_cached > 0
    rep = eng.memory_report()
    assert value(got, "oscarkv_kv_bytes", tier="hp") == rep["hp_bytes"] > 0
    for g in ("kv_pages_free", "kv_pages_used", "kv_pages_cached", "kv_pages_capacity", "kv_bytes"):
        assert value(got, f"oscarkv_{g}", tier="int2") == 0


def test_registries_are_private_and_engine_counters_follow_the_totals() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.observe_finished(10, 3, 0, "length", 0.05, 0.01, 0.1)
    assert value(samples(a), "oscarkv_requests_finished_total", finish_reason="length") == 1
    got_b = samples(b)
    assert value(got_b, "oscarkv_requests_finished_total", finish_reason="length") == 0
    assert value(got_b, "oscarkv_time_to_first_token_seconds_count") == 0

    pool = PoolLoad(free=7, cached=2, capacity=10)

    class Eng:
        def __init__(self) -> None:
            self.stats = {"steps": 5, "prefill_tokens": 40, "decode_tokens": 9, "preemptions": 1}

        def load(self) -> EngineLoad:
            return EngineLoad(running=1, waiting=2, pools={"hp": pool, "int2": pool})

        def memory_report(self) -> dict:
            return {"hp_bytes": 1000, "int2_bytes": 250}

    eng = Eng()
    b.update_engine(eng)
    b.update_engine(eng)
    eng.stats = {**eng.stats, "steps": 8, "preemptions": 3}
    b.update_engine(eng)
    got = samples(b)
    assert value(got, "oscarkv_engine_steps_total") == 8
    assert value(got, "oscarkv_preemptions_total") == 3
    assert value(got, "oscarkv_engine_prefill_tokens_total") == 40
    assert value(got, "oscarkv_requests_waiting") == 2 and value(got, "oscarkv_requests_running") == 1
    for tier in ("hp", "int2"):
        assert value(got, "oscarkv_kv_pages_used", tier=tier) == 3
        assert value(got, "oscarkv_kv_pages_cached", tier=tier) == 2
    assert value(got, "oscarkv_kv_bytes", tier="int2") == 250
