"""INT2 tile loop with tokens as the MMA rows ("swap AB"): one KV head per program, code words.

:mod:`.decode_words` computes ``q·c`` as ``[rows, D/8] × [D/8, tokens]`` with the ``g`` query heads
of the KV head as MMA rows, padded to 16: with Qwen3-8B's GQA 12 of the 16 rows, and so 3/4 of the
online softmax, the score scaling and the rescales, are padding. Here the product is transposed,
``S^T = planes [tokens, D/8] × q^T [D/8, g]``, and ``p·V`` is ``O^T = V-planes^T [D/8, tokens] ×
(p∘s_V) [tokens, g]``: the tokens fill the 16 MMA rows and the query heads are the MMA's N side,
which ``tl.dot`` pads to the 8-wide instruction across lanes (the padding costs no extra
instructions per thread). Every tile does half the MMAs of the padded loop and the softmax holds a
quarter of the values; the softmax now reduces over tokens (the rows), within the warp.

The planes, their ``(i, e)`` order, the query scaling by ``4^-i`` and the final ``2²⁴ / 4^i``
factors are those of :mod:`.decode_words`; the partial output / LSE contract is unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_tiles import (
    SUBNORMAL,
    _inv,
    _meta,
    _must_rescale,
    _rescale,
    _split_range,
    _store_lse,
)
from .decode_words import _dot8, _planes, _qparts8, _scale8, _store8, _zeros8

__all__ = ["int2_split_swap"]


@triton.jit
def _vp8(ps, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31):
    """``a_(i,e) += plane_(i,e)^T · (p∘s_V)`` for the eight transposed value planes ``[D/8, BLOCK_N]``."""
    return (tl.dot(v00, ps, a00), tl.dot(v01, ps, a01), tl.dot(v10, ps, a10), tl.dot(v11, ps, a11),
            tl.dot(v20, ps, a20), tl.dot(v21, ps, a21), tl.dot(v30, ps, a30), tl.dot(v31, ps, a31))  # fmt: skip


@triton.jit
def _tile(IDX, KC, KM, VC, VM, n0, hi, h, qk_scale, offs_m, q00, q01, q10, q11, q20, q21, q30, q31, qsum,
          m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31, HKV: tl.constexpr, D8: tl.constexpr,
          BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One tile of ``BLOCK_N`` slot-list positions from ``n0``: the online-softmax state and the
    eight transposed accumulators after it. ``MASKED``: positions at or past ``hi`` are dropped
    (the split's last, partial tile); otherwise the tile is whole and nothing is masked."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < hi if MASKED else tl.full([BLOCK_N], 1, tl.int1)
    sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h
    ks, kz = _meta(tl.load(KM + sh, mask=nmask, other=0), META)
    # S^T: code-word planes [BLOCK_N, D8] (tokens as MMA rows) times query parts [D8, GP]
    kc = tl.load(KC + sh[:, None] * D8 + offs_m[None, :], mask=nmask[:, None], other=0)
    k00, k01, k10, k11, k20, k21, k30, k31 = _planes(kc, ASM)
    t = _dot8(k00, k01, k10, k11, k20, k21, k30, k31, q00, q01, q10, q11, q20, q21, q30, q31)
    s = t * (ks * (qk_scale * SUBNORMAL))[:, None] - qsum[None, :] * (ks * kz * qk_scale)[:, None]
    s = tl.where(nmask[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    if _must_rescale(m_i, m_new):
        alpha, l_i, zacc = _rescale(m_i, m_new, l_i, zacc)
        a00, a01, a10, a11, a20, a21, a30, a31 = _scale8(
            a00, a01, a10, a11, a20, a21, a30, a31, alpha[None, :]
        )
        m_i = m_new
    p = tl.exp2(s - m_i[None, :])
    l_i = l_i + tl.sum(p, 0)
    vs, vz = _meta(tl.load(VM + sh, mask=nmask, other=0), META)
    ps = p * vs[:, None]
    zacc = zacc + tl.sum(ps * vz[:, None], 0)
    ps = ps.to(tl.float16)
    # O^T += value planes transposed [D8, BLOCK_N] times p∘s_V [BLOCK_N, GP]
    vc = tl.load(VC + sh[None, :] * D8 + offs_m[:, None], mask=nmask[None, :], other=0)
    v00, v01, v10, v11, v20, v21, v30, v31 = _planes(vc, ASM)
    a00, a01, a10, a11, a20, a21, a30, a31 = _vp8(
        ps, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31
    )
    return m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31


@triton.jit
def int2_split_swap(Q, KC, KM, VC, VM, INDPTR, IDX, O, LSE, qk_scale, split_size, total, h, sp, b,
                    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr, FULL_TILES: tl.constexpr):  # fmt: skip
    """Split ``sp`` of sequence ``b``'s quantized list for KV head ``h``: normalised partial output
    and LSE of its ``G`` query heads (``GP``: ``G`` rounded up to a power of two). ``FULL_TILES``:
    whole tiles unmasked, then the tail (``CONFIG['swap_full_tiles']``); otherwise every tile masked."""
    D4: tl.constexpr = D // 4
    D8: tl.constexpr = D // 8
    lo, hi = _split_range(INDPTR, b, sp, split_size)
    offs_g = tl.arange(0, GP)
    gmask = offs_g < G
    qrow = b * HKV * G + h * G + offs_g
    row = qrow.to(tl.int64) * total + sp
    offs_m = tl.arange(0, D8)
    qp = Q + qrow[None, :] * D + 2 * offs_m[:, None]
    # query parts transposed, [D8, GP]: plane (i, e) holds the dims D4·i + 2m + e
    q00, q01, q10, q11, q20, q21, q30, q31, qsum = _qparts8(qp, gmask[None, :], D4, 0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    zacc = tl.zeros([GP], tl.float32)
    a00, a01, a10, a11, a20, a21, a30, a31 = _zeros8(D8, GP)
    if FULL_TILES:
        # whole tiles without masks (no predicated loads, no -inf selects; offline sm_90 with
        # 128-token tiles: 9% fewer instructions per tile, 168 instead of 242 registers), then
        # the tail masked, in tiles of at most 64 (a 128-token masked tile needs 240 registers)
        n_full = lo + (hi - lo) // BLOCK_N * BLOCK_N
        TAIL_N: tl.constexpr = min(BLOCK_N, 64)
        for n0 in range(lo, n_full, BLOCK_N):
            m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31 = _tile(
                IDX, KC, KM, VC, VM, n0, hi, h, qk_scale, offs_m,
                q00, q01, q10, q11, q20, q21, q30, q31, qsum, m_i, l_i, zacc,
                a00, a01, a10, a11, a20, a21, a30, a31, HKV, D8, BLOCK_N, ASM, META, False,
            )  # fmt: skip
    else:
        n_full = lo
        TAIL_N: tl.constexpr = BLOCK_N
    for n0 in range(n_full, hi, TAIL_N):
        m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31 = _tile(
            IDX, KC, KM, VC, VM, n0, hi, h, qk_scale, offs_m,
            q00, q01, q10, q11, q20, q21, q30, q31, qsum, m_i, l_i, zacc,
            a00, a01, a10, a11, a20, a21, a30, a31, HKV, D8, TAIL_N, ASM, META, True,
        )  # fmt: skip
    inv = _inv(l_i)
    z = zacc * inv
    op = O + row[None, :] * D + 2 * offs_m[:, None]
    # the accumulators are transposed, [D8, GP]: per-head factors broadcast along the columns
    _store8(op, a00, a01, a10, a11, a20, a21, a30, a31, inv[None, :], z[None, :], gmask[None, :], D4)
    _store_lse(LSE, row, gmask, m_i, l_i)
