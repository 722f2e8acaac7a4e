"""Where each token of the HF cache is stored: per-sequence slot regions over flat pools.

The tier rules (which token is in the sink, INT2 or the recent window) are
:mod:`oscarkv.quant.tiers`, and a step's spans and their rows are :mod:`oscarkv.store.rows`
(:class:`~oscarkv.store.RegionRows`); this module owns the regions. Each sequence ``b`` owns
contiguous regions of the per-layer pools (slot ids are flat):

* INT2 tier: slots ``[b·cap_q, b·cap_q + n_q)`` in token order (``cap_q`` grows by doubling);
* 16-bit tier: ``cap_h = sink + ring`` slots from ``b·cap_h``: the sink in the first
  ``n_sink`` slots, then the recent window in a ring of ``ring = max(recent + demote_block − 1, 1)``
  slots. Without quantization (passthrough) the ring never wraps and grows by doubling.

Pads (invalid positions of a left-padded batch) are stored nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import QuantSpec
from ..kernels.pool_ops import ranges_to_csr
from ..quant.tiers import Moves, TierState, apply_moves, plan_moves, ring_spans, window_limit
from ..store import RegionRows, WriteRows, step_spans

__all__ = ["SlotTable", "StepPlan", "ranges_to_csr"]

CSR = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class StepPlan:
    """One forward's writes (flat slot ids; ``b_idx``/``t_idx`` index the new tokens ``[B, T]``)."""

    new_hp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # b_idx, t_idx, hp slot
    new_q: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # b_idx, t_idx, q slot
    demote: tuple[torch.Tensor, torch.Tensor]  # hp slot -> q slot
    cap_q: int
    cap_h: int
    # CSR over the state *before* this step's writes (prefill prefix; None in decode steps, which
    # do not read it) and *after* them (decode)
    pre: CSR | None
    post: CSR
    valid: torch.Tensor  # bool [B, T]
    is_decode: bool
    post_lens: tuple[int, int] = (0, 0)  # longest quantized / 16-bit list after the step (host ints)
    # decode steps: the 16-bit slot of each sequence's new token, -1 where it is not stored
    decode_dst: torch.Tensor | None = None


@dataclass
class SlotTable:
    """Per-sequence :class:`~oscarkv.quant.tiers.TierState` plus the contiguous slot layout."""

    batch: int
    spec: QuantSpec
    quantize: bool = True
    cap_q: int = 0
    seqs: list[TierState] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seqs = [TierState() for _ in range(self.batch)]
        self.sink_cap = self.spec.sink_tokens if self.quantize else 0
        self.ring = window_limit(self.spec) if self.quantize else 0

    @property
    def cap_h(self) -> int:
        return self.sink_cap + self.ring

    # ---- CSR of the current state ------------------------------------------------------------
    def _hp_ranges(self, b: int) -> list[tuple[int, int]]:
        st, base = self.seqs[b], b * self.cap_h
        (head, first), (_, second) = ring_spans(st, self.ring)
        ring0 = base + self.sink_cap
        return [(base, st.n_sink), (ring0 + head, first), (ring0, second)]

    def csr(self, device: torch.device) -> CSR:
        """``(int2_indptr, int2_indices, hp_indptr, hp_indices)`` of the current state."""
        q = ranges_to_csr([[(b * self.cap_q, st.n_q)] for b, st in enumerate(self.seqs)], device)
        h = ranges_to_csr([self._hp_ranges(b) for b in range(self.batch)], device)
        return (*q, *h)

    # ---- planning ----------------------------------------------------------------------------
    def rows(self, b: int) -> RegionRows:
        """Where sequence ``b``'s tier indices live under the current capacities."""
        return RegionRows(b * self.cap_q, b * self.cap_h, self.sink_cap, self.ring)

    def _grow(self, need_q: int, need_ring: int) -> None:
        while self.cap_q < need_q:
            self.cap_q = max(64, 2 * self.cap_q)
        if not self.quantize:
            while self.ring < need_ring:
                self.ring = max(64, 2 * self.ring)

    def plan(self, valid: torch.Tensor, device: torch.device) -> StepPlan:
        """Assign this forward's new tokens (``valid`` bool ``[B, T]``) to tiers and slots."""
        bsz, t = valid.shape
        if bsz != self.batch:
            raise ValueError(f"the cache was built for batch {self.batch}; got a batch of {bsz}")
        is_decode = t == 1
        pre = None if is_decode else self.csr(device)
        host = valid.cpu()  # one device sync per step, not one per sequence
        toks = [torch.nonzero(host[b]).flatten().tolist() for b in range(bsz)]
        moves = [
            plan_moves(st, len(tk), is_decode, self.spec, quantize=self.quantize)
            for st, tk in zip(self.seqs, toks, strict=True)
        ]
        # capacities grow before any slot id is fixed
        need_q = max(
            (st.n_q + m.demote + m.to_int2 for st, m in zip(self.seqs, moves, strict=True)), default=0
        )
        need_r = max((st.n_recent + m.to_ring for st, m in zip(self.seqs, moves, strict=True)), default=0)
        old_cap_q, old_cap_h = self.cap_q, self.cap_h
        self._grow(need_q, need_r)
        if pre is not None and (self.cap_q, self.cap_h) != (old_cap_q, old_cap_h):
            pre = self._remap_pre(pre, old_cap_q, old_cap_h, device)

        hp_b, hp_t, hp_s, q_b, q_t, q_s, d_src, d_dst = ([] for _ in range(8))
        for b, (tk, m) in enumerate(zip(toks, moves, strict=True)):
            ht, hs, qt, qs, ds, dd = self._slots_of(b, tk, m)
            hp_b += [b] * len(ht)
            hp_t += ht
            hp_s += hs
            q_b += [b] * len(qt)
            q_t += qt
            q_s += qs
            d_src += ds
            d_dst += dd
            apply_moves(self.seqs[b], m, self.ring)

        def lt(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        decode_dst = None
        if is_decode:  # a decode token never goes to the quantized tier directly (to_int2 is 0)
            dst = [-1] * bsz
            for b, slot in zip(hp_b, hp_s, strict=True):
                dst[b] = slot
            decode_dst = lt(dst)

        return StepPlan(
            new_hp=(lt(hp_b), lt(hp_t), lt(hp_s)),
            new_q=(lt(q_b), lt(q_t), lt(q_s)),
            demote=(lt(d_src), lt(d_dst)),
            cap_q=self.cap_q,
            cap_h=self.cap_h,
            pre=pre,
            post=self.csr(device),
            valid=valid.to(device),
            is_decode=is_decode,
            post_lens=(
                max((st.n_q for st in self.seqs), default=0),
                max((st.n_sink + st.n_recent for st in self.seqs), default=0),
            ),
            decode_dst=decode_dst,
        )

    def _slots_of(self, b: int, tk: list[int], m: Moves) -> tuple[list[int], ...]:
        """Sequence ``b``'s writes for moves ``m`` against its pre-step state: 16-bit
        ``(t_idx, slot)``, INT2 ``(t_idx, slot)`` and demotions ``(hp slot, INT2 slot)``, as lists.
        New window tokens follow the window, so they may reuse slots this step's demotion frees."""
        w = WriteRows()
        w.add(self.rows(b), step_spans(self.seqs[b], m))
        hp_t, q_t = [tk[j] for j in w.hp_tok], [tk[j] for j in w.q_tok]
        return hp_t, w.hp_dst, q_t, w.q_dst, w.demote_src, w.demote_dst

    def _remap_pre(self, pre: CSR, old_q: int, old_h: int, device: torch.device) -> CSR:
        # Capacities changed: express the pre-step state in the new flat slot numbering.
        qi, qx, hi, hx = pre

        def remap(indptr: torch.Tensor, idx: torch.Tensor, old: int, new: int) -> torch.Tensor:
            if old == 0 or idx.numel() == 0:
                return idx
            b = torch.repeat_interleave(
                torch.arange(len(indptr) - 1, device=device), (indptr[1:] - indptr[:-1]).long()
            )
            local = idx.long() - b * old
            return (b * new + local).to(torch.int32)

        return qi, remap(qi, qx, old_q, self.cap_q), hi, remap(hi, hx, old_h, self.cap_h)

    def tokens_held(self) -> tuple[int, int]:
        """(quantized tokens, 16-bit tokens) summed over sequences."""
        return sum(s.n_q for s in self.seqs), sum(s.n_sink + s.n_recent for s in self.seqs)
