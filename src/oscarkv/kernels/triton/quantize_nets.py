"""Triton helpers of ``quantize_pack`` (its module docstring explains them): the clip threshold
by comparator networks on multisets (fp32, or packed pairs of 16-bit values), a row's exact
code thresholds, its codes, the metadata rounding and the split of a block into column pieces."""

from __future__ import annotations

import triton
import triton.language as tl

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


@triton.jit
def _top6_of_8(a0, a1, a2, a3, a4, a5, a6, a7, P: tl.constexpr = 0):
    """The six largest of eight, largest first (Batcher's 19-comparator sort of eight; the
    comparator outputs that only reach the two smallest are dead code)."""
    a0, a2 = _ce(a0, a2, P)
    a1, a3 = _ce(a1, a3, P)
    a4, a6 = _ce(a4, a6, P)
    a5, a7 = _ce(a5, a7, P)
    a0, a4 = _ce(a0, a4, P)
    a1, a5 = _ce(a1, a5, P)
    a2, a6 = _ce(a2, a6, P)
    a3, a7 = _ce(a3, a7, P)
    a0, a1 = _ce(a0, a1, P)
    a2, a3 = _ce(a2, a3, P)
    a4, a5 = _ce(a4, a5, P)
    a6, a7 = _ce(a6, a7, P)
    a2, a4 = _ce(a2, a4, P)
    a3, a5 = _ce(a3, a5, P)
    a1, a4 = _ce(a1, a4, P)
    a3, a6 = _ce(a3, a6, P)
    a1, a2 = _ce(a1, a2, P)
    a3, a4 = _ce(a3, a4, P)
    a5, a6 = _ce(a5, a6, P)
    return a0, a1, a2, a3, a4, a5


@triton.jit
def _merge6(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5, P: tl.constexpr = 0):
    """The six largest of two sorted six-lists, sorted: ``c_i = max(a_i, b_{5-i})`` holds them
    and is V-shaped; padded with two +inf it is bitonic, and the bitonic sort of eight reduces to
    seven comparators."""
    c0, c1, c2 = _max(a0, b5, P), _max(a1, b4, P), _max(a2, b3, P)
    c3, c4, c5 = _max(a3, b2, P), _max(a4, b1, P), _max(a5, b0, P)
    c0, c4 = _ce(c0, c4, P)
    c1, c5 = _ce(c1, c5, P)
    t0, t1 = _ce(c0, c1, P)
    c4, c2 = _ce(c4, c2, P)
    c5, c3 = _ce(c5, c3, P)
    u0, u1 = _ce(c4, c5, P)
    u2, u3 = _ce(c2, c3, P)
    return t0, t1, u0, u1, u2, u3


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
def _level(l0, l1, l2, l3, l4, l5, W: tl.constexpr, P: tl.constexpr):
    """One merge level of the column tree: the halves of each run of ``W`` columns merged."""
    l0, m0 = _halves(l0, W)
    l1, m1 = _halves(l1, W)
    l2, m2 = _halves(l2, W)
    l3, m3 = _halves(l3, W)
    l4, m4 = _halves(l4, W)
    l5, m5 = _halves(l5, W)
    return _merge6(l0, l1, l2, l3, l4, l5, m0, m1, m2, m3, m4, m5, P)


@triton.jit
def _row_top6(a0, a1, a2, a3, a4, a5, a6, a7, TREE: tl.constexpr, P: tl.constexpr = 0):
    """The row's six largest values, sorted (``[BLOCK_R]`` each). int16 (``P``: see ``_ce``):
    packed pairs down to the last in-thread level (``2^TREE``: the columns a thread holds), whose
    single values and the ``tl.reduce`` take int16 ops (ptxas pairs most of them up itself)."""
    l0, l1, l2, l3, l4, l5 = _top6_of_8(a0, a1, a2, a3, a4, a5, a6, a7, P)
    for lvl in tl.static_range(TREE):
        if a0.dtype == tl.int16 and lvl + 1 < TREE:
            l0, l1, l2, l3, l4, l5 = _level(l0, l1, l2, l3, l4, l5, 2 << (TREE - 1 - lvl), P)
        else:
            l0, l1, l2, l3, l4, l5 = _level(l0, l1, l2, l3, l4, l5, 2, 0)
    return tl.reduce((l0, l1, l2, l3, l4, l5), 1, _merge6)


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
def _clip_threshold(a0, a1, a2, a3, a4, a5, a6, a7, N_DROP: tl.constexpr, ROUNDS: tl.constexpr,
                    TREE: tl.constexpr, P: tl.constexpr = 0):  # fmt: skip
    """The ``(N_DROP+1)``-th largest of the row of pieces ``a*`` (all >= 0), counting ties; fp32,
    or int16 bit patterns of 16-bit floats (``P``: see ``_ce``)."""
    s0, s1, s2, s3, s4, s5, s6, s7 = a0, a1, a2, a3, a4, a5, a6, a7
    above = tl.zeros([a0.shape[0]], tl.int32)  # values >= the previous list's smallest
    tau = tl.zeros([a0.shape[0]], a0.dtype)
    for r in tl.static_range(ROUNDS):
        t0, t1, t2, t3, t4, t5 = _row_top6(s0, s1, s2, s3, s4, s5, s6, s7, TREE, P)
        k = N_DROP - above  # rank of tau within this list (out of [0, 6) once found)
        tau = tl.where(k == 0, t0, tl.where(k == 1, t1, tl.where(k == 2, t2, tau)))
        tau = tl.where(k == 3, t3, tl.where(k == 4, t4, tl.where(k == 5, t5, tau)))
        if r + 1 < ROUNDS and a0.dtype == tl.int16:  # as below, on the bit patterns
            b = t5[:, None]
            s0, n0 = _drop_count(a0, b, P)
            s1, n1 = _drop_count(a1, b, P)
            s2, n2 = _drop_count(a2, b, P)
            s3, n3 = _drop_count(a3, b, P)
            s4, n4 = _drop_count(a4, b, P)
            s5, n5 = _drop_count(a5, b, P)
            s6, n6 = _drop_count(a6, b, P)
            s7, n7 = _drop_count(a7, b, P)
            above = tl.sum(n0 + n1 + n2 + n3 + n4 + n5 + n6 + n7, 1) >> 4
            tau = tl.where((k >= 6) & (above > N_DROP), t5, tau)
        elif r + 1 < ROUNDS:
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


@triton.jit
def _abs_bits(x):
    return x.to(tl.int16, bitcast=True) & 0x7FFF


@triton.jit
def _to_meta(v, ty: tl.constexpr):
    """Round fp32 ``v`` to the metadata dtype, to nearest even (bf16 by integer rounding of the
    bits, as the GPU's conversion does, since Triton's interpreter truncates)."""
    if ty == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
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
def _pack(xa, xb, xc, xd, t1, t2, t3, BLOCK_R: tl.constexpr, D8: tl.constexpr):
    """Bytes ``code(xa) | code(xb) << 2 | code(xc) << 4 | code(xd) << 6`` as int32 words."""
    sh = (tl.arange(0, D8) % 4 * 8)[None, :]
    c = _code(xa, t1, t2, t3, sh) | _code(xb, t1, t2, t3, sh + 2)
    c = c | _code(xc, t1, t2, t3, sh + 4) | _code(xd, t1, t2, t3, sh + 6)
    return tl.sum(tl.reshape(c, [BLOCK_R, D8 // 4, 4]), 2)


@triton.jit
def _split8(acc, BLOCK_R: tl.constexpr, D8: tl.constexpr):
    """``[BLOCK_R, 8·D8]`` -> its eight column pieces (a register relabelling)."""
    t = tl.permute(tl.reshape(acc, [BLOCK_R, 2, 2, 2, D8]), (0, 4, 1, 2, 3))
    e, o = tl.split(t)
    e0, e1 = tl.split(e)
    o0, o1 = tl.split(o)
    p0, p4 = tl.split(e0)
    p2, p6 = tl.split(e1)
    p1, p5 = tl.split(o0)
    p3, p7 = tl.split(o1)
    return p0, p1, p2, p3, p4, p5, p6, p7
