"""Host cost of one decode step's plan (plan_decode_host with the engine's page tables) at 49
requests x 1K / 16K / 32K stored tokens, and the device cost of expanding its lists (CUDA)."""

from __future__ import annotations

import sys
import time

import torch

from oscarkv import QuantSpec
from oscarkv.engine.graphs import len_bucket
from oscarkv.engine.planner import fill_lists, plan_decode_host
from oscarkv.engine.request import Batch, SamplingParams, Sequence, StepSeq
from oscarkv.quant.tiers import TierState, apply_moves, plan_moves, window_limit
from oscarkv.store import PageTables, PoolPlan

spec = QuantSpec()
ps, B = 16, 49
ring = window_limit(spec)
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
for ctx in (1024, 16384, 32768):
    plan = PoolPlan(True, ps, 56, spec.sink_tokens // ps, 10**6, 10**4, ring, -(-ring // ps) * ps, 1, 1, 1)
    tables = PageTables.for_plan(plan, 40000, dev)
    seqs, nxt = [], 1
    for i in range(B):
        s = Sequence(f"r{i}", list(range(ctx)), SamplingParams())
        s.slot, s.epoch = i, i
        st = TierState()
        apply_moves(st, plan_moves(st, ctx, False, spec, sink_target=spec.sink_tokens), ring)
        s.tiers = st
        s.hp_pages = list(range(1 + 4 * i, 5 + 4 * i))
        nq = -(-(st.n_q + 16) // ps)
        s.q_pages = list(range(nxt, nxt + nq))
        nxt += nq
        seqs.append(s)
    times, dev_ms = [], []
    for _k in range(30):
        items = []
        for s in seqs:
            m = plan_moves(s.tiers, 1, True, spec, sink_target=spec.sink_tokens)
            items.append(StepSeq(s, ctx, 1, TierState(**vars(s.tiers)), m, True))
        t = time.perf_counter()
        h = plan_decode_host(
            Batch("decode", tuple(items)),
            plan,
            56,
            spec.demote_block,
            len_bucket,
            tables=tables,
            host_lists=dev.type == "cpu",
        )
        times.append(time.perf_counter() - t)
        if dev.type == "cuda":
            d64 = h.h64[: h.layout.n64].to(dev)
            d32 = torch.zeros(h.layout.n32, dtype=torch.int32, device=dev)
            d32[: h.used32] = h.h32[: h.used32].to(dev)
            tables.apply(h.changes.to(dev))
            p = h.views(d64, d32)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fill_lists(p, tables, plan)
            b.record()
            torch.cuda.synchronize()
            dev_ms.append(a.elapsed_time(b))
    times.sort()
    print(
        f"{B} x {ctx}: host plan median {1e3 * times[len(times) // 2]:.3f} ms (first {1e3 * max(times):.2f} ms)"
        + (
            f", device list expansion median {sorted(dev_ms)[len(dev_ms) // 2] * 1e3:.0f} us"
            if dev_ms
            else ""
        )
    )
