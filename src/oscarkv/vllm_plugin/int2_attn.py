"""One layer's INT2 attention under vLLM: tier bookkeeping per request, then our engine's math.

Where rows live (``rpb``: a buffer's block stride in rows, :func:`.layout.flat_rows`):

* INT2 row of position ``p``: ``block_table[p // bs] * rpb + p % bs`` in vLLM's pages of the
  layer (position-addressed, like vLLM's own cache);
* sink position ``j`` and ring index ``r``: rows ``blk * rpb_s + j`` and
  ``blk * rpb_s + S + r % ring`` of the request's private store block ``blk`` (:mod:`.hp_store`).

Each request's :class:`~oscarkv.quant.tiers.TierState` is kept by store block: the block is the
request's for its lifetime, and a step that starts at position 0 (a new request, or one
preempted and recomputed) starts a fresh state. The split of new tokens over the tiers is
``quant.tiers.plan_moves``; prefill chunks pin the sink target to ``S`` while vLLM says the
request is still prefilling (so the sink ends as ``min(prompt, S)``, as in our engine), decode
steps never grow it. The attention itself is :class:`oscarkv.engine.attention.EngineAttention`,
the code our engine runs, fed with tensors built here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import QuantSpec
from ..engine.attention import EngineAttention
from ..engine.csr import Csr
from ..engine.planner import DecodeTensors, PrefillTensors
from ..quant.tiers import Moves, TierState, apply_moves, plan_moves, window_limit

__all__ = ["Int2Layer", "Rows"]

_LONG = torch.long


@dataclass(frozen=True)
class Rows:
    """Where one request's rows are: INT2 pages (``table``, ``bs``, ``rpb``) and store block."""

    table: list[int]
    bs: int
    rpb: int
    store0: int  # first row of the request's store block
    sink: int
    ring: int

    def int2(self, first: int, n: int) -> list[int]:
        """INT2 rows of positions ``first .. first+n-1``."""
        return [self.table[p // self.bs] * self.rpb + p % self.bs for p in range(first, first + n)]

    def sink_rows(self, first: int, n: int) -> list[int]:
        return list(range(self.store0 + first, self.store0 + first + n))

    def ring_rows(self, first: int, n: int) -> list[int]:
        """Store rows of ring indices ``first .. first+n-1`` (mod the ring)."""
        base = self.store0 + self.sink
        return [base + (first + i) % self.ring for i in range(n)]

    def stored(self, st: TierState) -> tuple[list[int], list[int]]:
        """``(INT2 rows, 16-bit rows)`` held in state ``st``: positions in token order; sink then
        ring oldest first (the order our engine lists them in)."""
        hp = self.sink_rows(0, st.n_sink) + self.ring_rows(st.head, st.n_recent)
        return self.int2(st.n_sink, st.n_q), hp


@dataclass
class _Item:
    i: int  # batch row
    a: int  # first flat token
    start: int  # position of the first new token
    pre: TierState
    moves: Moves
    rows: Rows


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


class Int2Layer:
    """Runs ``attn`` over vLLM's INT2 pages and the private 16-bit store of one layer."""

    def __init__(self, attn: EngineAttention, spec: QuantSpec):
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
            rows = Rows(tables[i, :n_pages].tolist(), bs, rpb, blk * rpb_s, s.sink_tokens, self.ring)
            post = TierState(**vars(st))
            apply_moves(post, m, self.ring)
            self.states[blk] = post
            (pre if prefilling[i] else dec).append(_Item(i, a, start, st, m, rows))
        return pre, dec

    def prefill(self, q, k, v, pools, items: list[_Item]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill chunks: ``(flat token ids [T'], outputs [T', Hq, d])``."""
        dev = q.device
        tok, cu, lq, lh = [], [0], [], []
        w = {"q_tok": [], "q_dst": [], "hp_tok": [], "hp_dst": [], "demote_src": [], "demote_dst": []}
        for it in items:
            n, st, m, r, t0 = it.moves.n_new, it.pre, it.moves, it.rows, cu[-1]
            tok += range(it.a, it.a + n)
            cu.append(t0 + n)
            q_rows, hp_rows = r.stored(st)
            lq.append(q_rows)
            lh.append(hp_rows)
            w["demote_src"] += r.ring_rows(st.head, m.demote)
            w["demote_dst"] += r.int2(st.n_sink + st.n_q, m.demote)
            w["q_tok"] += range(t0 + m.to_sink, t0 + m.to_sink + m.to_int2)
            w["q_dst"] += r.int2(it.start + m.to_sink, m.to_int2)
            w["hp_tok"] += range(t0, t0 + m.to_sink)
            w["hp_dst"] += r.sink_rows(st.n_sink, m.to_sink)
            w["hp_tok"] += range(t0 + m.to_sink + m.to_int2, t0 + n)
            w["hp_dst"] += r.ring_rows(st.head + st.n_recent, m.to_ring)
        idx = _t(tok, dev)
        p = PrefillTensors(
            positions=idx,  # not read by the attention
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            cu_host=tuple(cu),
            last_idx=_t([], dev),
            pre_q=_csr(lq, dev),
            pre_hp=_csr(lh, dev),
            **{name: _t(x, dev) for name, x in w.items()},
        )
        return idx, self.attn.prefill(q[idx], k[idx], v[idx], pools, p)

    def decode(self, q, k, v, pools, items: list[_Item]) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode steps (one token each): ``(flat token ids [B], outputs [B, Hq, d])``."""
        dev = q.device
        lq, lh, dst, src, ddst = [], [], [], [], []
        for it in items:
            st, m, r = it.pre, it.moves, it.rows
            src += r.ring_rows(st.head, m.demote)
            ddst += r.int2(st.n_sink + st.n_q, m.demote)
            dst += r.ring_rows(st.head + st.n_recent, 1)
            post = TierState(**vars(st))
            apply_moves(post, m, self.ring)
            q_rows, hp_rows = r.stored(post)
            lq.append(q_rows)
            lh.append(hp_rows)
        idx = _t([it.a for it in items], dev)
        p = DecodeTensors(
            positions=_t([it.start for it in items], dev),
            decode_dst=_t(dst, dev),
            demote_src=_t(src, dev),
            demote_dst=_t(ddst, dev),
            q=_csr(lq, dev),
            hp=_csr(lh, dev),
            lens_hint=(max(map(len, lq)), max(map(len, lh))),
        )
        return idx, self.attn.decode(q[idx], k[idx], v[idx], pools, p)
