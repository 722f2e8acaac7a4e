"""Which token lives in which tier and slot: the bookkeeping every layer of the cache shares.

Each sequence ``b`` owns contiguous regions of the per-layer pools (slot ids are flat):

* quantized tier: slots ``[b·cap_q, b·cap_q + n_q)`` in token order (``cap_q`` grows by doubling);
* 16-bit tier: ``cap_h = sink + ring`` slots from ``b·cap_h``: the sink in the first
  ``n_sink`` slots, the recent window in a ring of ``ring = max(recent + demote_block − 1, 1)``
  slots after ``sink`` slots. Without quantization (passthrough) the ring never wraps and grows.

Semantics (spec §5.2–5.5): the sink is the first ``min(prompt, sink_tokens)`` valid tokens of a
sequence's first write; a prefill keeps the last ``recent_tokens`` tokens in 16 bits (older
window tokens are demoted, middle tokens are quantized at once); a decode step demotes the
oldest ``demote_block`` window tokens when adding the new one would exceed
``recent + demote_block − 1``, so the window holds ``recent … recent + demote_block − 1`` tokens.
Pads (invalid positions of a left-padded batch) are stored nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import QuantSpec

__all__ = ["SeqState", "SlotTable", "StepPlan", "ranges_to_csr"]


@dataclass
class SeqState:
    n_sink: int = 0
    n_q: int = 0
    head: int = 0  # ring index of the oldest recent token
    n_recent: int = 0
    started: bool = False


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
    pre: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    post: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    valid: torch.Tensor  # bool [B, T]
    is_decode: bool
    post_lens: tuple[int, int] = (0, 0)  # longest quantized / 16-bit list after the step (host ints)
    # decode steps: the 16-bit slot of each sequence's new token, -1 where it is not stored
    decode_dst: torch.Tensor | None = None


def ranges_to_csr(ranges: list[list[tuple[int, int]]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-sequence lists of ``(start, length)`` -> ``(indptr int32 [B+1], indices int32)``.

    Only the ranges travel to ``device``; the indices are expanded there (a decode step's lists
    hold batch × context ids: building those on the host cost ~14 ms per list at batch 16 / 32K).
    """
    lens = [sum(n for _, n in r) for r in ranges]
    indptr = torch.zeros(len(ranges) + 1, dtype=torch.int32)
    if lens:
        indptr[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    flat = [(s, n) for r in ranges for s, n in r if n > 0]
    total = sum(lens)
    if not flat:
        return indptr.to(device), torch.zeros(0, dtype=torch.int32, device=device)
    # per range: its first slot minus the position of its first entry in the flat list
    spec = torch.tensor([(s, n) for s, n in flat], dtype=torch.int64)
    first = spec[:, 1].cumsum(0) - spec[:, 1]
    spec = torch.stack([spec[:, 0] - first, spec[:, 1]]).to(device, non_blocking=True)
    which = torch.repeat_interleave(torch.arange(len(flat), device=device), spec[1], output_size=total)
    idx = spec[0][which] + torch.arange(total, device=device)
    return indptr.to(device, non_blocking=True), idx.to(torch.int32)


@dataclass
class SlotTable:
    batch: int
    spec: QuantSpec
    quantize: bool = True
    cap_q: int = 0
    seqs: list[SeqState] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seqs = [SeqState() for _ in range(self.batch)]
        s = self.spec
        self.sink_cap = s.sink_tokens if self.quantize else 0
        self.ring = max(s.recent_tokens + s.demote_block - 1, 1) if self.quantize else 0

    @property
    def cap_h(self) -> int:
        return self.sink_cap + self.ring

    # ---- CSR of the current state ------------------------------------------------------------
    def _hp_ranges(self, b: int) -> list[tuple[int, int]]:
        st, base = self.seqs[b], b * self.cap_h
        first = min(st.n_recent, self.ring - st.head) if self.ring else 0
        ring0 = base + self.sink_cap
        return [(base, st.n_sink), (ring0 + st.head, first), (ring0, st.n_recent - first)]

    def csr(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(int2_indptr, int2_indices, hp_indptr, hp_indices)`` of the current state."""
        q = ranges_to_csr([[(b * self.cap_q, st.n_q)] for b, st in enumerate(self.seqs)], device)
        h = ranges_to_csr([self._hp_ranges(b) for b in range(self.batch)], device)
        return (*q, *h)

    # ---- planning ----------------------------------------------------------------------------
    def _ring_slot(self, b: int, i: int) -> int:
        """Flat slot of the i-th recent token of sequence b."""
        st = self.seqs[b]
        return b * self.cap_h + self.sink_cap + (st.head + i) % self.ring

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
        # work out per-sequence counts first so capacities can grow before slot ids are fixed
        moves = []
        s = self.spec
        for b, tk in enumerate(toks):
            st = self.seqs[b]
            n_sink = min(len(tk), self.sink_cap) if (not st.started and tk) else 0
            rest = tk[n_sink:]
            if not self.quantize:
                n_dem, new_q, new_r = 0, [], rest
            elif is_decode:
                n_dem = min(s.demote_block, st.n_recent) if rest and st.n_recent >= self.ring else 0
                new_q, new_r = [], rest
            else:
                combined = st.n_recent + len(rest)
                keep = min(combined, s.recent_tokens)
                n_old_out = min(st.n_recent, combined - keep)
                n_new_out = combined - keep - n_old_out
                n_dem, new_q, new_r = n_old_out, rest[:n_new_out], rest[n_new_out:]
            moves.append((tk[:n_sink], n_dem, new_q, new_r))
        need_q = max((st.n_q + m[1] + len(m[2]) for st, m in zip(self.seqs, moves, strict=True)), default=0)
        need_r = max((st.n_recent + len(m[3]) for st, m in zip(self.seqs, moves, strict=True)), default=0)
        old_cap_q, old_cap_h = self.cap_q, self.cap_h
        self._grow(need_q, need_r)
        if pre is not None and (self.cap_q, self.cap_h) != (old_cap_q, old_cap_h):
            pre = self._remap_pre(pre, old_cap_q, old_cap_h, device)

        hp_b, hp_t, hp_s, q_b, q_t, q_s, d_src, d_dst = ([] for _ in range(8))
        for b, (sink_t, n_dem, new_q, new_r) in enumerate(moves):
            st = self.seqs[b]
            if sink_t or new_q or new_r:
                st.started = True
            for i, tt in enumerate(sink_t):
                hp_b.append(b), hp_t.append(tt), hp_s.append(b * self.cap_h + st.n_sink + i)
            st.n_sink += len(sink_t)
            for _ in range(n_dem):  # oldest window tokens -> quantized tier
                d_src.append(self._ring_slot(b, 0))
                d_dst.append(b * self.cap_q + st.n_q)
                st.n_q += 1
                st.head = (st.head + 1) % self.ring
                st.n_recent -= 1
            for tt in new_q:
                q_b.append(b), q_t.append(tt), q_s.append(b * self.cap_q + st.n_q)
                st.n_q += 1
            for tt in new_r:
                hp_b.append(b), hp_t.append(tt), hp_s.append(self._ring_slot(b, st.n_recent))
                st.n_recent += 1

        def lt(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        decode_dst = None
        if is_decode:  # a decode token never goes to the quantized tier directly (new_q is empty)
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

    def _remap_pre(self, pre, old_q: int, old_h: int, device: torch.device) -> tuple[torch.Tensor, ...]:
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
