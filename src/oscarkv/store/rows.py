"""A step's rows: the tier moves as index spans, and the spans as rows of a storage layout.

Spans come from :mod:`oscarkv.quant.tiers` (a ``TierState`` before the step and its ``Moves``).
A step first demotes the ``demote`` oldest ring entries (ring indices ``pre.head ..``) to INT2
indices ``pre.n_q ..``; then its new tokens split in token order into ``to_sink`` (sink positions
``pre.n_sink ..``), ``to_int2`` (INT2 indices ``pre.n_q + demote ..``) and ``to_ring`` (ring
indices ``pre.head + pre.n_recent ..``, before the modulus). A state holds INT2 indices
``0 .. n_q-1`` (token order), sink positions ``0 .. n_sink-1`` and ring indices
``head .. head+n_recent-1`` (oldest first).

A :class:`RowMap` places a span's entries in one layer's flat pools:

* :class:`RegionRows`: contiguous per-sequence regions (the ``transformers`` cache);
* :class:`PositionRows`: INT2 rows by position through a block table, sink and ring in a private
  block (the vLLM plug-in);
* :class:`PagedRows`: INT2 and sink rows in pages, the ring in the request slot's slab (the
  engine; :mod:`.paged` writes the same mapping as segment tables for a whole batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ..quant.tiers import Moves, TierState, apply_moves

__all__ = [
    "HeldSpans",
    "PagedRows",
    "PositionRows",
    "RegionRows",
    "RowMap",
    "Span",
    "StepSpans",
    "WriteRows",
    "held_rows",
    "held_spans",
    "page_row",
    "post_state",
    "step_spans",
]


class Span(NamedTuple):
    """``n`` consecutive indices of one tier from ``first``; ``tok``: the step-local token of the
    first entry (writes of new tokens only)."""

    first: int
    n: int
    tok: int = 0


class StepSpans(NamedTuple):
    """A step's moves against its pre-step state: demotions (ring -> INT2), then the new tokens."""

    demote_src: Span  # ring indices
    demote_dst: Span  # INT2 indices
    sink: Span  # sink positions of new tokens
    int2: Span  # INT2 indices of new tokens
    ring: Span  # ring indices of new tokens


class HeldSpans(NamedTuple):
    """What a state holds: INT2 indices, sink positions, ring indices (oldest first)."""

    int2: Span
    sink: Span
    ring: Span


def step_spans(pre: TierState, m: Moves, tok0: int = 0) -> StepSpans:
    """The spans of moves ``m`` from state ``pre``; the step's new tokens are ``tok0 ..``."""
    t_int2 = tok0 + m.to_sink
    return StepSpans(
        Span(pre.head, m.demote),
        Span(pre.n_q, m.demote),
        Span(pre.n_sink, m.to_sink, tok0),
        Span(pre.n_q + m.demote, m.to_int2, t_int2),
        Span(pre.head + pre.n_recent, m.to_ring, t_int2 + m.to_int2),
    )


def held_spans(st: TierState) -> HeldSpans:
    """The spans stored in state ``st``."""
    return HeldSpans(Span(0, st.n_q), Span(0, st.n_sink), Span(st.head, st.n_recent))


def post_state(pre: TierState, m: Moves, ring: int) -> TierState:
    """A new state: ``pre`` advanced by ``m`` (``pre`` is left as it is)."""
    st = TierState(**vars(pre))  # a copy (copy.copy takes 4x longer; this runs per sequence)
    apply_moves(st, m, ring)
    return st


class RowMap(Protocol):
    """Rows of one sequence's tier indices in one layer's flat pools."""

    def int2(self, first: int, n: int) -> Sequence[int]: ...

    def sink(self, first: int, n: int) -> Sequence[int]: ...

    def ring(self, first: int, n: int) -> Sequence[int]: ...


def _ring(base: int, first: int, n: int, mod: int) -> Sequence[int]:
    """Rows ``base + (first + i) % mod`` for ``i < n`` (a range when it does not wrap)."""
    if first + n <= mod:
        return range(base + first, base + first + n)
    return [base + (first + i) % mod for i in range(n)]


@dataclass(frozen=True)
class RegionRows:
    """Contiguous regions: INT2 index ``i`` at ``q0 + i``; sink position ``j`` at ``h0 + j``; ring
    index ``r`` at ``h0 + sink_cap + r % ring``."""

    q0: int
    h0: int
    sink_cap: int
    ring_mod: int

    def int2(self, first: int, n: int) -> Sequence[int]:
        return range(self.q0 + first, self.q0 + first + n)

    def sink(self, first: int, n: int) -> Sequence[int]:
        return range(self.h0 + first, self.h0 + first + n)

    def ring(self, first: int, n: int) -> Sequence[int]:
        return _ring(self.h0 + self.sink_cap, first, n, self.ring_mod)


@dataclass(frozen=True)
class PositionRows:
    """INT2 index ``i`` is position ``p = n_sink + i``, at row ``table[p // bs]·rpb + p % bs``; sink
    position ``j`` at ``store0 + j``; ring index ``r`` at ``store0 + sink_cap + r % ring_mod``.
    ``n_sink``: the sequence's sink length after the step (it no longer changes once INT2 or ring
    rows exist, so it also places the pre-step rows)."""

    table: list[int]
    bs: int
    rpb: int
    store0: int
    sink_cap: int
    ring_mod: int
    n_sink: int

    def int2(self, first: int, n: int) -> Sequence[int]:
        p0, t, bs, rpb = self.n_sink + first, self.table, self.bs, self.rpb
        return [t[p // bs] * rpb + p % bs for p in range(p0, p0 + n)]

    def sink(self, first: int, n: int) -> Sequence[int]:
        return range(self.store0 + first, self.store0 + first + n)

    def ring(self, first: int, n: int) -> Sequence[int]:
        return _ring(self.store0 + self.sink_cap, first, n, self.ring_mod)


def page_row(pages: list[int], x: int, ps: int, rid: str) -> int:
    """Row of list index ``x`` over ``pages`` of ``ps`` rows; ``ValueError`` past the last page."""
    if x // ps >= len(pages):
        raise ValueError(
            f"{rid}: list index {x} needs page {x // ps} of a sequence holding only {len(pages)} pages "
            "(the scheduler allocated too few)"
        )
    return pages[x // ps] * ps + x % ps


@dataclass(frozen=True)
class PagedRows:
    """INT2 index ``i`` at :func:`page_row` of ``q_pages``; sink position ``j`` of ``hp_pages``;
    ring index ``r`` at ``ring_base + r % ring_mod`` (the request slot's slab)."""

    q_pages: list[int]
    hp_pages: list[int]
    ps: int
    ring_base: int
    ring_mod: int
    rid: str = ""

    def int2(self, first: int, n: int) -> Sequence[int]:
        return [page_row(self.q_pages, x, self.ps, self.rid) for x in range(first, first + n)]

    def sink(self, first: int, n: int) -> Sequence[int]:
        return [page_row(self.hp_pages, x, self.ps, self.rid) for x in range(first, first + n)]

    def ring(self, first: int, n: int) -> Sequence[int]:
        return _ring(self.ring_base, first, n, self.ring_mod)


def held_rows(rows: RowMap, st: TierState) -> tuple[list[int], list[int]]:
    """``(INT2 rows, 16-bit rows)`` stored in ``st``: INT2 in token order; sink, then the ring
    oldest first (the order every host lists them in)."""
    h = held_spans(st)
    return list(rows.int2(h.int2.first, h.int2.n)), [
        *rows.sink(0, h.sink.n),
        *rows.ring(h.ring.first, h.ring.n),
    ]


@dataclass
class WriteRows:
    """A step's writes over several sequences, flat: ``q_tok[i]`` -> INT2 row ``q_dst[i]``,
    ``hp_tok[i]`` -> 16-bit row ``hp_dst[i]`` (sink rows, then ring rows, per sequence), and the
    16-bit rows ``demote_src`` -> INT2 rows ``demote_dst`` first."""

    demote_src: list[int] = field(default_factory=list)
    demote_dst: list[int] = field(default_factory=list)
    q_tok: list[int] = field(default_factory=list)
    q_dst: list[int] = field(default_factory=list)
    hp_tok: list[int] = field(default_factory=list)
    hp_dst: list[int] = field(default_factory=list)

    def add(self, rows: RowMap, s: StepSpans) -> None:
        """Append one sequence's writes (``s``: its :func:`step_spans`)."""
        self.demote_src += rows.ring(s.demote_src.first, s.demote_src.n)
        self.demote_dst += rows.int2(s.demote_dst.first, s.demote_dst.n)
        self.q_tok += range(s.int2.tok, s.int2.tok + s.int2.n)
        self.q_dst += rows.int2(s.int2.first, s.int2.n)
        self.hp_tok += range(s.sink.tok, s.sink.tok + s.sink.n)
        self.hp_dst += rows.sink(s.sink.first, s.sink.n)
        self.hp_tok += range(s.ring.tok, s.ring.tok + s.ring.n)
        self.hp_dst += rows.ring(s.ring.first, s.ring.n)
