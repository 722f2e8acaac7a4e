"""`ServerMetrics`: the server's Prometheus metrics (engine.md §6), on a private registry.

Each server (and each test) owns its own :class:`prometheus_client.CollectorRegistry`, so several
can live in one process. Request-level figures come from :meth:`ServerMetrics.observe_finished`
(one call per finished request); engine-level ones from :meth:`ServerMetrics.update_engine`, which
sets the gauges and advances the engine counters by the growth of ``engine.stats`` since the last
call (the engine's totals are monotonic, so the counters mirror them exactly).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["FINISH_REASONS", "TIERS", "ServerMetrics"]

PREFIX = "oscarkv"
TIERS = ("hp", "int2")  # label values of the per-tier metrics: 16-bit pages, INT2 pages
FINISH_REASONS = ("stop", "length", "abort")  # always exported, so rates start from zero
# engine.stats key -> counter name (without prefix and _total) and help text
ENGINE_COUNTERS = {
    "preemptions": ("preemptions", "requests preempted (pages taken back, recomputed later)"),
    "steps": ("engine_steps", "engine steps run (one batch each)"),
    "prefill_tokens": ("engine_prefill_tokens", "prompt tokens computed by prefill (prefix hits excluded)"),
    "decode_tokens": ("engine_decode_tokens", "tokens computed by decode steps"),
}
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    """Gauges, counters and histograms named ``oscarkv_*`` on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}  # engine.stats values already added to the counters
        # gauges (set by update_engine)
        self.running = Gauge(f"{p}_requests_running", "requests in the running batch", registry=r)
        self.waiting = Gauge(f"{p}_requests_waiting", "requests queued for admission", registry=r)
        self.pages_free = Gauge(
            f"{p}_kv_pages_free", "KV pages with no owner (cached ones included)", ["tier"], registry=r
        )
        self.pages_used = Gauge(f"{p}_kv_pages_used", "KV pages owned by requests", ["tier"], registry=r)
        self.pages_cached = Gauge(
            f"{p}_kv_pages_cached", "free KV pages still holding a reusable prefix", ["tier"], registry=r
        )
        self.pages_capacity = Gauge(
            f"{p}_kv_pages_capacity", "KV pages that can be handed out", ["tier"], registry=r
        )
        self.kv_bytes = Gauge(f"{p}_kv_bytes", "bytes allocated for the KV pool", ["tier"], registry=r)
        # counters fed by observe_finished
        self.requests = Counter(
            f"{p}_requests_finished", "finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(
            f"{p}_generation_tokens", "tokens generated for finished requests", registry=r
        )
        self.prefix_hit_tokens = Counter(
            f"{p}_prefix_hit_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        # counters mirrored from engine.stats
        self.engine_counters = {
            key: Counter(f"{p}_{name}", doc, registry=r) for key, (name, doc) in ENGINE_COUNTERS.items()
        }
        # histograms fed by observe_finished
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds", "arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            f"{p}_time_per_output_token_seconds",
            "mean time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds", "arrival to finish", buckets=E2E_BUCKETS, registry=r
        )
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        for tier in TIERS:
            for g in (
                self.pages_free,
                self.pages_used,
                self.pages_cached,
                self.pages_capacity,
                self.kv_bytes,
            ):
                g.labels(tier=tier).set(0)

    def observe_finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        finish_reason: str,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
    ) -> None:
        """Count one finished request; ``ttft_s`` / ``tpot_s`` of ``None`` (no token, or only one)
        are left out of their histograms."""
        self.requests.labels(finish_reason=finish_reason or "unknown").inc()
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generation_tokens.inc(max(0, completion_tokens))
        self.prefix_hit_tokens.inc(max(0, cached_tokens))
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.e2e.observe(e2e_s)

    def update_engine(self, engine: Any) -> None:
        """Read ``engine.load()`` (queues, pools), its KV bytes and ``stats`` into the gauges and counters.

        Reads only (ints and lists, no engine call that mutates), so any thread may call it."""
        load = engine.load()
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        for tier in ("hp", "int2"):
            pool = load.pools.get(tier)
            cap = pool.capacity if pool is not None else 0
            free = pool.free if pool is not None else 0
            self.pages_capacity.labels(tier=tier).set(cap)
            self.pages_free.labels(tier=tier).set(free)
            self.pages_used.labels(tier=tier).set(cap - free)
            self.pages_cached.labels(tier=tier).set(pool.cached if pool is not None else 0)
        rep = engine.memory_report()
        self.kv_bytes.labels(tier="hp").set(rep.get("hp_bytes", 0))
        self.kv_bytes.labels(tier="int2").set(rep.get("int2_bytes", 0))
        stats = dict(engine.stats)
        with self._lock:  # two callers must not both add the same growth
            for key, counter in self.engine_counters.items():
                now = int(stats.get(key, 0))
                grew = now - self._seen.get(key, 0)
                if grew > 0:
                    counter.inc(grew)
                self._seen[key] = now  # also after a drop (a new engine): count on from there

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type (for ``GET /metrics``)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
