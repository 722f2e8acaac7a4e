"""From a scheduled :class:`~oscarkv.engine.request.Batch` to the device tensors of one step.

The rows come from the store (:mod:`oscarkv.store`): the tier spans of each sequence's moves
(:func:`~oscarkv.store.step_spans`), placed in pages and ring slabs as
:class:`~oscarkv.store.PagedStep` (prefill) and :func:`~oscarkv.store.paged_decode_rows`
(decode) say.

A decode step is built on the host with numpy into one flat buffer per dtype
(``decode_buffers.py``: one copy each to the device, whose views are the
:class:`~oscarkv.store.DecodeTensors`); its lists are filled on the device from the page tables
(:func:`fill_lists`). A prefill expands its lists on the device
(:meth:`~oscarkv.store.Segments.expand`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from ..quant.tiers import TierState
from ..store import (
    DecodeTensors,
    PagedStep,
    PageTables,
    PoolPlan,
    PrefillTensors,
    expand_lists,
    page_row,
    paged_decode_rows,
    post_state,
)
from ..store.windows import SeqWindow, window_tensors
from .decode_buffers import Alloc, DecodeLayout, HostDecode, fresh_buffers
from .request import Batch, Sequence, StepSeq

__all__ = ["decode_scored", "fill_lists", "plan_decode", "plan_decode_host", "plan_prefill"]

_LONG = torch.long


def _post(it: StepSeq, plan: PoolPlan) -> TierState:
    return post_state(it.pre, it.moves, plan.ring)


def _check(it: StepSeq, plan: PoolPlan) -> None:
    pre, m = it.pre, it.moves
    if m.n_new != it.n_new:
        raise ValueError(f"{it.seq.rid}: moves cover {m.n_new} tokens, the step has {it.n_new}")
    if plan.int2:
        held = pre.n_sink + pre.n_q + pre.n_recent
        if held != it.start:
            raise ValueError(
                f"{it.seq.rid}: the tier state holds {held} tokens but the step starts at {it.start}"
            )
        if it.seq.slot is None or not 0 <= it.seq.slot < plan.max_running:
            raise ValueError(f"{it.seq.rid}: request slot {it.seq.slot} is not in [0, {plan.max_running})")
        if pre.n_recent - m.demote + m.to_ring > plan.ring:
            raise ValueError(f"{it.seq.rid}: the moves overflow the ring of {plan.ring}")


def plan_prefill(batch: Batch, plan: PoolPlan, device: torch.device | str) -> PrefillTensors:
    """The tensors of a prefill ``batch`` (chunks of prompts) on ``device``."""
    device = torch.device(device)
    step, cu, pos, last = PagedStep(plan), [0], [], []
    lp_rows: list[int] = []
    lp_target: list[int] = []
    lp_k = 0
    for it in batch.items:
        step.add_seq(it.seq.hp_pages, it.seq.q_pages)
    for i, it in enumerate(batch.items):
        _check(it, plan)
        slot = it.seq.slot or 0
        step.stored(i, slot, it.pre, it.start)
        step.writes(i, slot, it.pre, it.moves, it.start, it.n_new, cu[-1])
        pos.append((it.start, it.n_new))
        cu.append(cu[-1] + it.n_new)
        if it.ends_prompt:
            last.append(cu[-1] - 1)
        if it.seq.params.prompt_logprobs is not None:  # positions whose next token is a prompt token
            n = it.n_prompt_scored
            lp_rows += range(cu[-2], cu[-2] + n)
            lp_target += it.seq.prompt[it.start + 1 : it.start + 1 + n]
            lp_k = max(lp_k, it.seq.params.prompt_logprobs)
    pages, t = step.pages.tensor(device), step.tabs
    starts = torch.tensor([p for p, _ in pos], dtype=_LONG)
    lens = torch.tensor([n for _, n in pos], dtype=_LONG)
    first = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens, output_size=cu[-1])
    positions = (first + torch.arange(cu[-1])).to(device, non_blocking=True)
    q_dst, q_tok = t["q"].expand(pages)
    hp_dst, hp_tok = t["hp"].expand(pages)
    win = _windows(batch, plan, device)
    return PrefillTensors(
        positions=positions,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True),
        cu_host=tuple(cu),
        last_idx=torch.tensor(last, dtype=_LONG).to(device, non_blocking=True),
        pre_q=t["lq"].csr(pages),
        pre_hp=t["lh"].csr(pages),
        q_tok=q_tok,
        q_dst=q_dst,
        hp_tok=hp_tok,
        hp_dst=hp_dst,
        demote_src=t["dem_src"].expand(pages)[0],
        demote_dst=t["dem_dst"].expand(pages)[0],
        lp_idx=torch.tensor(lp_rows, dtype=_LONG).to(device, non_blocking=True) if lp_rows else None,
        lp_target=torch.tensor(lp_target, dtype=_LONG).to(device, non_blocking=True) if lp_rows else None,
        lp_k=lp_k,
        **win,
    )


def decode_scored(seq: Sequence, plan: PoolPlan) -> bool:
    """Whether ``seq``'s prompt is scored under the decode rule (``prompt_scoring="decode"``, int2)."""
    return plan.score_window[1] > 0 and seq.params.prompt_logprobs is not None


def _windows(batch: Batch, plan: PoolPlan, device: torch.device) -> dict:
    """The key lists of the invariant and decode rules (:func:`~oscarkv.store.windows.window_tensors`:
    masked pieces on the CPU, varlen runs for the device kernels); none when no sequence of the
    step follows either."""
    dec = [decode_scored(it.seq, plan) for it in batch.items]
    if not plan.window_block and not any(dec):
        return {}
    seqs = [
        SeqWindow(it.pre.n_sink, it.pre.n_q, it.pre.n_recent, it.start, it.n_new, it.seq.sink_len or 0, d)
        for it, d in zip(batch.items, dec, strict=True)
    ]
    return window_tensors(seqs, plan.window_block, device, plan.score_window, masked=device.type == "cpu")


def _token(seq: Sequence, pos: int) -> int:
    """The token at ``pos``, or -1 while it is still on the device (sampled, not yet read)."""
    n = len(seq.prompt)  # not seq.tokens: that concatenates the whole sequence
    if pos < n:
        return seq.prompt[pos]
    return seq.out[pos - n] if pos - n < len(seq.out) else -1


def plan_decode_host(
    batch: Batch,
    plan: PoolPlan,
    bs_pad: int | None = None,
    demote_block: int = 0,
    bucket: Callable[[int], int] | None = None,
    alloc: Alloc = fresh_buffers,
    tables: PageTables | None = None,
    host_lists: bool = True,
) -> HostDecode:
    """A decode ``batch`` built on the host into buffers from ``alloc``: per-row fields and the
    page-table changes, work in proportion to the batch (not to the tokens it holds). With
    ``bs_pad`` (CUDA), rows ``B .. bs_pad-1`` are padding and the demote lists have the fixed
    length ``bs_pad·demote_block``; with ``bucket``, ``lens_hint`` is bucketed and the lists get a
    graph's capacities (:meth:`DecodeLayout.bucketed`), else exactly their lengths. ``tables``:
    the engine's :class:`PageTables` (updated here); by default fresh ones for this batch.
    ``host_lists``: leave room for the lists in the int32 host buffer (CPU steps fill them there;
    CUDA steps fill them on the device only)."""
    n, ps, ring = len(batch.items), plan.page_tokens, plan.ring
    b = n if bs_pad is None else bs_pad
    if b < n:
        raise ValueError(f"bs_pad {bs_pad} is smaller than the batch ({n})")
    if tables is None:
        tables = _tables_for(batch, plan)
    ids, pos, dst, slots, sinks, heads = [], [], [], [], [], []
    dem_src, dem_dst, lens_q, lens_h = [], [], [], []
    for it in batch.items:
        _check(it, plan)
        seq, pre, m = it.seq, it.pre, it.moves
        if it.n_new != 1 or m.to_int2:
            raise ValueError(f"{seq.rid}: a decode step stores 1 token per sequence in 16 bits; got {m}")
        slot = seq.slot or 0
        ids.append(_token(seq, it.start))
        pos.append(it.start)
        slots.append(slot)
        if plan.int2:
            post = _post(it, plan)
            base = plan.ring_base(slot)
            dst.append(
                paged_decode_rows(
                    pre, m, seq.q_pages, seq.hp_pages, ps, base, ring, seq.rid, dem_src, dem_dst
                )
            )
            if post.n_q:
                page_row(seq.q_pages, post.n_q - 1, ps, seq.rid)
            if post.n_sink:
                page_row(seq.hp_pages, post.n_sink - 1, ps, seq.rid)
            lens_q.append(post.n_q)
            lens_h.append(post.n_sink + post.n_recent)
            sinks.append(post.n_sink)
            heads.append(post.head)
        else:
            dst.append(page_row(seq.hp_pages, it.start, ps, seq.rid))
            lens_q.append(0)
            lens_h.append(it.start + 1)
            sinks.append(it.start + 1)
            heads.append(0)
    pad = b - n
    n_dem = len(dem_src)
    nd = bs_pad * demote_block if bs_pad is not None and plan.int2 else n_dem
    if n_dem > nd:
        raise ValueError(f"{n_dem} demotions exceed the fixed {nd} (bs_pad × demote_block)")
    q_ptr = tuple(itertools.accumulate(lens_q + [0] * pad, initial=0))
    hp_ptr = tuple(itertools.accumulate(lens_h + [0] * pad, initial=0))
    lens = (max(lens_q, default=0), max(lens_h, default=0))
    if bucket is not None:
        lens = (bucket(lens[0]), bucket(lens[1]))
        lay = DecodeLayout.bucketed(b, nd, lens)
    else:
        lay = DecodeLayout(b, nd, hp_ptr[-1], q_ptr[-1])
    changes = tables.update(it.seq for it in batch.items)
    h64, h32 = alloc(lay.n64 + changes.size, lay.n32 if host_lists else lay.meta32)
    a64, a32 = h64.numpy(), h32.numpy()
    zeros = [0] * pad
    a64[lay.s64("ids")] = ids + zeros
    a64[lay.s64("positions")] = pos + zeros
    a64[lay.s64("decode_dst")] = dst + [-1] * pad  # padding rows write nothing
    a64[lay.s64("demote_src")] = dem_src + [0] * (nd - n_dem)  # padding: DUMMY_H row 0 -> DUMMY_Q row 0
    a64[lay.s64("demote_dst")] = dem_dst + [0] * (nd - n_dem)
    a64[lay.n64 :] = changes.reshape(-1)
    a32[lay.s32("q_indptr")] = q_ptr
    a32[lay.s32("hp_indptr")] = hp_ptr
    a32[lay.s32("slots")] = slots + zeros
    a32[lay.s32("n_sink")] = sinks + zeros
    a32[lay.s32("head")] = heads + zeros
    return HostDecode(lay, h64, h32, q_ptr, hp_ptr, lens)


def _tables_for(batch: Batch, plan: PoolPlan, device: torch.device | None = None) -> PageTables:
    """Fresh page tables wide enough for ``batch`` (one-off plans: tests, tools)."""
    wq = max((len(it.seq.q_pages) for it in batch.items), default=0)
    wh = max((len(it.seq.hp_pages) for it in batch.items), default=0)
    return PageTables(plan, wq, wh, device or torch.device("cpu"))


def fill_lists(p: DecodeTensors, tables: PageTables, plan: PoolPlan) -> None:
    """Write ``p``'s row lists from the device page tables (inside the step's graph on CUDA)."""
    q_tab, hp_tab = tables.device_views()
    expand_lists(q_tab, hp_tab, p.slots, p.q.indptr, p.hp.indptr, p.n_sink, p.head, p.q.indices,
                 p.hp.indices, plan)  # fmt: skip


def plan_decode(
    batch: Batch, plan: PoolPlan, device: torch.device | str, bs_pad: int | None = None, demote_block: int = 0
) -> DecodeTensors:
    """The tensors of a decode ``batch`` on ``device``, lists filled (:func:`plan_decode_host`
    with fresh page tables, then :func:`fill_lists`; the engine's steps fill theirs in the graph)."""
    device = torch.device(device)
    tables = _tables_for(batch, plan, device)
    h = plan_decode_host(batch, plan, bs_pad, demote_block, tables=tables)
    if device.type == "cpu":
        p = h.views(h.h64, h.h32)
    else:
        p = h.views(h.h64[: h.layout.n64].to(device), h.h32.to(device))
    tables.apply(h.changes.to(device))
    fill_lists(p, tables, plan)
    return p
