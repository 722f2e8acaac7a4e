"""Opt-in INT2 word-plane tile loop without padding rows for one KV head per program (token groups).

With one KV head per program, :func:`.decode_words.int2_split_words` pads the head's ``g`` query
rows to the 16 rows of the MMA, so the whole online softmax runs on ``16 / g`` times more rows than
needed. Here each ``BLOCK_N`` tile is split into ``T = R_PAD // G`` groups of ``NT = BLOCK_N / T``
consecutive tokens, and row ``r = grp·G + h`` of the 16-row tile is query head ``h`` over the
tokens of group ``grp`` only: the score tile is ``[16, NT]`` with no padding, and each row keeps its
own running ``(max, sum)`` (the ``T`` groups of a head act like ``T`` interleaved sub-splits),
merged by log-sum-exp into one row per head at the end of the split, so the stored partial
output/LSE contract is unchanged.

The MMA count stays that of the padded loop. ``q·c``: per plane ``(i, e)`` the queries are a
block-diagonal ``[16, T·D8]`` operand (row ``(grp, h)`` holds ``q_h``'s part in column block
``grp``, zeros elsewhere; built once) and the codes a ``[T·D8, NT]`` gather whose row
``(grp, m)``, column ``n'`` is word ``m`` of token ``grp·NT + n'``. ``p·V``: ``p`` is spread to
``[16, BLOCK_N]`` (row ``(grp, h)`` keeps its ``NT`` values at columns ``grp·NT + n'``, zeros
elsewhere) and dotted with the V planes loaded as in the padded loop, into ``[16, D8]``
accumulators whose rows are ``(grp, h)``. Used only when ``CONFIG['token_groups']`` is set, for
``HPB == 1``, ``G·T == R_PAD`` and ``NT >= 16`` (``tl.dot``'s minimum). Measured slower than the padded loop on the H200 at every
Qwen3-8B shape (``benchmarks/results/decode_variants_tg.md``), hence opt-in.
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
    _rows,
    _store_lse,
)
from .decode_words import _dot8, _planes, _pv8, _qparts8, _scale8, _zeros8

__all__ = ["int2_split_groups"]

#: initial running max: finite, so that a row whose group has seen no token yet gets
#: ``exp2(-inf - m) = 0`` and a zero rescale factor instead of NaNs from ``-inf - -inf``
M_FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _spread(x, G: tl.constexpr, T: tl.constexpr):
    """``[T, NT]`` (one value per token of each group) -> ``[T·G, NT]``: row ``grp·G + h`` gets row ``grp``."""
    NT: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[:, None, :], (T, G, NT)), (T * G, NT))


@triton.jit
def _merge_heads(x, w, T: tl.constexpr, G: tl.constexpr):
    """``Σ_grp w·x`` over the ``T`` rows ``(grp, h)`` of each head: ``[T·G, D8]`` -> ``[G, D8]``."""
    return tl.sum(tl.reshape(x, (T, G, x.shape[1])) * w[:, :, None], 0)


@triton.jit
def _store_head(op, i: tl.constexpr, e: tl.constexpr, acc, inv, z, D4: tl.constexpr):
    """Output dims ``D4·i + 2m + e`` of every head from the merged accumulator of plane ``(i, e)``."""
    scale = SUBNORMAL / (4.0**i)
    tl.store(op + D4 * i + e, acc * (inv * scale)[:, None] - z[:, None])


@triton.jit
def int2_split_groups(Q, KC, KM, VC, VM, IDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                      HKV: tl.constexpr, G: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
                      BLOCK_N: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr):  # fmt: skip
    tl.static_assert(T * G == R_PAD)
    D4: tl.constexpr = D // 4
    D8: tl.constexpr = D // 8  # 16-bit code words per row: word m holds bytes 2m and 2m + 1
    NT: tl.constexpr = BLOCK_N // T  # tokens per group
    KB: tl.constexpr = T * D8  # rows of the block-diagonal operands
    h0 = hg  # one KV head per program
    offs_r = tl.arange(0, R_PAD)  # row (grp, h) = grp·G + h
    offs_k = tl.arange(0, KB)  # column (grp, m) = grp·D8 + m of the block-diagonal queries
    offs_m = tl.arange(0, D8)
    offs_t = tl.arange(0, T)
    offs_j = tl.arange(0, NT)
    # block-diagonal queries: row (grp, h) holds q_h's words m in column block grp
    qmask = (offs_k // D8)[None, :] == (offs_r // G)[:, None]
    qp = Q + (b * HKV * G + h0 * G + offs_r % G)[:, None] * D + 2 * (offs_k % D8)[None, :]
    # one block per row, so the row sums are Σq_h
    q00, q01, q10, q11, q20, q21, q30, q31, qsum = _qparts8(qp, qmask, D4)
    # p spread to [R_PAD, BLOCK_N]: row (grp, h) keeps column block grp
    psel = offs_t[None, :, None] == (offs_r // G)[:, None, None]
    m_i = tl.full([R_PAD], M_FLOOR, tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    zacc = tl.zeros([R_PAD], tl.float32)
    a00, a01, a10, a11, a20, a21, a30, a31 = _zeros8(R_PAD, D8)
    for n0 in range(lo, hi, BLOCK_N):
        # the tile's slot ids as [T, NT]: group grp holds tokens n0 + grp·NT ..
        offs_n = n0 + offs_t[:, None] * NT + offs_j[None, :]
        nmask = offs_n < hi
        sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h0
        # K code words gathered as [T·D8, NT]: row (grp, m), column n' = word m of token grp·NT + n'
        kp = tl.reshape(sh[:, None, :] * D8 + offs_m[None, :, None], (KB, NT))
        kmask = tl.reshape(tl.broadcast_to(nmask[:, None, :], (T, D8, NT)), (KB, NT))
        kc = tl.load(KC + kp, mask=kmask, other=0)
        k00, k01, k10, k11, k20, k21, k30, k31 = _planes(kc, ASM)
        qc = _dot8(
            q00, q01, q10, q11, q20, q21, q30, q31, k00, k01, k10, k11, k20, k21, k30, k31
        )  # [R_PAD, NT]: q_h · c of token grp·NT + n'
        ks, kz = _meta(_spread(tl.load(KM + sh, mask=nmask, other=0), G, T), META)
        s = qc * ks * (qk_scale * SUBNORMAL) - qsum[:, None] * (ks * kz * qk_scale)
        s = tl.where(_spread(nmask, G, T), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if _must_rescale(m_i, m_new):
            alpha, l_i, zacc = _rescale(m_i, m_new, l_i, zacc)
            a00, a01, a10, a11, a20, a21, a30, a31 = _scale8(
                a00, a01, a10, a11, a20, a21, a30, a31, alpha[:, None]
            )
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        vs, vz = _meta(_spread(tl.load(VM + sh, mask=nmask, other=0), G, T), META)
        ps = p * vs
        zacc = zacc + tl.sum(ps * vz, 1)
        pw = tl.reshape(tl.where(psel, ps.to(tl.float16)[:, None, :], 0.0), (R_PAD, BLOCK_N)).to(tl.float16)
        # V code words as in the padded loop: [BLOCK_N, D8], tokens in tile order
        vsh, vmask = tl.reshape(sh, (BLOCK_N,)), tl.reshape(nmask, (BLOCK_N,))
        vc = tl.load(VC + vsh[:, None] * D8 + offs_m[None, :], mask=vmask[:, None], other=0)
        v00, v01, v10, v11, v20, v21, v30, v31 = _planes(vc, ASM)
        a00, a01, a10, a11, a20, a21, a30, a31 = _pv8(
            pw, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31
        )
    # merge the T rows (grp, h) of each head by log-sum-exp: one row per query head
    mg = tl.reshape(m_i, (T, G))
    m_h = tl.max(mg, 0)
    w = tl.exp2(mg - m_h[None, :])  # [T, G]; 0 for a group that saw no token
    l_h = tl.sum(tl.reshape(l_i, (T, G)) * w, 0)
    inv = _inv(l_h)
    z = tl.sum(tl.reshape(zacc, (T, G)) * w, 0) * inv
    row, _ = _rows(b, h0, sp, total, G, 1, G, HKV * G)
    op = O + row[:, None] * D + 2 * offs_m[None, :]
    _store_head(op, 0, 0, _merge_heads(a00, w, T, G), inv, z, D4)
    _store_head(op, 0, 1, _merge_heads(a01, w, T, G), inv, z, D4)
    _store_head(op, 1, 0, _merge_heads(a10, w, T, G), inv, z, D4)
    _store_head(op, 1, 1, _merge_heads(a11, w, T, G), inv, z, D4)
    _store_head(op, 2, 0, _merge_heads(a20, w, T, G), inv, z, D4)
    _store_head(op, 2, 1, _merge_heads(a21, w, T, G), inv, z, D4)
    _store_head(op, 3, 0, _merge_heads(a30, w, T, G), inv, z, D4)
    _store_head(op, 3, 1, _merge_heads(a31, w, T, G), inv, z, D4)
    _store_lse(LSE, row, row >= 0, m_h, l_h)
