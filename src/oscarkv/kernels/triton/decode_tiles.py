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

__all__ = ["hp_split", "int2_split_bytes", "taper_range"]

#: 2**24: an fp16 word holding the bits ``c`` is worth ``c * 2**-24``
SUBNORMAL = tl.constexpr(16777216.0)


def _planes_ptx(lo: str | None, hi: str) -> str:
    """PTX that turns one 32-bit register of codes into eight registers of fp16-subnormal pairs:
    byte permutes (selectors ``lo``, ``hi``) spread bytes over 16-bit lanes, then one mask per
    2-bit plane (plane ``i`` keeps its bits in place, so it holds ``c·4^i``; callers scale by
    ``4^-i``). Outputs ``$2i`` / ``$2i+1`` are plane ``i`` of the ``lo`` / ``hi`` spread.
    ``lo=None``: the register as it is (bytes 0 and 2 already sit at the bottom of the 16-bit
    lanes, and the masks keep only their bits), one permute fewer."""
    ands = "".join(
        f"and.b32 ${2 * i}, lo, 0x{m:08x};\nand.b32 ${2 * i + 1}, hi, 0x{m:08x};\n"
        for i, m in enumerate((0x00030003, 0x000C000C, 0x00300030, 0x00C000C0))
    )
    spread_lo = "mov.b32 lo, $8;" if lo is None else f"prmt.b32 lo, $8, 0, {lo};"
    return f"{{\n.reg .b32 lo, hi;\n{spread_lo}\nprmt.b32 hi, $8, 0, {hi};\n{ands}}}"


# four code bytes in one register -> their four planes, bytes (0, 1) in ``lo`` and (2, 3) in ``hi``
_BYTE_PLANES_PTX = tl.constexpr(_planes_ptx("0x4140", "0x4342"))


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
def taper_range(INDPTR, b, k, split_size, n_early, split_late):
    """Slot-list positions ``[lo, hi)`` of split ``k`` of sequence ``b``: splits ``< n_early`` of
    ``split_size`` positions, the later ones of ``split_late`` (``decode_plan.taper``: the
    programs launched last start late, so they get less)."""
    late = tl.maximum(k - n_early, 0)
    lo = tl.load(INDPTR + b) + (k - late) * split_size + late * split_late
    return lo, tl.minimum(lo + tl.where(k < n_early, split_size, split_late), tl.load(INDPTR + b + 1))


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
def _int2_setup(b, hg, sp, total, HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr):
    """First KV head ``h0`` of head group ``hg``, the partial-state rows of split ``sp`` and their
    mask, each row's KV head within the group (``>= HPB`` on padding rows) and the rows' query rows."""
    h0 = hg * HPB
    row, rmask = _rows(b, h0, sp, total, G, HPB, R_PAD, HKV * G)
    offs_r = tl.arange(0, R_PAD)
    return h0, row, rmask, offs_r // G, b * HKV * G + h0 * G + offs_r


@triton.jit
def _qpart(qp, i: tl.constexpr, e: tl.constexpr, mask, D4: tl.constexpr):
    """Query dims ``D4·i + e`` onwards from ``qp`` (the dims of code plane ``i``) as fp32; ``mask``
    broadcasts against ``qp``."""
    return tl.load(qp + D4 * i + e, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _qscale(q, i: tl.constexpr):
    """Query part for code plane ``i`` (worth ``c·4^i``) as an fp16 operand: scaled by ``4^-i`` (exact)."""
    return q.to(tl.float16) if i == 0 else (q * (0.25**i)).to(tl.float16)


@triton.jit
def _int2_tile(IDX, KM, n0, hi, h0, HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, META: tl.constexpr):  # fmt: skip
    """Tile at slot-list position ``n0``: its mask, the ``(slot, first head)`` rows and the K metadata."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < hi
    sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h0
    ks, kz = _meta_rows(KM, sh, nmask, G, HPB, R_PAD, META)
    return nmask, sh, ks, kz


@triton.jit
def _keep_head(t, qc, rhead, j: tl.constexpr, HPB: tl.constexpr):
    """Scores of KV head ``j`` (``t``, computed for every row) kept on that head's rows of ``qc``."""
    return t if HPB == 1 else tl.where(rhead[:, None] == j, t, qc)


@triton.jit
def _head_rows(pw, rhead, j: tl.constexpr, HPB: tl.constexpr):
    """``p`` with the rows of the group's other KV heads zeroed, for KV head ``j``'s ``p·V``."""
    return pw if HPB == 1 else tl.where(rhead[:, None] == j, pw, 0.0).to(tl.float16)


@triton.jit
def _scores(qc, qsum, ks, kz, qk_scale, nmask, m_i):
    """Scores (base 2) ``s·(q·c) − s·z·Σq`` of a tile, masked columns ``-inf``, and the new row max."""
    s = qc * ks * (qk_scale * SUBNORMAL) - qsum[:, None] * (ks * kz * qk_scale)
    s = tl.where(nmask[None, :], s, float("-inf"))
    return s, tl.maximum(m_i, tl.max(s, 1))


@triton.jit
def _must_rescale(m_i, m_new):
    """Lazy rescale: only when some row's max grew by more than 2^8 (``p`` then stays <= 256)."""
    return tl.max(m_new - m_i, 0) > 8.0


@triton.jit
def _rescale(m_i, m_new, l_i, zacc):
    """The old state's factor ``alpha`` and the rescaled ``(sum, Σ p∘s∘z)``."""
    alpha = tl.exp2(m_i - m_new)
    return alpha, l_i * alpha, zacc * alpha


@triton.jit
def _probs(s, m_i, l_i, zacc, VM, sh, nmask, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr,
           META: tl.constexpr):  # fmt: skip
    """Probabilities against the (lazy) max ``m_i``; returns ``p∘s`` (V scales) as the fp16 operand of
    ``p·V`` and the updated ``(sum, Σ p∘s∘z)``."""
    p = tl.exp2(s - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    vs, vz = _meta_rows(VM, sh, nmask, G, HPB, R_PAD, META)
    ps = p * vs
    zacc = zacc + tl.sum(ps * vz, 1)
    return ps.to(tl.float16), l_i, zacc


@triton.jit
def _store_part(op, i: tl.constexpr, e: tl.constexpr, acc, inv, z, mask, D4: tl.constexpr):
    """Output dims ``D4·i + e`` onwards from the accumulator of code plane ``i`` (worth ``c·4^i·2⁻²⁴``);
    ``inv`` (1 / softmax sum), ``z`` (``Σ p∘s∘z``, normalised) and ``mask`` broadcast against
    ``acc`` (per row, or per column in the transposed swap loop)."""
    scale = SUBNORMAL / (4.0**i)
    tl.store(op + D4 * i + e, acc * (inv * scale) - z, mask=mask)


@triton.jit
def int2_split_bytes(Q, KC, KM, VC, VM, IDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr):  # fmt: skip
    D4: tl.constexpr = D // 4
    h0, row, rmask, rhead, qrow = _int2_setup(b, hg, sp, total, HKV, G, HPB, R_PAD)
    offs_d = tl.arange(0, D4)
    qp = Q + qrow[:, None] * D + offs_d[None, :]
    q0 = tl.load(qp, mask=rmask[:, None], other=0.0).to(tl.float16)
    q1 = _qpart(qp, 1, 0, rmask[:, None], D4)
    q2 = _qpart(qp, 2, 0, rmask[:, None], D4)
    q3 = _qpart(qp, 3, 0, rmask[:, None], D4)
    qsum = tl.sum(q0.to(tl.float32) + q1 + q2 + q3, 1)
    q1, q2, q3 = _qscale(q1, 1), _qscale(q2, 2), _qscale(q3, 3)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    zacc = tl.zeros([R_PAD], tl.float32)
    a0 = tl.zeros([R_PAD, D4], tl.float32)
    a1 = tl.zeros([R_PAD, D4], tl.float32)
    a2 = tl.zeros([R_PAD, D4], tl.float32)
    a3 = tl.zeros([R_PAD, D4], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        nmask, sh, ks, kz = _int2_tile(IDX, KM, n0, hi, h0, HKV, G, HPB, R_PAD, BLOCK_N, META)
        qc = tl.zeros([R_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(HPB):
            # K codes loaded transposed, [D4, BLOCK_N], so the planes are dot operands as they are
            kc = tl.load(KC + (sh + j)[None, :] * D4 + offs_d[:, None], mask=nmask[None, :], other=0)
            k0, k1, k2, k3 = _byte_planes(kc, ASM)
            t = tl.dot(q0, k0)
            t = tl.dot(q1, k1, t)
            t = tl.dot(q2, k2, t)
            t = tl.dot(q3, k3, t)
            qc = _keep_head(t, qc, rhead, j, HPB)
        s, m_new = _scores(qc, qsum, ks, kz, qk_scale, nmask, m_i)
        if _must_rescale(m_i, m_new):
            alpha, l_i, zacc = _rescale(m_i, m_new, l_i, zacc)
            a0 = a0 * alpha[:, None]
            a1 = a1 * alpha[:, None]
            a2 = a2 * alpha[:, None]
            a3 = a3 * alpha[:, None]
            m_i = m_new
        pw, l_i, zacc = _probs(s, m_i, l_i, zacc, VM, sh, nmask, G, HPB, R_PAD, META)
        for j in tl.static_range(HPB):
            vc = tl.load(VC + (sh + j)[:, None] * D4 + offs_d[None, :], mask=nmask[:, None], other=0)
            v0, v1, v2, v3 = _byte_planes(vc, ASM)
            pj = _head_rows(pw, rhead, j, HPB)
            a0 = tl.dot(pj, v0, a0)
            a1 = tl.dot(pj, v1, a1)
            a2 = tl.dot(pj, v2, a2)
            a3 = tl.dot(pj, v3, a3)
    inv = _inv(l_i)
    z = zacc * inv
    op = O + row[:, None] * D + offs_d[None, :]
    invr, zr, mr = inv[:, None], z[:, None], rmask[:, None]
    _store_part(op, 0, 0, a0, invr, zr, mr, D4)
    _store_part(op, 1, 0, a1, invr, zr, mr, D4)
    _store_part(op, 2, 0, a2, invr, zr, mr, D4)
    _store_part(op, 3, 0, a3, invr, zr, mr, D4)
    _store_lse(LSE, row, rmask, m_i, l_i)


@triton.jit
def hp_split(Q, K, V, INDPTR, IDX, O, LSE, qk_scale, split_size, total, h, sp, b, first,
              HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    lo, hi = _split_range(INDPTR, b, sp - first, split_size)  # this tier's splits start at ``first``
    row, gmask = _rows(b, h, sp, total, G, 1, G_PAD, HKV * G)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (b * HKV * G + h * G + tl.arange(0, G_PAD))[:, None] * D + offs_d[None, :],
                mask=gmask[:, None], other=0.0)  # fmt: skip
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h
        k = tl.load(K + sh[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0)
        p, alpha, m_i, l_i = _softmax_step(tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale, nmask, m_i, l_i)
        v = tl.load(V + sh[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    tl.store(O + row[:, None] * D + offs_d[None, :], acc * _inv(l_i)[:, None], mask=gmask[:, None])
    _store_lse(LSE, row, gmask, m_i, l_i)
