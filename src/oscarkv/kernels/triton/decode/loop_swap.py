"""The swap INT2 loop (head dims 128 and 256, the default from ``small_tokens`` on): tokens as the
MMA rows, query heads as its N side.

The padded loops' MMA rows are one KV head's ``g`` query heads padded to 16: with Qwen3-8B's GQA,
3/4 of the online softmax and the rescales run on padding. Here the product is transposed,
``S^T = planes [tokens, D/8] × q^T [D/8, g]`` and ``O^T = V-planes^T [D/8, tokens] × (p∘s_V)
[tokens, g]``, so the tokens fill the 16 MMA rows.

A program takes ``HP`` KV heads whose ``HP·GP`` query heads (``GP``: ``g`` rounded up to a power of
two) fit the instruction's 8 columns (``planner.swap_heads``: two at Qwen3-8B's ``g = 4``, one at
head dim 256 and below ``swap_pair_tokens``). Their code words are adjacent in the pool, so a
tile reads ``HP·D/4`` contiguous bytes per token (a gather-only probe read 3.6-3.9 TB/s with 64-byte
rows against 3.2-3.4 with 32). The heads stay apart through block-diagonal operands: the query
parts are ``[HP·D/8, HP·GP]`` with head ``j``'s dims only in its own column block, for the same
number of MMAs as ``HP`` separate heads; in ``p·V`` only the diagonal blocks are stored.

Where a program reads at least ``int8_key_bytes`` key bytes per token the key product runs on
int8 MMAs (:func:`.planes.key_planes_i8`; batch 8 / 32K 0.0585 -> 0.0562 ms), else on fp16 word
planes. The lazy rescale's test (some score above its column's max + 2⁸) is one integer max over
the tile; the float max over the tokens, a chain of shuffles, runs only when it is true.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import SUBNORMAL, inv_sum, meta_pair, rescale, store_lse
from .planes import dot8, dot_i8, key_planes_i8, qparts8, qparts_i8, scale8, store8, vp8, word_planes, zeros8

__all__ = ["int2_split_swap", "meta_cols", "query_operands", "softmax_step"]


@triton.jit
def meta_cols(M, sh, nmask, HP: tl.constexpr, GP: tl.constexpr, META: tl.constexpr):
    """``(scale, zero)`` per score, ``[BLOCK_N, HP·GP]`` (``[BLOCK_N, 1]`` for one head, which
    broadcasts): column ``c`` is head ``c // GP`` of the program. The ``HP`` heads' words of a slot
    are adjacent: loaded once and repeated ``GP`` times."""
    if HP == 1:
        w = tl.load(M + sh, mask=nmask, other=0)[:, None]
    else:
        offs_j = tl.arange(0, HP)
        w = tl.load(M + sh[:, None] + offs_j[None, :], mask=nmask[:, None], other=0)
        w = tl.reshape(tl.broadcast_to(w[:, :, None], (w.shape[0], HP, GP)), (w.shape[0], HP * GP))
    return meta_pair(w, META)


@triton.jit
def softmax_step(t, kscale, ks, kz, zq, nmask, VM, sh, m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31,
                 HP: tl.constexpr, GP: tl.constexpr, META: tl.constexpr):  # fmt: skip
    """A tile's online-softmax step from the planes' key dot ``t [BLOCK_N, HP·GP]``: scores
    ``(t·kscale − kz·zq)·ks`` (tokens past the list masked), the lazy rescale of the state and the
    eight accumulators, and ``p∘s_V`` as the fp16 operand of the value product (the value
    metadata of slots ``sh`` read here). Returns it with the new state and accumulators."""
    s = (t * kscale - kz * zq[None, :]) * ks
    s = tl.where(nmask[:, None], s, float("-inf"))
    if tl.max((s > m_i[None, :] + 8.0).to(tl.int32)) > 0:
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha, l_i, zacc = rescale(m_i, m_new, l_i, zacc)
        a00, a01, a10, a11, a20, a21, a30, a31 = scale8(
            a00, a01, a10, a11, a20, a21, a30, a31, alpha[None, :]
        )
        m_i = m_new
    p = tl.exp2(s - m_i[None, :])
    l_i = l_i + tl.sum(p, 0)
    vs, vz = meta_cols(VM, sh, nmask, HP, GP, META)
    ps = p * vs
    zacc = zacc + tl.sum(ps * vz, 0)
    return ps.to(tl.float16), m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31


@triton.jit
def query_operands(Q, qrow, offs_c, gmask, qk_scale, HP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   KI8: tl.constexpr):  # fmt: skip
    """The key product's query operands for the ``HP·GP`` columns ``offs_c`` (query rows ``qrow``),
    block-diagonal over the program's heads: ``(q00 … q31, Σq, kscale, offs_k, offs_r, diag)``.
    ``KI8``: int8 ``hi`` / ``lo`` parts over the ``HP·D/4`` key bytes ``offs_k`` and ``kscale =
    σ·qk_scale`` per column; else fp16 parts over the ``HP·D/8`` words (``offs_k = offs_r``) and a
    scalar ``kscale``. ``offs_r``: the ``HP·D/8`` value words, ``diag`` their block-diagonal mask."""
    D4: tl.constexpr = D // 4
    D8: tl.constexpr = D // 8
    offs_r = tl.arange(0, HP * D8)  # word m of head j: row j·D8 + m
    diag = (offs_r // D8)[:, None] == (offs_c // GP)[None, :]
    if KI8:  # byte m of head j is K row j·D4 + m
        offs_k = tl.arange(0, HP * D4)
        diag_k = (offs_k // D4)[:, None] == (offs_c // GP)[None, :]
        qk = Q + qrow[None, :] * D + (offs_k % D4)[:, None]
        q00, q01, q10, q11, q20, q21, q30, q31, sig, qsum = qparts_i8(qk, diag_k & gmask[None, :], D4)
        kscale = (sig * qk_scale)[None, :]
    else:
        # query parts transposed, [HP·D8, HP·GP], block-diagonal: plane (i, e) holds dims D4·i + 2m + e
        qp = Q + qrow[None, :] * D + 2 * (offs_r % D8)[:, None]
        q00, q01, q10, q11, q20, q21, q30, q31, qsum = qparts8(qp, diag & gmask[None, :], D4, 0)
        kscale = qk_scale * SUBNORMAL
        offs_k = offs_r
    return q00, q01, q10, q11, q20, q21, q30, q31, qsum, kscale, offs_k, offs_r, diag


@triton.jit
def _tile(IDX, KC, KM, VC, VM, n0, hi, h0, kscale, offs_k, offs_r, q00, q01, q10, q11, q20, q21, q30, q31,
          zq, m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31, HKV: tl.constexpr, HP: tl.constexpr,
          GP: tl.constexpr, D8: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr,
          KI8: tl.constexpr):  # fmt: skip
    """One tile of ``BLOCK_N`` slot-list positions from ``n0`` (those at or past ``hi`` dropped):
    the online-softmax state and the eight transposed accumulators after it. Scores are
    ``(t·kscale − kz·zq)·ks`` for the planes' dot ``t`` (``zq``: ``Σq·qk_scale`` per column).
    ``KI8``: int8 key MMAs (``KC`` a byte pointer, ``offs_k`` the ``HP·D/4`` bytes of a row,
    ``q00 … q31`` the int8 ``hi`` / ``lo`` parts, ``kscale`` ``[1, HP·GP]``), else fp16 planes
    (``offs_k`` the ``HP·D/8`` words, ``kscale`` a scalar)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < hi
    sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h0
    ks, kz = meta_cols(KM, sh, nmask, HP, GP, META)
    # S^T: code planes (tokens as MMA rows) times block-diagonal query parts
    if KI8:
        kb = tl.load(KC + sh[:, None] * (2 * D8) + offs_k[None, :], mask=nmask[:, None], other=0)
        k0, k1, k2, k3 = key_planes_i8(kb, ASM)
        t = dot_i8(k0, k1, k2, k3, q00, q01, q10, q11, q20, q21, q30, q31)
    else:
        kc = tl.load(KC + sh[:, None] * D8 + offs_k[None, :], mask=nmask[:, None], other=0)
        k00, k01, k10, k11, k20, k21, k30, k31 = word_planes(kc, ASM)
        t = dot8(k00, k01, k10, k11, k20, k21, k30, k31, q00, q01, q10, q11, q20, q21, q30, q31)
    ps, m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31 = softmax_step(
        t,
        kscale,
        ks,
        kz,
        zq,
        nmask,
        VM,
        sh,
        m_i,
        l_i,
        zacc,
        a00,
        a01,
        a10,
        a11,
        a20,
        a21,
        a30,
        a31,
        HP,
        GP,
        META,
    )
    # O^T += value planes transposed [HP·D8, BLOCK_N] times p∘s_V [BLOCK_N, HP·GP]
    vc = tl.load(VC + sh[None, :] * D8 + offs_r[:, None], mask=nmask[None, :], other=0)
    v00, v01, v10, v11, v20, v21, v30, v31 = word_planes(vc, ASM)
    a00, a01, a10, a11, a20, a21, a30, a31 = vp8(
        ps, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31
    )
    return m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31


@triton.jit
def int2_split_swap(Q, KC, KM, VC, VM, IDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr, KI8: tl.constexpr):  # fmt: skip
    """Split ``sp`` of sequence ``b``'s quantized list (positions ``[lo, hi)``) for KV heads
    ``HP·hg …``: normalised partial outputs and LSEs of their ``G`` query heads each (column ``c``
    of the tile is query head ``c % GP`` of KV head ``HP·hg + c // GP``; columns with
    ``c % GP >= G`` are padding)."""
    D4: tl.constexpr = D // 4
    D8: tl.constexpr = D // 8
    h0 = hg * HP
    offs_c = tl.arange(0, HP * GP)
    gmask = offs_c % GP < G
    qrow = b * HKV * G + (h0 + offs_c // GP) * G + offs_c % GP
    row = qrow.to(tl.int64) * total + sp
    q00, q01, q10, q11, q20, q21, q30, q31, qsum, kscale, offs_k, offs_r, diag = query_operands(
        Q, qrow, offs_c, gmask, qk_scale, HP, GP, D, KI8
    )
    KK = KC.to(tl.pointer_type(tl.uint8)) if KI8 else KC
    m_i = tl.full([HP * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP * GP], tl.float32)
    zacc = tl.zeros([HP * GP], tl.float32)
    a00, a01, a10, a11, a20, a21, a30, a31 = zeros8(HP * D8, HP * GP)
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, zacc, a00, a01, a10, a11, a20, a21, a30, a31 = _tile(
            IDX, KK, KM, VC, VM, n0, hi, h0, kscale, offs_k, offs_r,
            q00, q01, q10, q11, q20, q21, q30, q31, qsum * qk_scale, m_i, l_i, zacc,
            a00, a01, a10, a11, a20, a21, a30, a31, HKV, HP, GP, D8, BLOCK_N, ASM, META, KI8,
        )  # fmt: skip
    inv = inv_sum(l_i)
    z = zacc * inv
    op = O + row[None, :] * D + 2 * (offs_r % D8)[:, None]
    # the accumulators are transposed, [HP·D8, HP·GP]: only the diagonal blocks are outputs
    store8(op, a00, a01, a10, a11, a20, a21, a30, a31, inv[None, :], z[None, :], diag & gmask[None, :], D4)
    store_lse(LSE, row, gmask, m_i, l_i)
