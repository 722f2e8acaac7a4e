"""The padded word-plane INT2 loop: query heads as MMA rows, codes read as int16 words (eight
planes of K = D/8 per ``tl.dot``, Triton's native 16-bit operand width, so ``p`` feeds ``p·V``
from registers). Taken only where the swap loop would take one KV head per program and this loop
can group heads, from ``swap_max_tokens`` quantized tokens: at batch 32 / 128K it measured
3.33-3.38x SDPA against 3.10-3.35x for one-head swap (``g >= 5``, head dim 256, odd head counts)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import inv_sum, rescale, store_lse
from .padded import head_rows, int2_setup, int2_tile, keep_head, must_rescale, probs, scores
from .planes import dot8, pv8, qparts8, scale8, store8, word_planes, zeros8

__all__ = ["int2_split_words"]


@triton.jit
def int2_split_words(Q, KC, KM, VC, VM, IDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                     HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr):  # fmt: skip
    """As :func:`.loop_bytes.int2_split_bytes`, over int16 code words (``KC``/``VC`` int16 views)."""
    D4: tl.constexpr = D // 4
    D8: tl.constexpr = D // 8  # 16-bit code words per row: word m holds bytes 2m and 2m + 1
    h0, row, rmask, rhead, qrow = int2_setup(b, hg, sp, total, HKV, G, HPB, R_PAD)
    offs_m = tl.arange(0, D8)
    qp = Q + qrow[:, None] * D + 2 * offs_m[None, :]
    # plane (i, e) holds c·4^i for dims D4·i + 2m + e: scale those query dims by 4^-i (exact)
    q00, q01, q10, q11, q20, q21, q30, q31, qsum = qparts8(qp, rmask[:, None], D4)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    zacc = tl.zeros([R_PAD], tl.float32)
    a00, a01, a10, a11, a20, a21, a30, a31 = zeros8(R_PAD, D8)
    for n0 in range(lo, hi, BLOCK_N):
        nmask, sh, ks, kz = int2_tile(IDX, KM, n0, hi, h0, HKV, G, HPB, R_PAD, BLOCK_N, META)
        qc = tl.zeros([R_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(HPB):
            # K code words loaded transposed, [D8, BLOCK_N], so the planes are dot operands as they are
            kc = tl.load(KC + (sh + j)[None, :] * D8 + offs_m[:, None], mask=nmask[None, :], other=0)
            k00, k01, k10, k11, k20, k21, k30, k31 = word_planes(kc, ASM)
            t = dot8(q00, q01, q10, q11, q20, q21, q30, q31, k00, k01, k10, k11, k20, k21, k30, k31)
            qc = keep_head(t, qc, rhead, j, HPB)
        s, m_new = scores(qc, qsum, ks, kz, qk_scale, nmask, m_i)
        if must_rescale(m_i, m_new):
            alpha, l_i, zacc = rescale(m_i, m_new, l_i, zacc)
            a00, a01, a10, a11, a20, a21, a30, a31 = scale8(
                a00, a01, a10, a11, a20, a21, a30, a31, alpha[:, None]
            )
            m_i = m_new
        pw, l_i, zacc = probs(s, m_i, l_i, zacc, VM, sh, nmask, G, HPB, R_PAD, META)
        for j in tl.static_range(HPB):
            vc = tl.load(VC + (sh + j)[:, None] * D8 + offs_m[None, :], mask=nmask[:, None], other=0)
            v00, v01, v10, v11, v20, v21, v30, v31 = word_planes(vc, ASM)
            pj = head_rows(pw, rhead, j, HPB)
            a00, a01, a10, a11, a20, a21, a30, a31 = pv8(
                pj, v00, v01, v10, v11, v20, v21, v30, v31, a00, a01, a10, a11, a20, a21, a30, a31
            )
    inv = inv_sum(l_i)
    z = zacc * inv
    op = O + row[:, None] * D + 2 * offs_m[None, :]
    store8(op, a00, a01, a10, a11, a20, a21, a30, a31, inv[:, None], z[:, None], rmask[:, None], D4)
    store_lse(LSE, row, rmask, m_i, l_i)
