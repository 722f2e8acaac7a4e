"""Stage-1 tile loops of the Triton decode attention: the INT2 tier and the 16-bit tier.

The INT2 tile is never dequantized. With codes ``c`` and per-row ``(s, z)``:
``q·k = s·(q·c) − s·z·Σq`` and ``p·V = (p∘s)·c − Σ p∘s∘z``, so ``q·c`` and ``(p∘s)·c`` are four
``tl.dot``s of fp16 operands with the 2-bit *planes* of the codes (the quartered byte layout makes
plane ``i`` the contiguous quarter ``i`` of the head dimension). A plane is built by masking the
code bits in place into the low mantissa bits of an fp16 word: its value is the exact subnormal
``c·4^i·2⁻²⁴``, so building it needs no shift, no int-to-float conversion and no offset
subtraction; query quarter ``i`` is pre-scaled by ``4^-i`` (exact) and the ``2²⁴`` and ``4^-i`` of
the value planes are folded into the final scaling. On CUDA one PTX block builds the four planes
of four bytes at once (two byte permutes, then one mask per plane and pair of codes); the CPU
interpreter, which cannot run PTX, builds the same bit patterns with Triton integer ops.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["hp_split", "int2_split_bytes"]

#: 2**24: an fp16 word holding the bits ``c`` is worth ``c * 2**-24``
SUBNORMAL = tl.constexpr(16777216.0)

# four code bytes in one register -> the four 2-bit planes as pairs of fp16 subnormals: two byte
# permutes spread the bytes over 16-bit lanes, then one mask per plane and pair of codes (plane
# ``i`` keeps its bits in place, so it holds ``c·4^i``; the caller scales by ``4^-i``)
_BYTE_PLANES_PTX = tl.constexpr("""{
.reg .b32 lo, hi;
prmt.b32 lo, $8, 0, 0x4140;
prmt.b32 hi, $8, 0, 0x4342;
and.b32 $0, lo, 0x00030003;
and.b32 $1, hi, 0x00030003;
and.b32 $2, lo, 0x000c000c;
and.b32 $3, hi, 0x000c000c;
and.b32 $4, lo, 0x00300030;
and.b32 $5, hi, 0x00300030;
and.b32 $6, lo, 0x00c000c0;
and.b32 $7, hi, 0x00c000c0;
}""")


@triton.jit
def _byte_planes(c, ASM: tl.constexpr):
    """uint8 codes -> four fp16 tensors, plane ``i`` holding the exact subnormal ``c_i·4^i·2⁻²⁴``."""
    if ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _BYTE_PLANES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [c],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        c16 = c.to(tl.int16)
        p0 = (c16 & 3).to(tl.float16, bitcast=True)
        p1 = (c16 & 12).to(tl.float16, bitcast=True)
        p2 = (c16 & 48).to(tl.float16, bitcast=True)
        p3 = (c16 & 192).to(tl.float16, bitcast=True)
    return p0, p1, p2, p3


@triton.jit
def _meta(words, META: tl.constexpr):
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
def _rows(b, h0, sp, total, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, HQ: tl.constexpr):
    """Rows ``(b, h0·g + r, sp)`` of the ``[B, Hq, total]`` partial-state arrays for the ``HPB·g``
    query heads of KV heads ``h0 .. h0 + HPB - 1`` (padded to ``R_PAD``), and their mask."""
    offs_r = tl.arange(0, R_PAD)
    return (b * HQ + h0 * G + offs_r).to(tl.int64) * total + sp, offs_r < HPB * G


@triton.jit
def _store_lse(LSE, row, gmask, m_i, l_i):
    """Log-sum-exp (base 2) of a split; ``-inf`` for a split that saw no token."""
    has = l_i > 0
    tl.store(LSE + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=gmask)


@triton.jit
def _split_range(INDPTR, b, k, split_size):
    """Slot-list positions ``[lo, hi)`` of split ``k`` of sequence ``b`` in one tier."""
    lo = tl.load(INDPTR + b) + k * split_size
    return lo, tl.minimum(lo + split_size, tl.load(INDPTR + b + 1))


@triton.jit
def _softmax_step(s, nmask, m_i, l_i):
    """One online-softmax step (base 2) over a ``[G_PAD, BLOCK_N]`` tile of scores: masked
    columns dropped; returns the probabilities, the rescale factor of the old state and the
    new ``(max, sum)``."""
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _inv(l_i):
    has = l_i > 0
    return tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)


@triton.jit
def _meta_rows(M, sh, nmask, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, META: tl.constexpr):
    """``(scale, zero)`` of every score ``[R_PAD, BLOCK_N]``: row ``r`` reads head ``r // G`` of the
    group. The ``HPB`` heads' words are loaded once as ``[R_PAD // G, BLOCK_N]`` (contiguous per
    slot, pipelined like the code tiles) and repeated ``G`` times; one head broadcasts a row."""
    if HPB == 1:
        w = tl.load(M + sh, mask=nmask, other=0)[None, :]
    else:
        HP: tl.constexpr = R_PAD // G
        offs_j = tl.arange(0, HP)
        w = tl.load(M + sh[None, :] + offs_j[:, None], mask=nmask[None, :] & (offs_j < HPB)[:, None], other=0)
        w = tl.reshape(tl.broadcast_to(w[:, None, :], (HP, G, w.shape[1])), (R_PAD, w.shape[1]))
    return _meta(w, META)


@triton.jit
def int2_split_bytes(Q, KC, KM, VC, VM, INDPTR, IDX, O, LSE, qk_scale, split_size, total, hg, sp, b,
                HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr):  # fmt: skip
    D4: tl.constexpr = D // 4
    h0 = hg * HPB
    lo, hi = _split_range(INDPTR, b, sp, split_size)
    row, rmask = _rows(b, h0, sp, total, G, HPB, R_PAD, HKV * G)
    offs_r = tl.arange(0, R_PAD)
    rhead = offs_r // G  # KV head of each row within the group (>= HPB on padding rows)
    offs_d = tl.arange(0, D4)
    qp = Q + (b * HKV * G + h0 * G + offs_r)[:, None] * D + offs_d[None, :]
    q0 = tl.load(qp, mask=rmask[:, None], other=0.0).to(tl.float16)
    q1 = tl.load(qp + D4, mask=rmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qp + 2 * D4, mask=rmask[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(qp + 3 * D4, mask=rmask[:, None], other=0.0).to(tl.float32)
    qsum = tl.sum(q0.to(tl.float32) + q1 + q2 + q3, 1)
    # plane i holds c·4^i: scale query quarter i by 4^-i (exact, powers of two)
    q1 = (q1 * 0.25).to(tl.float16)
    q2 = (q2 * 0.0625).to(tl.float16)
    q3 = (q3 * 0.015625).to(tl.float16)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    zacc = tl.zeros([R_PAD], tl.float32)
    a0 = tl.zeros([R_PAD, D4], tl.float32)
    a1 = tl.zeros([R_PAD, D4], tl.float32)
    a2 = tl.zeros([R_PAD, D4], tl.float32)
    a3 = tl.zeros([R_PAD, D4], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h0  # (slot, first head) row
        ks, kz = _meta_rows(KM, sh, nmask, G, HPB, R_PAD, META)
        qc = tl.zeros([R_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(HPB):
            # K codes loaded transposed, [D4, BLOCK_N], so the planes are dot operands as they are
            kc = tl.load(KC + (sh + j)[None, :] * D4 + offs_d[:, None], mask=nmask[None, :], other=0)
            k0, k1, k2, k3 = _byte_planes(kc, ASM)
            t = tl.dot(q0, k0)
            t = tl.dot(q1, k1, t)
            t = tl.dot(q2, k2, t)
            t = tl.dot(q3, k3, t)
            qc = t if HPB == 1 else tl.where(rhead[:, None] == j, t, qc)
        s = qc * ks * (qk_scale * SUBNORMAL) - qsum[:, None] * (ks * kz * qk_scale)
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if tl.max(m_new - m_i, 0) > 8.0:  # rescale only when a row's max grew by more than 2^8
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            zacc = zacc * alpha
            a0 = a0 * alpha[:, None]
            a1 = a1 * alpha[:, None]
            a2 = a2 * alpha[:, None]
            a3 = a3 * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        vs, vz = _meta_rows(VM, sh, nmask, G, HPB, R_PAD, META)
        ps = p * vs
        zacc = zacc + tl.sum(ps * vz, 1)
        pw = ps.to(tl.float16)
        for j in tl.static_range(HPB):
            vc = tl.load(VC + (sh + j)[:, None] * D4 + offs_d[None, :], mask=nmask[:, None], other=0)
            v0, v1, v2, v3 = _byte_planes(vc, ASM)
            pj = pw if HPB == 1 else tl.where(rhead[:, None] == j, pw, 0.0).to(tl.float16)
            a0 = tl.dot(pj, v0, a0)
            a1 = tl.dot(pj, v1, a1)
            a2 = tl.dot(pj, v2, a2)
            a3 = tl.dot(pj, v3, a3)
    inv = _inv(l_i)
    z = zacc * inv
    op = O + row[:, None] * D + offs_d[None, :]
    tl.store(op, a0 * (inv * SUBNORMAL)[:, None] - z[:, None], mask=rmask[:, None])
    tl.store(op + D4, a1 * (inv * SUBNORMAL / 4)[:, None] - z[:, None], mask=rmask[:, None])
    tl.store(op + 2 * D4, a2 * (inv * SUBNORMAL / 16)[:, None] - z[:, None], mask=rmask[:, None])
    tl.store(op + 3 * D4, a3 * (inv * SUBNORMAL / 64)[:, None] - z[:, None], mask=rmask[:, None])
    _store_lse(LSE, row, rmask, m_i, l_i)


@triton.jit
def hp_split(Q, K, V, INDPTR, IDX, O, LSE, qk_scale, split_size, total, h, sp, b, first,
              HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    lo, hi = _split_range(INDPTR, b, sp - first, split_size)  # this tier's splits start at ``first``
    row, gmask = _rows(b, h, sp, total, G, 1, G_PAD, HKV * G)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (b * HKV * G + h * G + tl.arange(0, G_PAD))[:, None] * D + offs_d[None, :],
                mask=gmask[:, None], other=0.0)  # fmt: skip
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h
        k = tl.load(K + sh[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0)
        p, alpha, m_i, l_i = _softmax_step(tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale, nmask, m_i, l_i)
        v = tl.load(V + sh[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    tl.store(O + row[:, None] * D + offs_d[None, :], acc * _inv(l_i)[:, None], mask=gmask[:, None])
    _store_lse(LSE, row, gmask, m_i, l_i)
