"""From a scheduled :class:`~oscarkv.engine.request.Batch` to the device tensors of one step.

Row mapping (engine.md §3.1–3.2; ``ps`` = page tokens, ``plan`` a :class:`PoolPlan`):

* INT2 list index ``i``: row ``q_pages[i // ps]·ps + i % ps`` of the INT2 pool;
* sink position ``j``: row ``hp_pages[j // ps]·ps + j % ps`` of the 16-bit pool;
* ring index ``r``: row ``plan.ring_base(slot) + r % plan.ring`` (the sequence's slab);
* BF16 mode: position ``k`` at row ``hp_pages[k // ps]·ps + k % ps`` (no INT2, no ring).

A decode step is built on the host with numpy into one flat buffer per dtype
(``decode_buffers.py``: one copy each to the device, whose views are the :class:`DecodeTensors`);
a prefill expands its lists on the device (:meth:`~oscarkv.engine.csr.Segments.expand`).

A step's new tokens split in token order into ``to_sink`` (sink positions ``pre.n_sink ..``),
``to_int2`` (INT2 indices ``pre.n_q + demote ..``) and ``to_ring`` (ring indices
``pre.head + pre.n_recent ..``, wrapping); first the ``demote`` oldest ring rows (ring indices
``pre.head ..``) move to INT2 indices ``pre.n_q ..`` (the same arithmetic as ``hf/slots.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..quant.tiers import TierState, apply_moves
from .csr import Csr, PageList, Segments
from .decode_buffers import Alloc, DecodeLayout, DecodeTensors, HostDecode, fresh_buffers
from .kv_pool import PoolPlan
from .request import Batch, Sequence, StepSeq

__all__ = ["DecodeTensors", "PrefillTensors", "plan_decode", "plan_decode_host", "plan_prefill"]

_LONG = torch.long


@dataclass(frozen=True)
class PrefillTensors:
    """A prefill step over ``n`` sequences, ``T`` tokens flat (sequence after sequence).

    ``pre_q``/``pre_hp``: each sequence's stored rows *before* the step (INT2 / 16-bit ids; the
    prefix is fully visible, so their order is free). Writes: new token ``q_tok[i]`` goes to INT2
    row ``q_dst[i]``, token ``hp_tok[i]`` to 16-bit row ``hp_dst[i]`` (sink rows, then ring rows;
    BF16: page rows); the 16-bit rows ``demote_src`` move to INT2 rows ``demote_dst`` first.
    All long on the device unless stated.
    """

    positions: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # int32 [n+1]
    cu_host: tuple[int, ...]  # host copy of cu_seqlens
    last_idx: torch.Tensor  # [n_last]: last token row of each sequence whose prompt ends here
    pre_q: Csr
    pre_hp: Csr
    q_tok: torch.Tensor
    q_dst: torch.Tensor
    hp_tok: torch.Tensor
    hp_dst: torch.Tensor
    demote_src: torch.Tensor
    demote_dst: torch.Tensor


def _post(it: StepSeq, plan: PoolPlan) -> TierState:
    st = TierState(**vars(it.pre))  # a copy (copy.copy takes 4x longer; this runs per sequence)
    apply_moves(st, it.moves, plan.ring)
    return st


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


class _Step:
    """Host-side segment tables of one step, with each sequence's page offsets."""

    def __init__(self, batch: Batch, plan: PoolPlan):
        self.plan, ps = plan, plan.page_tokens
        self.pages = PageList()
        self.offs = [(self.pages.add(it.seq.hp_pages), self.pages.add(it.seq.q_pages)) for it in batch.items]
        # lq/lh: the stored INT2/16-bit lists (pre-step in a prefill, post-step in a decode);
        # q/hp: where the new tokens go; dem_src/dem_dst: the demotions
        self.tabs = {k: Segments(ps) for k in ("lq", "lh", "q", "hp", "dem_src", "dem_dst")}

    def hp_pages(self, i: int, it: StepSeq) -> tuple[PageList, int, int]:
        return self.pages, self.offs[i][0], len(it.seq.hp_pages)

    def q_pages(self, i: int, it: StepSeq) -> tuple[PageList, int, int]:
        return self.pages, self.offs[i][1], len(it.seq.q_pages)

    def stored(self, i: int, it: StepSeq, st: TierState, n_bf16: int) -> None:
        """Append the rows stored in state ``st`` (BF16: the first ``n_bf16`` positions) to the
        lists: sink rows then ring rows oldest first, INT2 rows in token order (``OscarCache``'s)."""
        lq, lh = self.tabs["lq"], self.tabs["lh"]
        if self.plan.int2:
            lq.paged(*self.q_pages(i, it), 0, st.n_q)
            lh.paged(*self.hp_pages(i, it), 0, st.n_sink)
            lh.ring(self.plan.ring_base(it.seq.slot or 0), st.head, st.n_recent, self.plan.ring)
        else:
            lh.paged(*self.hp_pages(i, it), 0, n_bf16)
        lq.end_seq()
        lh.end_seq()

    def writes(self, i: int, it: StepSeq, tok0: int) -> None:
        """Append the step's demotions and the destinations of its new tokens (flat ``tok0 ..``)."""
        t, pre, m = self.tabs, it.pre, it.moves
        if not self.plan.int2:
            t["hp"].paged(*self.hp_pages(i, it), it.start, it.n_new, tok0)
            return
        base, ring = self.plan.ring_base(it.seq.slot or 0), self.plan.ring
        t["dem_src"].ring(base, pre.head, m.demote, ring)
        t["dem_dst"].paged(*self.q_pages(i, it), pre.n_q, m.demote)
        t["q"].paged(*self.q_pages(i, it), pre.n_q + m.demote, m.to_int2, tok0 + m.to_sink)
        t["hp"].paged(*self.hp_pages(i, it), pre.n_sink, m.to_sink, tok0)
        t["hp"].ring(base, pre.head + pre.n_recent, m.to_ring, ring, tok0 + m.to_sink + m.to_int2)


def plan_prefill(batch: Batch, plan: PoolPlan, device: torch.device | str) -> PrefillTensors:
    """The tensors of a prefill ``batch`` (chunks of prompts) on ``device``."""
    device = torch.device(device)
    step, cu, pos, last = _Step(batch, plan), [0], [], []
    for i, it in enumerate(batch.items):
        _check(it, plan)
        step.stored(i, it, it.pre, it.start)
        step.writes(i, it, cu[-1])
        pos.append((it.start, it.n_new))
        cu.append(cu[-1] + it.n_new)
        if it.ends_prompt:
            last.append(cu[-1] - 1)
    pages, t = step.pages.tensor(device), step.tabs
    starts = torch.tensor([p for p, _ in pos], dtype=_LONG)
    lens = torch.tensor([n for _, n in pos], dtype=_LONG)
    first = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens, output_size=cu[-1])
    positions = (first + torch.arange(cu[-1])).to(device, non_blocking=True)
    q_dst, q_tok = t["q"].expand(pages)
    hp_dst, hp_tok = t["hp"].expand(pages)
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
    )


def _token(seq: Sequence, pos: int) -> int:
    n = len(seq.prompt)  # not seq.tokens: that concatenates the whole sequence
    return seq.prompt[pos] if pos < n else seq.out[pos - n]


def plan_decode_host(
    batch: Batch,
    plan: PoolPlan,
    bs_pad: int | None = None,
    demote_block: int = 0,
    bucket: Callable[[int], int] | None = None,
    alloc: Alloc = fresh_buffers,
) -> HostDecode:
    """A decode ``batch`` built on the host into buffers from ``alloc``. With ``bs_pad`` (CUDA),
    rows ``B .. bs_pad-1`` are padding and the demote lists have the fixed length
    ``bs_pad·demote_block``; with ``bucket``, ``lens_hint`` is bucketed and the lists get a graph's
    capacities (:meth:`DecodeLayout.bucketed`), else exactly their lengths."""
    step, n = _Step(batch, plan), len(batch.items)
    b = n if bs_pad is None else bs_pad
    if b < n:
        raise ValueError(f"bs_pad {bs_pad} is smaller than the batch ({n})")
    ids, pos, lens_q, lens_h = [], [], [0], [0]
    for i, it in enumerate(batch.items):
        _check(it, plan)
        if it.n_new != 1 or it.moves.to_int2:
            raise ValueError(
                f"{it.seq.rid}: a decode step stores 1 token per sequence in 16 bits; got {it.moves}"
            )
        post = _post(it, plan)
        step.stored(i, it, post, it.start + 1)
        step.writes(i, it, i)
        ids.append(_token(it.seq, it.start))
        pos.append(it.start)
        lens_q.append(post.n_q)
        lens_h.append(post.n_sink + post.n_recent if plan.int2 else it.start + 1)
    t = step.tabs
    for _ in range(b - n):  # padding rows: empty lists
        t["lq"].end_seq()
        t["lh"].end_seq()
    n_dem, lens = t["dem_src"].total, (max(lens_q), max(lens_h))
    nd = bs_pad * demote_block if bs_pad is not None and plan.int2 else n_dem
    if n_dem > nd:
        raise ValueError(f"{n_dem} demotions exceed the fixed {nd} (bs_pad × demote_block)")
    if bucket is not None:
        lens = (bucket(lens[0]), bucket(lens[1]))
        lay = DecodeLayout.bucketed(b, nd, lens)
    else:
        lay = DecodeLayout(b, nd, t["lh"].total, t["lq"].total)
    h64, h32 = alloc(lay.n64, lay.n32)
    a64, a32 = h64.numpy(), h32.numpy()
    pages = step.pages.array()
    a64[lay.s64("ids")] = ids + [0] * (b - n)
    a64[lay.s64("positions")] = pos + [0] * (b - n)
    # the small lists in one expansion: the new rows (16-bit writes: a decode token never goes
    # to INT2 directly), then the demotions
    small = Segments.joined(t["hp"], t["dem_src"], t["dem_dst"]).rows_np(pages)
    n_hp = t["hp"].total
    dst = a64[lay.s64("decode_dst")]
    dst.fill(-1)  # padding rows write nothing
    dst[t["hp"].tok_np()] = small[:n_hp]
    for i, name in enumerate(("demote_src", "demote_dst")):
        out = a64[lay.s64(name)]
        out[:n_dem] = small[n_hp + i * n_dem : n_hp + (i + 1) * n_dem]
        out[n_dem:] = 0  # padding: DUMMY_H row 0 -> DUMMY_Q row 0
    ptrs = []
    for tab, kind in ((t["lq"], "q"), (t["lh"], "hp")):
        ptrs.append(tab.indptr())
        a32[lay.s32(f"{kind}_indptr")] = ptrs[-1]
        at = lay.s32(f"{kind}_ids").start
        tab.rows_np(pages, out=a32[at : at + ptrs[-1][-1]])
    return HostDecode(lay, h64, h32, ptrs[0], ptrs[1], lens)


def plan_decode(
    batch: Batch, plan: PoolPlan, device: torch.device | str, bs_pad: int | None = None, demote_block: int = 0
) -> DecodeTensors:
    """The tensors of a decode ``batch`` on ``device`` (:func:`plan_decode_host`, then
    :meth:`HostDecode.tensors`)."""
    return plan_decode_host(batch, plan, bs_pad, demote_block).tensors(device)[1]
