"""INT2 tile loop of the Triton decode attention over 16-bit code words (head dims 128 and 256).

Same algebra as :func:`.decode_tiles.int2_split_bytes` (see that module), but the codes are read
as int16 words, two bytes each, and every word yields eight fp16 planes ``(i, e)``: plane ``i``
(bits ``2i, 2i + 1``) of byte ``e`` of the word, i.e. the code of dim ``D/4·i + 2m + e`` for word
``m``. The queries are split the same way, so ``q·c`` is eight ``tl.dot``s with K = D/8. Built from
16-bit elements, the dot operands have Triton's native 16-bit operand width (kWidth 2), so the
probabilities feed ``p·V`` from registers (the byte planes' kWidth 4 staged them through shared
memory) and the loop-invariant query parts are re-read by ``ldmatrix``. ``tl.dot`` needs K ≥ 16,
so head dim 64 (K = 8) keeps the byte planes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_tiles import (
    _head_rows,
    _int2_setup,
    _int2_tile,
    _inv,
    _keep_head,
    _must_rescale,
    _planes_ptx,
    _probs,
    _qpart,
    _qscale,
    _rescale,
    _scores,
    _store_lse,
    _store_part,
)

__all__ = ["int2_split_words"]

# two 16-bit code words in one register -> the eight planes ``(i, e)`` (plane ``i`` of byte ``e`` of
# each word): byte 0 of both words is already at the bottom of its 16-bit lane (``lo`` = the
# register), byte 1 is moved there (``hi``)
_PLANES_PTX = tl.constexpr(_planes_ptx(None, "0x4341"))


@triton.jit
def _planes(c, ASM: tl.constexpr):
    """int16 code words (bytes ``2m``, ``2m + 1`` of a row) -> eight fp16 tensors: plane ``(i, e)``
    holds the exact subnormal ``c·4^i·2⁻²⁴`` of the code of dim ``D/4·i + 2m + e``."""
    if ASM:
        p00, p01, p10, p11, p20, p21, p30, p31 = tl.inline_asm_elementwise(
            _PLANES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [c],
            dtype=(tl.float16,) * 8, is_pure=True, pack=2,
        )  # fmt: skip
    else:
        b0 = c & 255
        b1 = (c >> 8) & 255
        p00 = (b0 & 3).to(tl.float16, bitcast=True)
        p01 = (b1 & 3).to(tl.float16, bitcast=True)
        p10 = (b0 & 12).to(tl.float16, bitcast=True)
        p11 = (b1 & 12).to(tl.float16, bitcast=True)
        p20 = (b0 & 48).to(tl.float16, bitcast=True)
        p21 = (b1 & 48).to(tl.float16, bitcast=True)
        p30 = (b0 & 192).to(tl.float16, bitcast=True)
        p31 = (b1 & 192).to(tl.float16, bitcast=True)
    return p00, p01, p10, p11, p20, p21, p30, p31


@triton.jit
def _qparts8(qp, mask, D4: tl.constexpr, AXIS: tl.constexpr = 1):
    """The eight query parts of planes ``(i, e)`` (dims ``D4·i + 2m + e`` from ``qp``; ``mask``
    broadcasts against ``qp``) as fp16 dot operands scaled by ``4^-i`` (exact), and their sums over
    the dims' axis ``AXIS`` (``Σq`` per head, unscaled, fp32; 0 for decode_swap.py's transposed
    parts)."""
    q00 = _qpart(qp, 0, 0, mask, D4)
    q01 = _qpart(qp, 0, 1, mask, D4)
    q10 = _qpart(qp, 1, 0, mask, D4)
    q11 = _qpart(qp, 1, 1, mask, D4)
    q20 = _qpart(qp, 2, 0, mask, D4)
    q21 = _qpart(qp, 2, 1, mask, D4)
    q30 = _qpart(qp, 3, 0, mask, D4)
    q31 = _qpart(qp, 3, 1, mask, D4)
    qsum = tl.sum(q00 + q01 + q10 + q11 + q20 + q21 + q30 + q31, AXIS)
    q00, q01, q10, q11 = _qscale(q00, 0), _qscale(q01, 0), _qscale(q10, 1), _qscale(q11, 1)
    q20, q21, q30, q31 = _qscale(q20, 2), _qscale(q21, 2), _qscale(q30, 3), _qscale(q31, 3)
    return q00, q01, q10, q11, q20, q21, q30, q31, qsum


@triton.jit
def _zeros8(R_PAD: tl.constexpr, D8: tl.constexpr):
    """Eight fp32 ``[R_PAD, D8]`` accumulators, one per plane ``(i, e)``."""
    z = tl.zeros([R_PAD, D8], tl.float32)
    return z, z, z, z, z, z, z, z


@triton.jit
def _dot8(x00, x01, x10, x11, x20, x21, x30, x31, y00, y01, y10, y11, y20, y21, y30, y31):
    """``Σ_(i,e) x_(i,e) · y_(i,e)``: eight ``tl.dot``s into one fp32 score tile (queries times
    planes here, planes times queries in decode_swap.py)."""
    t = tl.dot(x00, y00)
    t = tl.dot(x01, y01, t)
    t = tl.dot(x10, y10, t)
    t = tl.dot(x11, y11, t)
    t = tl.dot(x20, y20, t)
    t = tl.dot(x21, y21, t)
    t = tl.dot(x30, y30, t)
    return tl.dot(x31, y31, t)


@triton.jit
def _scale8(a00, a01, a10, a11, a20, a21, a30, a31, al):
    """The eight accumulators times ``al`` (the rescale factors, broadcast along the heads' axis)."""
    return a00 * al, a01 * al, a10 * al, a11 * al, a20 * al, a21 * al, a30 * al, a31 * al


@triton.jit
def _pv8(p, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31):
    """``a_(i,e) += p · plane_(i,e)`` for the eight value planes."""
    return (tl.dot(p, v00, a00), tl.dot(p, v01, a01), tl.dot(p, v10, a10), tl.dot(p, v11, a11),
            tl.dot(p, v20, a20), tl.dot(p, v21, a21), tl.dot(p, v30, a30), tl.dot(p, v31, a31))  # fmt: skip


@triton.jit
def _store8(op, a00, a01, a10, a11, a20, a21, a30, a31, inv, z, mask, D4: tl.constexpr):
    """The eight planes' output dims (``decode_tiles._store_part``; ``inv``, ``z`` and ``mask``
    broadcast against the accumulators)."""
    _store_part(op, 0, 0, a00, inv, z, mask, D4)
    _store_part(op, 0, 1, a01, inv, z, mask, D4)
    _store_part(op, 1, 0, a10, inv, z, mask, D4)
    _store_part(op, 1, 1, a11, inv, z, mask, D4)
    _store_part(op, 2, 0, a20, inv, z, mask, D4)
    _store_part(op, 2, 1, a21, inv, z, mask, D4)
    _store_part(op, 3, 0, a30, inv, z, mask, D4)
    _store_part(op, 3, 1, a31, inv, z, mask, D4)


@triton.jit
def int2_split_words(Q, KC, KM, VC, VM, IDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr):  # fmt: skip
    D4: tl.constexpr = D // 4
    D8: tl.constexpr = D // 8  # 16-bit code words per row: word m holds bytes 2m and 2m + 1
    h0, row, rmask, rhead, qrow = _int2_setup(b, hg, sp, total, HKV, G, HPB, R_PAD)
    offs_m = tl.arange(0, D8)
    qp = Q + qrow[:, None] * D + 2 * offs_m[None, :]
    # plane (i, e) holds c·4^i for dims D4·i + 2m + e: scale those query dims by 4^-i (exact)
    q00, q01, q10, q11, q20, q21, q30, q31, qsum = _qparts8(qp, rmask[:, None], D4)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    zacc = tl.zeros([R_PAD], tl.float32)
    a00, a01, a10, a11, a20, a21, a30, a31 = _zeros8(R_PAD, D8)
    for n0 in range(lo, hi, BLOCK_N):
        nmask, sh, ks, kz = _int2_tile(IDX, KM, n0, hi, h0, HKV, G, HPB, R_PAD, BLOCK_N, META)
        qc = tl.zeros([R_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(HPB):
            # K code words loaded transposed, [D8, BLOCK_N], so the planes are dot operands as they are
            kc = tl.load(KC + (sh + j)[None, :] * D8 + offs_m[:, None], mask=nmask[None, :], other=0)
            k00, k01, k10, k11, k20, k21, k30, k31 = _planes(kc, ASM)
            t = _dot8(q00, q01, q10, q11, q20, q21, q30, q31, k00, k01, k10, k11, k20, k21, k30, k31)
            qc = _keep_head(t, qc, rhead, j, HPB)
        s, m_new = _scores(qc, qsum, ks, kz, qk_scale, nmask, m_i)
        if _must_rescale(m_i, m_new):
            alpha, l_i, zacc = _rescale(m_i, m_new, l_i, zacc)
            a00, a01, a10, a11, a20, a21, a30, a31 = _scale8(
                a00, a01, a10, a11, a20, a21, a30, a31, alpha[:, None]
            )
            m_i = m_new
        pw, l_i, zacc = _probs(s, m_i, l_i, zacc, VM, sh, nmask, G, HPB, R_PAD, META)
        for j in tl.static_range(HPB):
            vc = tl.load(VC + (sh + j)[:, None] * D8 + offs_m[None, :], mask=nmask[:, None], other=0)
            v00, v01, v10, v11, v20, v21, v30, v31 = _planes(vc, ASM)
            pj = _head_rows(pw, rhead, j, HPB)
            a00, a01, a10, a11, a20, a21, a30, a31 = _pv8(
                pj, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31
            )
    inv = _inv(l_i)
    z = zacc * inv
    op = O + row[:, None] * D + 2 * offs_m[None, :]
    _store8(op, a00, a01, a10, a11, a20, a21, a30, a31, inv[:, None], z[:, None], rmask[:, None], D4)
    _store_lse(LSE, row, rmask, m_i, l_i)
