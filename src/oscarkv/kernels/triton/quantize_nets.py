"""Triton helpers of ``quantize_pack`` (its module docstring explains them): the clip threshold
by comparator networks on multisets (fp32, or packed pairs of 16-bit values), a row's exact
code thresholds, its codes (2 bits by thresholds, 4 bits directly) and the metadata rounding."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["abs_bits", "clip_threshold", "pack", "pack4", "threshold", "to_meta"]

# the packed comparators' PTX type by ``P``: 1 bf16 rows, 2 fp16 rows (0: Triton's max/min)
_PAIR_TYPES = tl.constexpr(("", "bf16x2", "f16x2"))


@triton.jit
def _ce(a, b, P: tl.constexpr = 0):
    """``(max(a, b), min(a, b))``; ``P > 0``: of int16 bit patterns of 16-bit floats that are
    ``>= 0`` or the drop value (ordered alike as ints and as floats), two per register by
    ``max/min.bf16x2`` (``.f16x2``)."""
    if P == 0:
        return tl.maximum(a, b), tl.minimum(a, b)
    else:
        return tl.inline_asm_elementwise(
            "max." + _PAIR_TYPES[P] + " $0, $2, $3;\n\tmin." + _PAIR_TYPES[P] + " $1, $2, $3;", "=r,=r,r,r",
            [a, b], dtype=(tl.int16, tl.int16), is_pure=True, pack=2,
        )  # fmt: skip


@triton.jit
def _max(a, b, P: tl.constexpr = 0):
    if P == 0:
        return tl.maximum(a, b)
    else:
        return tl.inline_asm_elementwise(
            "max." + _PAIR_TYPES[P] + " $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int16, is_pure=True, pack=2
        )


def _v_sort(n: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """A sorting network for ``n`` values that fall, then rise (V-shaped): the bitonic sort of the
    next power of two with +inf in the places past ``n``, less the comparators that only move a
    +inf up; its comparators ``(i, j)`` (``i`` takes the max) and the places of its outputs,
    largest first (7 comparators for 6 values, 20 for 12)."""
    size = 1 << (n - 1).bit_length()
    at = list(range(n)) + [None] * (size - n)  # the value on each wire (None: +inf)
    net, d = [], size // 2
    while d:
        for w in (w for w in range(size) if w // d % 2 == 0):
            i, j = at[w], at[w + d]
            if j is None:
                at[w], at[w + d] = j, i
            elif i is not None:
                net.append((i, j))
        d //= 2
    return tuple(net), tuple(at[size - n :])


# Batcher's sort of eight (19 comparators); the V-sorts of _merge by size (1 to 16) and where each
# leaves its outputs
_SORT8 = tl.constexpr(((0, 2), (1, 3), (4, 6), (5, 7), (0, 4), (1, 5), (2, 6), (3, 7), (0, 1), (2, 3), (4, 5),
                       (6, 7), (2, 4), (3, 5), (1, 4), (3, 6), (1, 2), (3, 4), (5, 6)))  # fmt: skip
_V_SORT = tl.constexpr(tuple(tl.constexpr(_v_sort(n)[0]) for n in range(1, 17)))
_V_OUT = tl.constexpr(tuple(tl.constexpr(_v_sort(n)[1]) for n in range(1, 17)))


@triton.jit
def _put(v, i: tl.constexpr, x):
    """The tuple ``v`` with ``x`` in place ``i``."""
    return v[:i] + (x,) + v[i + 1 :]


@triton.jit
def _network(v, NET: tl.constexpr, P: tl.constexpr = 0):
    """The comparators ``NET`` on the tuple ``v`` (outputs that no one reads are dead code, those
    of the packed ``_ce`` too: ptxas drops them)."""
    for c in tl.static_range(len(NET.value)):
        hi, lo = _ce(v[NET[c][0]], v[NET[c][1]], P)
        v = _put(_put(v, NET[c][0], hi), NET[c][1], lo)
    return v


@triton.jit
def _merge(a, b, K: tl.constexpr, P: tl.constexpr = 0):
    """The ``K`` largest of two sorted tuples of ``m`` values (largest first, ``m <= K <= 2m``),
    sorted: ``c_i = max(a_i, b_{K-1-i})`` (one side alone past the other's end) holds them and
    falls, then rises (``_v_sort``)."""
    c = ()
    for i in tl.static_range(K):
        if i < len(a) and K - 1 - i < len(b):
            c = c + (_max(a[i], b[K - 1 - i], P),)
        elif i < len(a):
            c = c + (a[i],)
        else:
            c = c + (b[K - 1 - i],)
    c = _network(c, _V_SORT[K - 1], P)
    t = ()
    for i in tl.static_range(K):
        t = t + (c[_V_OUT[K - 1][i]],)
    return t


@triton.jit
def _merge6(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
    """``tl.reduce``'s combine: ``_merge`` of two six-lists (``_merge12``: of two twelve-lists)."""
    return _merge((a0, a1, a2, a3, a4, a5), (b0, b1, b2, b3, b4, b5), 6)


@triton.jit
def _merge12(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
             b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11):  # fmt: skip
    a = (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)
    return _merge(a, (b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11), 12)


@triton.jit
def _halves(x, W: tl.constexpr = 2):
    """Columns ``j`` and ``j + W/2`` of each run of ``W`` columns (a register relabelling where a
    thread holds runs of ``W``; ``W >= 4`` keeps a thread's packed pairs whole)."""
    if W == 2:
        return tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(x, [x.shape[0], x.shape[1] // W, 2, W // 2]), (0, 1, 3, 2)))
        return tl.reshape(lo, [x.shape[0], x.shape[1] // 2]), tl.reshape(hi, [x.shape[0], x.shape[1] // 2])


@triton.jit
def _level(v, W: tl.constexpr, K: tl.constexpr, P: tl.constexpr):
    """One merge level of the column tree: the halves of each run of ``W`` columns merged."""
    lo = ()
    hi = ()
    for i in tl.static_range(len(v)):
        x, y = _halves(v[i], W)
        lo = lo + (x,)
        hi = hi + (y,)
    return _merge(lo, hi, K, P)


@triton.jit
def _row_top(a, K: tl.constexpr, TREE: tl.constexpr, P: tl.constexpr = 0):
    """The ``K`` (6 or 12) largest values of the row of pieces ``a``, sorted (``[BLOCK_R]`` each):
    each column sorted (its six largest for ``K = 6``), ``TREE >= 1`` levels of merges, ``tl.reduce``.
    int16 (``P``: see ``_ce``): packed pairs down to the last in-thread level (``2^TREE``: the
    columns a thread holds), whose single values and the ``tl.reduce`` take int16 ops (ptxas pairs
    most of them up itself)."""
    tl.static_assert(K == 6 or K == 12, "rounds of 6 or 12 values (the tl.reduce combines)")
    v = _network(a, _SORT8, P)[:K]
    tl.static_assert(TREE >= 1, "at least one in-thread merge level (a column's eight are fewer than 12)")
    for lvl in tl.static_range(TREE):
        if a[0].dtype == tl.int16 and lvl + 1 < TREE:
            v = _level(v, 2 << (TREE - 1 - lvl), K, P)
        else:
            v = _level(v, 2, K, 0)
    if K == 6:
        return tl.reduce(v, 1, _merge6)
    else:
        return tl.reduce(v, 1, _merge12)


@triton.jit
def _ge(a, b):
    return (a >= b).to(tl.int32)


@triton.jit
def _drop(a, b):
    return tl.where(a >= b, -1.0, a)


@triton.jit
def _drop_count(a, b, P: tl.constexpr = 0):
    """``_drop`` of int16 bit patterns (the drop value 0xBF80, bf16 -1.0 / fp16 -1.875, is below
    every ``|x|`` as an int and as a float) and ``16·[a >= b]`` as int32. ``P > 0``: per packed
    pair, its ``16·count`` (the popcount of the compare mask) in the first element, 0 in the
    second: the same sum."""
    if P == 0:
        ge = a >= b
        return tl.where(ge, tl.full(a.shape, -16512, tl.int16), a), tl.where(ge, 16, 0)
    else:
        # lop3 0xB8: (a & ~m) | (0xBF80BF80 & m)
        return tl.inline_asm_elementwise(
            "{\n\t.reg .b32 m;\n\tset.ge.u32." + _PAIR_TYPES[P] + " m, $3, $4;\n\t"
            "lop3.b32 $0, $3, m, 0xBF80BF80, 0xB8;\n\tpopc.b32 $1, m;\n\tmov.b32 $2, 0;\n\t}",
            "=r,=r,=r,r,r", [a, b], dtype=(tl.int16, tl.int32), is_pure=True, pack=2,
        )  # fmt: skip


@triton.jit
def clip_threshold(a, N_DROP: tl.constexpr, ROUNDS: tl.constexpr, TREE: tl.constexpr, K: tl.constexpr,
                    P: tl.constexpr = 0):  # fmt: skip
    """The ``(N_DROP+1)``-th largest of the row of pieces ``a`` (a tuple of eight, all >= 0),
    counting ties, in rounds of its ``K`` largest; fp32, or int16 bit patterns of 16-bit floats
    (``P``: see ``_ce``)."""
    s = a
    above = tl.zeros([a[0].shape[0]], tl.int32)  # values >= the previous list's smallest
    tau = tl.zeros([a[0].shape[0]], a[0].dtype)
    for r in tl.static_range(ROUNDS):
        t = _row_top(s, K, TREE, P)
        k = N_DROP - above  # rank of tau within this list (out of [0, K) once found)
        for j in tl.static_range(K):
            tau = tl.where(k == j, t[j], tau)
        if r + 1 < ROUNDS:
            b = t[K - 1][:, None]
            s = ()
            cnt = tl.zeros(a[0].shape, tl.int32)
            for i in tl.static_range(8):
                if a[0].dtype == tl.int16:  # as below, on the bit patterns: 16·count
                    x, n = _drop_count(a[i], b, P)
                else:
                    x, n = _drop(a[i], b), _ge(a[i], b)
                s = s + (x,)
                cnt += n
            above = tl.sum(cnt, 1) >> 4 if a[0].dtype == tl.int16 else tl.sum(cnt, 1)
            # rank N_DROP past this list but among the values >= its smallest: a tie with it
            tau = tl.where((k >= K) & (above > N_DROP), t[K - 1], tau)
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
def threshold(BETA: tl.constexpr, STRICT: tl.constexpr, sd, zd, lo, hi):
    """Smallest fp32 ``v`` with ``⌊fl(fl(v ⊘ s) + z) + 0.5⌋ >= k`` (``BETA`` = β_k), as a
    ``[BLOCK_R, 1]`` column; ``-inf`` when all of ``[lo, hi]`` reaches it, NaN when none does."""
    u = _ceil32(tl.full(zd.shape, BETA, tl.float64) - zd, STRICT)
    mu = (u.to(tl.float64) + _unkey(_key(u) - 1).to(tl.float64)) * 0.5
    v = _ceil32(mu * sd, (u.to(tl.int32, bitcast=True) & 1) == 1)
    return tl.where(v <= lo, float("-inf"), tl.where(v > hi, float("nan"), v))[:, None]


@triton.jit
def abs_bits(x):
    return x.to(tl.int16, bitcast=True) & 0x7FFF


@triton.jit
def to_meta(v, ty: tl.constexpr):
    """Round fp32 ``v`` to the metadata dtype, to nearest even (bf16 by integer rounding of the
    bits, as the GPU's conversion does, since Triton's interpreter truncates; NaN as 0x7FC0: the
    GPU's NaN, 0x7FFFFFFF, would round into the sign bit, -0.0)."""
    if ty == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = tl.where(v == v, (b + 0x7FFF + ((b >> 16) & 1)) >> 16, 0x7FC0)
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(ty)


@triton.jit
def _code(x, t1, t2, t3, shift):
    """``code(x) << shift``: the high bit is ``x >= t2``, the low bit ``x >=`` t3 or t1."""
    x = x.to(tl.float32)  # (16-bit x: exact)
    h = x >= t2
    low = x >= tl.where(h, t3, t1)
    return tl.where(h, 2 << shift, 0) | tl.where(low, 1 << shift, 0)


@triton.jit
def pack(xa, xb, xc, xd, t1, t2, t3, BLOCK_R: tl.constexpr, D8: tl.constexpr):
    """Bytes ``code(xa) | code(xb) << 2 | code(xc) << 4 | code(xd) << 6`` as int32 words."""
    sh = (tl.arange(0, D8) % 4 * 8)[None, :]
    c = _code(xa, t1, t2, t3, sh) | _code(xb, t1, t2, t3, sh + 2)
    c = c | _code(xc, t1, t2, t3, sh + 4) | _code(xd, t1, t2, t3, sh + 6)
    return tl.sum(tl.reshape(c, [BLOCK_R, D8 // 4, 4]), 2)


@triton.jit
def _code4(x, lo, hi, sd, z, ok, CLIP: tl.constexpr):
    """The reference's 4-bit code ``clamp(⌊fl(fl(x' ⊘ s) + z) + 0.5⌋, 0, 15)`` of ``x`` (``x'``:
    clamped to the clipped ``[lo, hi]``, the same as to ``±tau``); 0 where not ``ok``."""
    x = x.to(tl.float32)  # (16-bit x: exact)
    if CLIP:
        x = tl.minimum(tl.maximum(x, lo), hi)
    # the fp64 quotient rounded to fp32 is the correctly rounded fp32 one, subnormals included
    u = (x.to(tl.float64) / sd).to(tl.float32)
    q = tl.floor((u + z) + 0.5)
    return tl.where(ok, tl.minimum(tl.maximum(q, 0.0), 15.0).to(tl.int32), 0)


@triton.jit
def pack4(xa, xb, lo, hi, sd, z, ok, CLIP: tl.constexpr, BLOCK_R: tl.constexpr, D8: tl.constexpr):
    """Bytes ``code4(xa) | code4(xb) << 4`` (the halved 4-bit layout) as int32 words; ``lo``, ``hi``,
    ``sd`` (fp64 scale), ``z`` and ``ok`` are ``[BLOCK_R, 1]`` columns."""
    sh = (tl.arange(0, D8) % 4 * 8)[None, :]
    c = (_code4(xa, lo, hi, sd, z, ok, CLIP) << sh) | (_code4(xb, lo, hi, sd, z, ok, CLIP) << (sh + 4))
    return tl.sum(tl.reshape(c, [BLOCK_R, D8 // 4, 4]), 2)
