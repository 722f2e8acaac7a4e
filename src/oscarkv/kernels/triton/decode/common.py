"""Jit helpers every decode tile loop shares: split ranges, metadata words, the partial-state
rows and their stores, and the online softmax's bookkeeping.

Stage 1 writes, per query row ``(b, hq)`` and split ``sp``, a normalised partial output
``O[(b·Hq + hq)·total + sp, :]`` and its log-sum-exp (base 2) ``LSE[...]``; ``-inf`` for a split
that saw no token. The merge combines them.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["SUBNORMAL", "inv_sum", "live_split", "meta_pair", "partial_rows", "rescale", "split_range",
           "store_lse", "store_part", "taper_range"]  # fmt: skip

#: 2**24: an fp16 word holding the bits ``c`` is worth ``c * 2**-24``
SUBNORMAL = tl.constexpr(16777216.0)


@triton.jit
def meta_pair(words, META: tl.constexpr):
    """``(scale, zero)`` as fp32 from one word per row: int32 for 16-bit metadata (``META`` 0 =
    fp16, 1 = bf16), int64 for fp32 (2). One 4/8-byte load per row instead of two 2/4-byte ones
    lets Triton pipeline it with ``cp.async`` like the code tiles."""
    if META == 2:
        s = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        z = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        dt: tl.constexpr = tl.float16 if META == 0 else tl.bfloat16
        s = (words & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
        z = (words >> 16).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
    return s, z


@triton.jit
def partial_rows(b, h0, sp, total, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, HQ: tl.constexpr):
    """Rows ``(b, h0·g + r, sp)`` of the ``[B, Hq, total]`` partial-state arrays for the ``HPB·g``
    query heads of KV heads ``h0 .. h0 + HPB - 1`` (padded to ``R_PAD``), and their mask."""
    offs_r = tl.arange(0, R_PAD)
    return (b * HQ + h0 * G + offs_r).to(tl.int64) * total + sp, offs_r < HPB * G


@triton.jit
def store_lse(LSE, row, gmask, m_i, l_i):
    """Log-sum-exp (base 2) of a split; ``-inf`` for a split that saw no token."""
    has = l_i > 0
    tl.store(LSE + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=gmask)


@triton.jit
def live_split(n, split_size, planned, TILE: tl.constexpr):
    """Positions per split of a list of ``n`` tokens whose launch was planned for lists of
    ``planned`` tokens in splits of ``split_size``: scaled by ``n / planned`` and rounded up to whole
    ``TILE``-token tiles, so that a list shorter than its plan (a graph's padded length bucket) keeps
    every program busy instead of leaving the last ones empty; the splits still cover the list."""
    s = (n.to(tl.int64) * split_size + planned - 1) // planned
    return (((s + TILE - 1) // TILE) * TILE).to(tl.int32)


@triton.jit
def split_range(INDPTR, b, k, split_size, planned, TILE: tl.constexpr):
    """Slot-list positions ``[lo, hi)`` of split ``k`` of sequence ``b`` in one tier (splits of
    :func:`live_split` positions)."""
    start, end = tl.load(INDPTR + b), tl.load(INDPTR + b + 1)
    lo = start + k * live_split(end - start, split_size, planned, TILE)
    return lo, tl.minimum(lo + live_split(end - start, split_size, planned, TILE), end)


@triton.jit
def taper_range(INDPTR, b, k, split_size, n_early, split_late, planned, TILE: tl.constexpr):
    """Slot-list positions ``[lo, hi)`` of split ``k`` of sequence ``b``: splits ``< n_early`` of
    ``split_size`` positions, the later ones of ``split_late`` (``planner.taper``: the programs
    launched last start late, so they get less), both scaled to the list as :func:`live_split`."""
    start, end = tl.load(INDPTR + b), tl.load(INDPTR + b + 1)
    early = live_split(end - start, split_size, planned, TILE)
    late_size = live_split(end - start, split_late, planned, TILE)
    late = tl.maximum(k - n_early, 0)
    lo = start + (k - late) * early + late * late_size
    return lo, tl.minimum(lo + tl.where(k < n_early, early, late_size), end)


@triton.jit
def inv_sum(l_i):
    """``1 / l_i`` where the softmax sum is positive, else 0 (a split that saw no token)."""
    has = l_i > 0
    return tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)


@triton.jit
def rescale(m_i, m_new, l_i, zacc):
    """The old state's factor ``alpha`` and the rescaled ``(sum, Σ p∘s∘z)``."""
    alpha = tl.exp2(m_i - m_new)
    return alpha, l_i * alpha, zacc * alpha


@triton.jit
def store_part(op, i: tl.constexpr, e: tl.constexpr, acc, inv, z, mask, D4: tl.constexpr):
    """Output dims ``D4·i + e`` onwards from the accumulator of code plane ``i`` (worth
    ``c·4^i·2⁻²⁴``); ``inv`` (1 / softmax sum), ``z`` (``Σ p∘s∘z``, normalised) and ``mask``
    broadcast against ``acc`` (per row, or per column in the transposed swap loop)."""
    scale = SUBNORMAL / (4.0**i)
    tl.store(op + D4 * i + e, acc * (inv * scale) - z, mask=mask)
