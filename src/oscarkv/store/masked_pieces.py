"""The masked form of the prefill rules' key lists (:mod:`.windows`), which the CPU engine runs.

A **piece** is a span of one sequence's new positions ``[t0, t1)``, made of whole runs of
:func:`~.windows._runs` (queries that share a window start ``lo``). Its key list holds what any of
its queries reads, each key once per form: the sink in 16 bits, INT2 values from the sink to the
largest ``lo``, then 16-bit rows from the smallest ``lo`` to the piece's end; a boolean mask
``[t1 - t0, keys]`` picks each query's keys (:func:`piece_mask`). Query ``t`` reads 16-bit key
``s`` iff ``s <= t`` and (``s < sink`` or ``s >= lo(t)``), INT2 key ``s`` iff
``sink <= s < lo(t)`` (``lo = -1``: every key ``s <= t`` as stored). One piece is one
``scaled_dot_product_attention`` call (:func:`masked_attention`).

Merging runs into pieces trades the per-run gather and call (a decode-rule run is ``db`` queries)
for masked work: a piece of ``Q`` queries ending at ``e`` attends ``Q x (e + Q)`` keys at most,
against ``Q x e`` for its runs apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PIECE_QUERIES", "masked_attention", "merge_runs", "piece_keys", "piece_mask"]

#: the queries of one decode-rule piece: whole runs are merged while they fit (a longer run is a
#: piece of its own)
PIECE_QUERIES = 128

Run = tuple[int, int, int]  # (t, e, lo): new positions [t, e), 16-bit from lo (and in the sink)


def merge_runs(runs: list[Run], cap: int) -> list[list[Run]]:
    """Consecutive ``runs`` grouped into pieces of at most ``cap`` queries (or one run)."""
    out: list[list[Run]] = []
    for r in runs:
        if out and r[1] - out[-1][0][0] <= cap:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def piece_keys(pos16: torch.Tensor, pos2: torch.Tensor, sink: int, piece: list[Run]) -> torch.Tensor:
    """The bank rows (long ``[K]``) of ``piece``'s key list; ``pos16``/``pos2``: the rows of the
    sequence's positions ``0 .. end-1`` in 16 bits (as stored) and as INT2 values."""
    e = piece[-1][1]
    lo_min, hi = min(r[2] for r in piece), max(r[2] for r in piece)
    if hi <= sink:
        return pos16[:e]
    return torch.cat([pos16[:sink], pos2[sink:hi], pos16[max(lo_min, sink) : e]])


def piece_mask(sink: int, piece: list[Run]) -> torch.Tensor:
    """Bool ``[t1 - t0, K]``: which keys of :func:`piece_keys`'s list each query of ``piece`` reads
    (True: attended)."""
    t0, e = piece[0][0], piece[-1][1]
    lo_min, hi = min(r[2] for r in piece), max(r[2] for r in piece)
    ar = torch.arange
    if hi <= sink:
        kp, k16 = ar(e), torch.ones(e, dtype=torch.bool)
    else:
        a = max(lo_min, sink)
        kp = torch.cat([ar(sink), ar(sink, hi), ar(a, e)])
        k16 = torch.cat([torch.ones(sink, dtype=torch.bool), torch.zeros(hi - sink, dtype=torch.bool),
                         torch.ones(e - a, dtype=torch.bool)])  # fmt: skip
    t = ar(t0, e)[:, None]
    lo = torch.cat([torch.full((b - a,), lo, dtype=torch.long) for a, b, lo in piece])[:, None]
    hi16 = (kp <= t) & ((kp < sink) | (kp >= lo))
    low2 = (kp >= sink) & (kp < lo)
    return torch.where(k16, hi16, low2)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """``q [n, Hq, d]`` attends ``k, v [K, Hkv, d]`` where ``mask`` (bool ``[n, K]``) allows, in
    float32 math (as ``kernels.ref.prefill_attention``); every row allows at least one key.
    Returns ``[n, Hq, d]`` in ``q.dtype``."""
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=mask,
        scale=sm_scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).to(q.dtype)
