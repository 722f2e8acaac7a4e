"""One layer's INT2 attention under vLLM: tier bookkeeping per request, then the store's attention.

Where rows live (``rpb``: a buffer's block stride in rows, :func:`.layout.flat_rows`), as
:class:`oscarkv.store.PositionRows` maps them:

* INT2 row of position ``p``: ``block_table[p // bs] * rpb + p % bs`` in vLLM's pages of the
  layer (position-addressed, like vLLM's own cache);
* sink position ``j`` and ring index ``r``: rows ``blk * rpb_s + j`` and
  ``blk * rpb_s + S + r % ring`` of the request's private store block ``blk`` (:mod:`.hp_store`).

Each request's :class:`~oscarkv.quant.tiers.TierState` is kept by store block: the block is the
request's for its lifetime, and a step that starts at position 0 (a new request, or one
preempted and recomputed) starts a fresh state. The split of new tokens over the tiers is
``quant.tiers.plan_moves``; prefill chunks pin the sink target to ``S`` while vLLM says the
request is still prefilling (so the sink ends as ``min(prompt, S)``, as in our engine), decode
steps never grow it. The spans and rows are the store's (:mod:`oscarkv.store.rows`), and the
attention itself is :class:`oscarkv.store.TierAttention`, the code our engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import QuantSpec
from ..quant.tiers import Moves, TierState, plan_moves, window_limit
from ..store import (
    Csr,
    DecodeTensors,
    PositionRows,
    PrefillTensors,
    TierAttention,
    WriteRows,
    held_rows,
    post_state,
    step_spans,
)

__all__ = ["Int2Layer"]

_LONG = torch.long


@dataclass
class _Item:
    i: int  # batch row
    a: int  # first flat token
    start: int  # position of the first new token
    pre: TierState
    moves: Moves
    post: TierState
    rows: PositionRows


def _csr(lists: list[list[int]], device: torch.device) -> Csr:
    ptr = [0]
    for x in lists:
        ptr.append(ptr[-1] + len(x))
    flat = [r for x in lists for r in x]
    return Csr(
        torch.tensor(ptr, dtype=torch.int32, device=device),
        torch.tensor(flat, dtype=torch.int32, device=device),
        tuple(ptr),
    )


def _t(x: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=_LONG, device=device)


def _i32(x: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=device)


class Int2Layer:
    """Runs ``attn`` over vLLM's INT2 pages and the private 16-bit store of one layer."""

    def __init__(self, attn: TierAttention, spec: QuantSpec):
        self.attn, self.spec = attn, spec
        self.ring = window_limit(spec)
        self.states: dict[int, TierState] = {}  # by store block

    def plan(
        self,
        starts: list[int],
        seq_lens: list[int],
        prefilling: list[bool],
        tables: torch.Tensor,
        store_blocks: list[int],
        bs: int,
        rpb: int,
        rpb_s: int,
    ) -> tuple[list[_Item], list[_Item]]:
        """Split the batch into prefill and decode items and advance the tier states."""
        pre, dec, s = [], [], self.spec
        for i, seq_len in enumerate(seq_lens):
            a, b = starts[i], starts[i + 1]
            n = b - a
            if n == 0:
                continue
            start, blk = seq_len - n, store_blocks[i]
            st = TierState() if start == 0 else self.states.get(blk)
            held = None if st is None else st.n_sink + st.n_q + st.n_recent
            if held != start:
                raise RuntimeError(
                    f"oscarkv: request in store block {blk} continues at position {start} but its "
                    f"tiers hold {held} tokens (a prefix-cache hit? pass enable_prefix_caching=False)"
                )
            if not prefilling[i] and n != 1:
                raise RuntimeError(f"oscarkv: a decode step with {n} tokens (speculative decoding?)")
            m = plan_moves(st, n, not prefilling[i], s, s.sink_tokens if prefilling[i] else st.n_sink)
            n_pages = -(-(start + n) // bs)
            post = post_state(st, m, self.ring)
            table = tables[i, :n_pages].tolist()
            rows = PositionRows(table, bs, rpb, blk * rpb_s, s.sink_tokens, self.ring, post.n_sink)
            self.states[blk] = post
            (pre if prefilling[i] else dec).append(_Item(i, a, start, st, m, post, rows))
        return pre, dec

    def prefill(self, q, k, v, pools, items: list[_Item]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill chunks: ``(flat token ids [T'], outputs [T', Hq, d])``."""
        dev = q.device
        tok, cu, lq, lh, w = [], [0], [], [], WriteRows()
        for it in items:
            n, t0 = it.moves.n_new, cu[-1]
            tok += range(it.a, it.a + n)
            cu.append(t0 + n)
            q_rows, hp_rows = held_rows(it.rows, it.pre)
            lq.append(q_rows)
            lh.append(hp_rows)
            w.add(it.rows, step_spans(it.pre, it.moves, t0))
        idx = _t(tok, dev)
        p = PrefillTensors(
            positions=idx,  # not read by the attention
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            cu_host=tuple(cu),
            last_idx=_t([], dev),
            pre_q=_csr(lq, dev),
            pre_hp=_csr(lh, dev),
            q_tok=_t(w.q_tok, dev),
            q_dst=_t(w.q_dst, dev),
            hp_tok=_t(w.hp_tok, dev),
            hp_dst=_t(w.hp_dst, dev),
            demote_src=_t(w.demote_src, dev),
            demote_dst=_t(w.demote_dst, dev),
        )
        return idx, self.attn.prefill(q[idx], k[idx], v[idx], pools, p)

    def decode(self, q, k, v, pools, items: list[_Item]) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode steps (one token each): ``(flat token ids [B], outputs [B, Hq, d])``."""
        dev = q.device
        lq, lh, w = [], [], WriteRows()
        for it in items:
            w.add(it.rows, step_spans(it.pre, it.moves))
            q_rows, hp_rows = held_rows(it.rows, it.post)
            lq.append(q_rows)
            lh.append(hp_rows)
        if len(w.hp_dst) != len(items) or w.q_dst:
            raise RuntimeError("oscarkv: a decode step stores one 16-bit row per request")
        idx = _t([it.a for it in items], dev)
        empty = _i32([], dev)
        p = DecodeTensors(
            ids=_t([], dev),  # not read by the attention
            positions=_t([it.start for it in items], dev),
            decode_dst=_t(w.hp_dst, dev),
            demote_src=_t(w.demote_src, dev),
            demote_dst=_t(w.demote_dst, dev),
            slots=empty,  # the lists below are complete: no page tables to expand
            n_sink=empty,
            head=empty,
            q=_csr(lq, dev),
            hp=_csr(lh, dev),
            lens_hint=(max(map(len, lq)), max(map(len, lh))),
        )
        return idx, self.attn.decode(q[idx], k[idx], v[idx], pools, p)
