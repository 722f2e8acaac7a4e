"""Which tier each token of a sequence lives in: the window rules, over plain ints.

A sequence's positions form three runs, in token order: the **sink** ``[0, n_sink)`` (16-bit),
the **INT2** tier ``[n_sink, n_sink + n_q)`` and the **recent window** (16-bit, the last
``n_recent`` positions), kept in a ring whose oldest entry is at ring index ``head``.

Rules (spec §5.2–5.5; ``S, R, db`` = ``sink_tokens, recent_tokens, demote_block``):

* the sink takes the first new tokens until it holds ``sink_target`` (the HF cache: the first
  ``min(first write, S)`` tokens; an engine pins ``min(prompt, S)`` at admission), and nothing
  after that: generated tokens never join it;
* a prefill keeps the last ``R`` tokens of what has been seen in the ring: older ring rows are
  demoted first, the middle of the new tokens goes straight to INT2;
* a decode step adds one token; when the ring already holds ``window_limit = max(R + db − 1, 1)``
  tokens, the ``db`` oldest are demoted first, so the ring cycles through ``R … R + db − 1``;
* passthrough (``quantize=False``): everything after the sink goes to the ring, which grows.

No slot layout lives here: callers map ring indices and INT2 list indices to storage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..config import QuantSpec

__all__ = [
    "Moves",
    "Tier",
    "TierState",
    "apply_moves",
    "plan_moves",
    "ring_spans",
    "tier_map",
    "window_limit",
]


class Tier(enum.IntEnum):
    SINK = 0
    INT2 = 1
    RING = 2


@dataclass
class TierState:
    """One sequence's tier counts (mutated by :func:`apply_moves`)."""

    n_sink: int = 0
    n_q: int = 0
    head: int = 0  # ring index of the oldest recent token
    n_recent: int = 0
    started: bool = False  # some token was stored (the HF sink rule looks at the first write)


@dataclass(frozen=True)
class Moves:
    """One step for one sequence. The new tokens split in token order into ``to_sink``, then
    ``to_int2``, then ``to_ring``; the ``demote`` oldest ring rows go to INT2 before any of them
    (so INT2 stays in token order and a freed ring index may receive a new token)."""

    to_sink: int = 0
    demote: int = 0
    to_int2: int = 0
    to_ring: int = 0

    @property
    def n_new(self) -> int:
        return self.to_sink + self.to_int2 + self.to_ring


def window_limit(spec: QuantSpec) -> int:
    """Most tokens the ring holds with quantization on: ``max(R + db − 1, 1)``."""
    return max(spec.recent_tokens + spec.demote_block - 1, 1)


def plan_moves(
    st: TierState,
    n_new: int,
    is_decode: bool,
    spec: QuantSpec,
    sink_target: int | None = None,
    quantize: bool = True,
) -> Moves:
    """Split ``n_new`` new valid tokens of one sequence over the tiers (``st`` is not changed).

    ``sink_target=None`` is the HF cache's rule: ``min(n_new, S)`` on the first write with tokens
    (0 in passthrough), nothing later.
    """
    if sink_target is None:
        first = min(n_new, spec.sink_tokens if quantize else 0)
        sink_target = st.n_sink if st.started else first
    to_sink = min(n_new, max(sink_target - st.n_sink, 0))
    rest = n_new - to_sink
    if not quantize:
        return Moves(to_sink, 0, 0, rest)
    if is_decode:
        full = rest > 0 and st.n_recent >= window_limit(spec)
        return Moves(to_sink, min(spec.demote_block, st.n_recent) if full else 0, 0, rest)
    combined = st.n_recent + rest
    out = combined - min(combined, spec.recent_tokens)  # tokens leaving the window
    demote = min(st.n_recent, out)
    return Moves(to_sink, demote, out - demote, rest - (out - demote))


def apply_moves(st: TierState, m: Moves, ring: int) -> None:
    """Advance ``st`` by ``m``; ``ring`` = the ring's capacity (its indices are taken mod it)."""
    if m.n_new:
        st.started = True
    st.n_sink += m.to_sink
    st.n_q += m.demote + m.to_int2
    if m.demote:
        st.head = (st.head + m.demote) % ring
    st.n_recent += m.to_ring - m.demote


def ring_spans(st: TierState, ring: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The window as ``((first ring index, count), (0, count))``, oldest first (wrapping)."""
    first = min(st.n_recent, ring - st.head) if ring else 0
    return (st.head, first), (0, st.n_recent - first)


def tier_map(st: TierState) -> list[Tier]:
    """The tier of each stored position ``0 … n_sink + n_q + n_recent − 1``."""
    return [Tier.SINK] * st.n_sink + [Tier.INT2] * st.n_q + [Tier.RING] * st.n_recent
