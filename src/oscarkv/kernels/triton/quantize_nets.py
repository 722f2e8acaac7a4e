"""Triton helpers of ``quantize_pack`` (its module docstring explains them): the clip threshold
by comparator networks on multisets, and a row's exact code thresholds."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ce(a, b):
    return tl.maximum(a, b), tl.minimum(a, b)


@triton.jit
def _top6_of_8(a0, a1, a2, a3, a4, a5, a6, a7):
    """The six largest of eight, largest first (Batcher's 19-comparator sort of eight; the
    comparator outputs that only reach the two smallest are dead code)."""
    a0, a2 = _ce(a0, a2)
    a1, a3 = _ce(a1, a3)
    a4, a6 = _ce(a4, a6)
    a5, a7 = _ce(a5, a7)
    a0, a4 = _ce(a0, a4)
    a1, a5 = _ce(a1, a5)
    a2, a6 = _ce(a2, a6)
    a3, a7 = _ce(a3, a7)
    a0, a1 = _ce(a0, a1)
    a2, a3 = _ce(a2, a3)
    a4, a5 = _ce(a4, a5)
    a6, a7 = _ce(a6, a7)
    a2, a4 = _ce(a2, a4)
    a3, a5 = _ce(a3, a5)
    a1, a4 = _ce(a1, a4)
    a3, a6 = _ce(a3, a6)
    a1, a2 = _ce(a1, a2)
    a3, a4 = _ce(a3, a4)
    a5, a6 = _ce(a5, a6)
    return a0, a1, a2, a3, a4, a5


@triton.jit
def _merge6(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
    """The six largest of two sorted six-lists, sorted: ``c_i = max(a_i, b_{5-i})`` holds them
    and is V-shaped; padded with two +inf it is bitonic, and the bitonic sort of eight reduces to
    seven comparators."""
    c0, c1, c2 = tl.maximum(a0, b5), tl.maximum(a1, b4), tl.maximum(a2, b3)
    c3, c4, c5 = tl.maximum(a3, b2), tl.maximum(a4, b1), tl.maximum(a5, b0)
    c0, c4 = _ce(c0, c4)
    c1, c5 = _ce(c1, c5)
    t0, t1 = _ce(c0, c1)
    c4, c2 = _ce(c4, c2)
    c5, c3 = _ce(c5, c3)
    u0, u1 = _ce(c4, c5)
    u2, u3 = _ce(c2, c3)
    return t0, t1, u0, u1, u2, u3


@triton.jit
def _halves(x):
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))


@triton.jit
def _row_top6(a0, a1, a2, a3, a4, a5, a6, a7, TREE: tl.constexpr):
    """The row's six largest values, sorted (``[BLOCK_R]`` each)."""
    l0, l1, l2, l3, l4, l5 = _top6_of_8(a0, a1, a2, a3, a4, a5, a6, a7)
    for _ in tl.static_range(TREE):
        l0, m0 = _halves(l0)
        l1, m1 = _halves(l1)
        l2, m2 = _halves(l2)
        l3, m3 = _halves(l3)
        l4, m4 = _halves(l4)
        l5, m5 = _halves(l5)
        l0, l1, l2, l3, l4, l5 = _merge6(l0, l1, l2, l3, l4, l5, m0, m1, m2, m3, m4, m5)
    return tl.reduce((l0, l1, l2, l3, l4, l5), 1, _merge6)


@triton.jit
def _ge(a, b):
    return (a >= b).to(tl.int32)


@triton.jit
def _drop(a, b):
    return tl.where(a >= b, -1.0, a)


@triton.jit
def _clip_threshold(a0, a1, a2, a3, a4, a5, a6, a7, N_DROP: tl.constexpr, ROUNDS: tl.constexpr,
                    TREE: tl.constexpr):  # fmt: skip
    """The ``(N_DROP+1)``-th largest of the row of pieces ``a*`` (all >= 0), counting ties."""
    s0, s1, s2, s3, s4, s5, s6, s7 = a0, a1, a2, a3, a4, a5, a6, a7
    above = tl.zeros([a0.shape[0]], tl.int32)  # values >= the previous list's smallest
    tau = tl.zeros([a0.shape[0]], tl.float32)
    for r in tl.static_range(ROUNDS):
        t0, t1, t2, t3, t4, t5 = _row_top6(s0, s1, s2, s3, s4, s5, s6, s7, TREE)
        k = N_DROP - above  # rank of tau within this list (out of [0, 6) once found)
        tau = tl.where(k == 0, t0, tl.where(k == 1, t1, tl.where(k == 2, t2, tau)))
        tau = tl.where(k == 3, t3, tl.where(k == 4, t4, tl.where(k == 5, t5, tau)))
        if r + 1 < ROUNDS:
            b = t5[:, None]
            n = _ge(a0, b) + _ge(a1, b) + _ge(a2, b) + _ge(a3, b) + _ge(a4, b) + _ge(a5, b) + _ge(a6, b)
            above = tl.sum(n + _ge(a7, b), 1)
            # rank N_DROP past this list but among the values >= t5: a tie with t5
            tau = tl.where((k >= 6) & (above > N_DROP), t5, tau)
            s0, s1, s2, s3 = _drop(a0, b), _drop(a1, b), _drop(a2, b), _drop(a3, b)
            s4, s5, s6, s7 = _drop(a4, b), _drop(a5, b), _drop(a6, b), _drop(a7, b)
    return tau


@triton.jit
def _key(f):
    """fp32 -> int32, monotone, ±0 -> 0 (so key ± 1 steps to the adjacent float)."""
    i = f.to(tl.int32, bitcast=True)
    return tl.where(i < 0, -(i & 0x7FFFFFFF), i)


@triton.jit
def _unkey(k):
    b = tl.where(k < 0, (-k).to(tl.uint32, bitcast=True) | 0x80000000, k.to(tl.uint32, bitcast=True))
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _ceil32(m, strict):
    """The smallest fp32 ``>= m`` (``> m`` where ``strict``) for fp64 ``m``."""
    c = m.to(tl.float32)
    cd = c.to(tl.float64)
    return tl.where((cd < m) | (strict & (cd == m)), _unkey(_key(c) + 1), c)


@triton.jit
def _threshold(BETA: tl.constexpr, STRICT: tl.constexpr, sd, zd, lo, hi):
    """Smallest fp32 ``v`` with ``⌊fl(fl(v ⊘ s) + z) + 0.5⌋ >= k`` (``BETA`` = β_k), as a
    ``[BLOCK_R, 1]`` column; ``-inf`` when all of ``[lo, hi]`` reaches it, NaN when none does."""
    u = _ceil32(tl.full(zd.shape, BETA, tl.float64) - zd, STRICT)
    mu = (u.to(tl.float64) + _unkey(_key(u) - 1).to(tl.float64)) * 0.5
    v = _ceil32(mu * sd, (u.to(tl.int32, bitcast=True) & 1) == 1)
    return tl.where(v <= lo, float("-inf"), tl.where(v > hi, float("nan"), v))[:, None]
