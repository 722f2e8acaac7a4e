"""The byte-plane INT2 loop: query heads as MMA rows, codes read as bytes (four planes of K = D/4
per ``tl.dot``). Taken at head dim 64 (word planes need K = D/8 >= 16) and below
``small_tokens`` quantized tokens, where its 4-warp programs of 128-token tiles measured
1.05-1.55x SDPA at batch 1 / 4K-16K against 0.78-1.43x for the one-warp word planes.
The only loop that reads 4-bit keys (``KEY_BITS``): two nibble planes of K = D/2; values stay
2-bit."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import inv_sum, rescale, store_lse, store_part
from .padded import head_rows, int2_setup, int2_tile, keep_head, must_rescale, probs, scores
from .planes import byte_planes, nibble_planes, qpart, qscale

__all__ = ["int2_split_bytes"]


@triton.jit
def int2_split_bytes(Q, KC, KM, VC, VM, IDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                     HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr,
                     KEY_BITS: tl.constexpr = 2):  # fmt: skip
    """Split ``sp`` of sequence ``b``'s quantized list (positions ``[lo, hi)``) for KV heads
    ``HPB·hg …``: normalised partial outputs and LSEs of their query heads. ``KEY_BITS``: 2, or 4
    (key codes ``[N, HKV, D/2]``)."""
    D4: tl.constexpr = D // 4
    h0, row, rmask, rhead, qrow = int2_setup(b, hg, sp, total, HKV, G, HPB, R_PAD)
    offs_d = tl.arange(0, D4)
    qp = Q + qrow[:, None] * D + offs_d[None, :]
    if KEY_BITS == 2:
        q0 = tl.load(qp, mask=rmask[:, None], other=0.0).to(tl.float16)
        q1 = qpart(qp, 1, 0, rmask[:, None], D4)
        q2 = qpart(qp, 2, 0, rmask[:, None], D4)
        q3 = qpart(qp, 3, 0, rmask[:, None], D4)
        qsum = tl.sum(q0.to(tl.float32) + q1 + q2 + q3, 1)
        q1, q2, q3 = qscale(q1, 1), qscale(q2, 2), qscale(q3, 3)
    else:
        D2: tl.constexpr = D // 2
        offs_k = tl.arange(0, D2)
        qk = Q + qrow[:, None] * D + offs_k[None, :]
        qa = qpart(qk, 0, 0, rmask[:, None], D2)
        qb = qpart(qk, 1, 0, rmask[:, None], D2)
        qsum = tl.sum(qa + qb, 1)
        qa, qb = qscale(qa, 0), qscale(qb, 2)  # the high nibble plane holds c·16: its dims by 1/16
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    zacc = tl.zeros([R_PAD], tl.float32)
    a0 = tl.zeros([R_PAD, D4], tl.float32)
    a1 = tl.zeros([R_PAD, D4], tl.float32)
    a2 = tl.zeros([R_PAD, D4], tl.float32)
    a3 = tl.zeros([R_PAD, D4], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        nmask, sh, ks, kz = int2_tile(IDX, KM, n0, hi, h0, HKV, G, HPB, R_PAD, BLOCK_N, META)
        qc = tl.zeros([R_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(HPB):
            if KEY_BITS == 2:
                # K codes loaded transposed, [D4, BLOCK_N], so the planes are dot operands as they are
                kc = tl.load(KC + (sh + j)[None, :] * D4 + offs_d[:, None], mask=nmask[None, :], other=0)
                k0, k1, k2, k3 = byte_planes(kc, ASM)
                t = tl.dot(q0, k0)
                t = tl.dot(q1, k1, t)
                t = tl.dot(q2, k2, t)
                t = tl.dot(q3, k3, t)
            else:
                kc = tl.load(KC + (sh + j)[None, :] * D2 + offs_k[:, None], mask=nmask[None, :], other=0)
                k0, k1 = nibble_planes(kc, ASM)
                t = tl.dot(qa, k0)
                t = tl.dot(qb, k1, t)
            qc = keep_head(t, qc, rhead, j, HPB)
        s, m_new = scores(qc, qsum, ks, kz, qk_scale, nmask, m_i)
        if must_rescale(m_i, m_new):
            alpha, l_i, zacc = rescale(m_i, m_new, l_i, zacc)
            a0 = a0 * alpha[:, None]
            a1 = a1 * alpha[:, None]
            a2 = a2 * alpha[:, None]
            a3 = a3 * alpha[:, None]
            m_i = m_new
        pw, l_i, zacc = probs(s, m_i, l_i, zacc, VM, sh, nmask, G, HPB, R_PAD, META)
        for j in tl.static_range(HPB):
            vc = tl.load(VC + (sh + j)[:, None] * D4 + offs_d[None, :], mask=nmask[:, None], other=0)
            v0, v1, v2, v3 = byte_planes(vc, ASM)
            pj = head_rows(pw, rhead, j, HPB)
            a0 = tl.dot(pj, v0, a0)
            a1 = tl.dot(pj, v1, a1)
            a2 = tl.dot(pj, v2, a2)
            a3 = tl.dot(pj, v3, a3)
    inv = inv_sum(l_i)
    z = zacc * inv
    op = O + row[:, None] * D + offs_d[None, :]
    invr, zr, mr = inv[:, None], z[:, None], rmask[:, None]
    store_part(op, 0, 0, a0, invr, zr, mr, D4)
    store_part(op, 1, 0, a1, invr, zr, mr, D4)
    store_part(op, 2, 0, a2, invr, zr, mr, D4)
    store_part(op, 3, 0, a3, invr, zr, mr, D4)
    store_lse(LSE, row, rmask, m_i, l_i)
