"""Prefill steps of one layer driven by hand (tier moves, pages, ``plan_prefill``,
``TierAttention.prefill``) and the per-query mask reference they are checked against: the
harness of the prefill-rule tests (``test_prefill_invariant.py``, ``test_prompt_scoring.py``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import torch

from oscarkv import QuantSpec
from oscarkv.engine import planner
from oscarkv.engine.planner import plan_prefill
from oscarkv.engine.request import Batch, SamplingParams, Sequence, StepSeq
from oscarkv.kernels import resolve
from oscarkv.quant import RowFormat
from oscarkv.quant.tiers import apply_moves, plan_moves
from oscarkv.quant.window import through_window
from oscarkv.store import windows
from oscarkv.store.windows import quantize_dequantize

#: the forms of the rules' key lists a layer test runs: the planner's on the CPU (masked pieces of
#: up to ``PIECE_QUERIES`` queries), masked pieces of at most 10 queries (several runs each, queries
#: in and past the windows together), one varlen piece per run (the device kernels' form)
FORMS = ("masked", "masked-10", "varlen")


def use_form(monkeypatch, form: str) -> None:
    """Make ``plan_prefill`` build the key lists in ``form`` (one of :data:`FORMS`)."""
    if form == "masked-10":
        monkeypatch.setattr(windows, "PIECE_QUERIES", 10)
    real = windows.window_tensors
    masked = form != "varlen"
    monkeypatch.setattr(planner, "window_tensors", lambda *a, **k: real(*a, **{**k, "masked": masked}))


def signed_perm(d: int, gen: torch.Generator) -> torch.Tensor:
    """Orthogonal with exact products (one term per output): rotated rows are bit-stable."""
    sign = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
    return torch.eye(d)[torch.randperm(d, generator=gen)] * sign


def masked_reference(q, k, v, sink: int, start16: Callable[[int], int], scale: float, spec: QuantSpec,
                     window: torch.dtype | None = None, raw_from: Callable[[int], int] | None = None):  # fmt: skip
    """Per query ``t``: key ``s <= t`` in 16 bits iff ``s < sink`` or ``s >= start16(t)``, else its
    INT2 value under ``spec`` (rows already rotated; ``q [T, Hq, d]``, ``k, v [T, Hkv, d]``). With
    fp8 windows (``window``) a 16-bit key is the row as fp8 holds it and an INT2 key that row
    quantized, except keys ``s >= raw_from(t)`` (a fresh prefill's own chunk), read as computed."""
    d, hq, hkv = q.shape[-1], q.shape[1], k.shape[1]
    ops = resolve("torch", "cpu")
    raw_k, raw_v = k, v
    if window is not None:
        k, v = through_window(k, window), through_window(v, window)
    k2 = quantize_dequantize(k, RowFormat.from_spec(spec, d, "k"), ops)
    v2 = quantize_dequantize(v, RowFormat.from_spec(spec, d, "v"), ops)
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        s = torch.arange(t + 1)
        hi = ((s < sink) | (s >= start16(t)))[:, None, None]
        kk, vv = torch.where(hi, k[: t + 1], k2[: t + 1]), torch.where(hi, v[: t + 1], v2[: t + 1])
        if raw_from is not None:
            raw = (s >= raw_from(t))[:, None, None]
            kk, vv = torch.where(raw, raw_k[: t + 1], kk), torch.where(raw, raw_v[: t + 1], vv)
        for h in range(hq):
            w = torch.softmax((kk[:, h * hkv // hq] @ q[t, h]) * scale, 0)
            out[t, h] = w @ vv[:, h * hkv // hq]
    return out


def run_steps(attn, plan, views, spec: QuantSpec, prompts: dict[str, tuple[int, int | None]],
              schedule: list[list[tuple[str, int]]], heads: tuple[int, int, int],
              rng: random.Random | None = None) -> dict:  # fmt: skip
    """Prefill ``prompts`` (rid -> (length, prompt_logprobs)) in the steps of ``schedule`` (each a
    list of (rid, tokens)) through ``attn`` over one layer's ``views``; random q/k/v per prompt
    (seed ``10 + i``; three key channels scaled up). ``heads = (Hq, Hkv, d)``; ``rng`` shuffles
    the free pages and slots. Returns ``outs`` (rid -> output rows), ``seqs``, ``data`` (rid ->
    (q, k, v)), ``starts`` (rid -> each token's chunk start) and ``demoted`` (ring rows demoted)."""
    hq, hkv, d = heads
    ps = plan.page_tokens
    free_h, free_q, slots = (
        list(range(1, plan.hp_pages)),
        list(range(1, plan.q_pages)),
        list(range(plan.max_running)),
    )
    for free in (free_h, free_q, slots) if rng else ():
        rng.shuffle(free)
    seqs, data, outs, starts = {}, {}, {}, {}
    for i, (rid, (n, lp)) in enumerate(prompts.items()):
        seq = Sequence(rid, list(range(n)), SamplingParams(max_tokens=4, prompt_logprobs=lp))
        seq.sink_len, seq.slot = min(n, spec.sink_tokens), slots.pop()
        seqs[rid] = seq
        g = torch.Generator().manual_seed(10 + i)
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
        k[..., :3] *= 6
        data[rid], outs[rid], starts[rid] = (q, k, v), [], []
    ceil = lambda x: -(-x // ps)  # noqa: E731
    demoted = 0
    for work in schedule:
        items = []
        for rid, n in work:
            seq = seqs[rid]
            m = plan_moves(seq.tiers, n, False, spec, sink_target=seq.sink_len)
            pre, post = replace(seq.tiers), replace(seq.tiers)
            apply_moves(post, m, plan.ring)
            seq.hp_pages += [free_h.pop() for _ in range(ceil(post.n_sink) - len(seq.hp_pages))]
            seq.q_pages += [free_q.pop() for _ in range(ceil(post.n_q) - len(seq.q_pages))]
            items.append(StepSeq(seq, seq.n_computed, n, pre, m))
            starts[rid] += [seq.n_computed] * n
            seq.tiers, seq.n_computed = post, seq.n_computed + n
            demoted += m.demote
        rows = [tuple(x[it.start : it.start + it.n_new] for x in data[it.seq.rid]) for it in items]
        q, k, v = (torch.cat([r[j] for r in rows]) for j in range(3))
        p = plan_prefill(Batch("prefill", tuple(items)), plan, "cpu")
        assert p.win_idx is not None
        out = attn.prefill(q, k, v, views, p)
        for it, a, b in zip(items, p.cu_host, p.cu_host[1:], strict=False):
            outs[it.seq.rid].append(out[a:b])
    outs = {rid: torch.cat(o) for rid, o in outs.items()}
    return {"outs": outs, "seqs": seqs, "data": data, "starts": starts, "demoted": demoted}


def check_against_masks(
    attn, res: dict, rules: dict[str, Callable[[int], int]], spec: QuantSpec, scale: float,
    window: torch.dtype | None = None, raw: dict[str, Callable[[int], int]] | None = None,
):  # fmt: skip
    """Every prompt's output rows equal :func:`masked_reference` under its rule ``rules[rid]``
    (``window``, ``raw[rid]``: fp8 windows and a fresh prompt's own chunk, see there)."""
    for rid, (q, k, v) in res["data"].items():
        rot = attn.ops.rotate_rows
        want = masked_reference(rot(q, attn.r_k), rot(k, attn.r_k), rot(v, attn.r_v), res["seqs"][rid].sink_len,
                                rules[rid], scale, spec, window, (raw or {}).get(rid))  # fmt: skip
        want = attn.ops.rotate_rows(want, attn.r_out, inverse=True)
        torch.testing.assert_close(res["outs"][rid], want, atol=1e-5, rtol=1e-5, msg=rid)
