"""A batch's rows over paged pools as segment tables (:mod:`.csr`): the spans of :mod:`.rows`
mapped the :class:`~.rows.PagedRows` way, a few segments per sequence instead of a row each.

Rows (``ps`` = ``plan.page_tokens``): INT2 list index ``i`` at ``q_pages[i // ps]·ps + i % ps``;
sink position ``j`` at ``hp_pages[j // ps]·ps + j % ps``; ring index ``r`` at
``plan.ring_base(slot) + r % plan.ring``; BF16 mode: position ``k`` at
``hp_pages[k // ps]·ps + k % ps`` (no INT2, no ring).
"""

from __future__ import annotations

from ..quant.tiers import Moves, TierState
from .csr import PageList, Segments
from .layout import PoolPlan
from .rows import held_spans, page_row, step_spans

__all__ = ["PagedStep", "paged_decode_rows"]


def paged_decode_rows(
    pre: TierState,
    m: Moves,
    q_pages: list[int],
    hp_pages: list[int],
    ps: int,
    ring_base: int,
    ring: int,
    rid: str,
    dem_src: list[int],
    dem_dst: list[int],
) -> int:
    """One sequence's decode step over paged pools: appends its demotions (16-bit ring rows ->
    INT2 rows) to ``dem_src``/``dem_dst`` and returns the 16-bit row of its new token. The spans
    of :func:`~.rows.step_spans` mapped as :class:`~.rows.PagedRows` does, written out: this runs
    per sequence per decode step on the host's critical path, so it builds no span objects."""
    for k in range(m.demote):
        dem_src.append(ring_base + (pre.head + k) % ring)
        dem_dst.append(page_row(q_pages, pre.n_q + k, ps, rid))
    if m.to_sink:
        return page_row(hp_pages, pre.n_sink, ps, rid)
    return ring_base + (pre.head + pre.n_recent) % ring


class PagedStep:
    """Host-side segment tables of one step, with each sequence's page offsets in ``pages``.

    ``tabs``: ``lq``/``lh`` the stored INT2/16-bit lists (pre-step in a prefill, post-step in a
    decode); ``q``/``hp`` where the new tokens go; ``dem_src``/``dem_dst`` the demotions.
    """

    def __init__(self, plan: PoolPlan):
        self.plan = plan
        self.pages = PageList()
        self._seqs: list[tuple[int, int, int, int]] = []  # hp offset, hp pages, q offset, q pages
        self.tabs = {k: Segments(plan.page_tokens) for k in ("lq", "lh", "q", "hp", "dem_src", "dem_dst")}

    def add_seq(self, hp_pages: list[int], q_pages: list[int]) -> int:
        """Register one sequence's page lists; returns its index for :meth:`stored`/:meth:`writes`."""
        hp_off = self.pages.add(hp_pages)
        q_off = self.pages.add(q_pages)
        self._seqs.append((hp_off, len(hp_pages), q_off, len(q_pages)))
        return len(self._seqs) - 1

    def _hp(self, i: int) -> tuple[PageList, int, int]:
        off, n, _, _ = self._seqs[i]
        return self.pages, off, n

    def _q(self, i: int) -> tuple[PageList, int, int]:
        _, _, off, n = self._seqs[i]
        return self.pages, off, n

    def stored(self, i: int, slot: int, st: TierState, n_bf16: int) -> None:
        """Append the rows stored in state ``st`` (BF16: the first ``n_bf16`` positions) to the
        lists: sink rows then ring rows oldest first, INT2 rows in token order."""
        lq, lh = self.tabs["lq"], self.tabs["lh"]
        if self.plan.int2:
            h = held_spans(st)
            lq.paged(*self._q(i), 0, h.int2.n)
            lh.paged(*self._hp(i), 0, h.sink.n)
            lh.ring(self.plan.ring_base(slot), h.ring.first, h.ring.n, self.plan.ring)
        else:
            lh.paged(*self._hp(i), 0, n_bf16)
        lq.end_seq()
        lh.end_seq()

    def writes(self, i: int, slot: int, pre: TierState, m: Moves, start: int, n_new: int, tok0: int) -> None:
        """Append the step's demotions and the destinations of its new tokens (flat ``tok0 ..``;
        BF16: positions ``start .. start+n_new-1``)."""
        t = self.tabs
        if not self.plan.int2:
            t["hp"].paged(*self._hp(i), start, n_new, tok0)
            return
        base, ring, s = self.plan.ring_base(slot), self.plan.ring, step_spans(pre, m, tok0)
        t["dem_src"].ring(base, s.demote_src.first, s.demote_src.n, ring)
        t["dem_dst"].paged(*self._q(i), s.demote_dst.first, s.demote_dst.n)
        t["q"].paged(*self._q(i), s.int2.first, s.int2.n, s.int2.tok)
        t["hp"].paged(*self._hp(i), s.sink.first, s.sink.n, s.sink.tok)
        t["hp"].ring(base, s.ring.first, s.ring.n, ring, s.ring.tok)
