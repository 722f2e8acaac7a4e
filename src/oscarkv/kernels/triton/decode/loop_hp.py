"""The 16-bit tier's loop (sink + recent window, a few hundred tokens): one KV head's ``g`` query
heads padded to ``G_PAD`` rows against 16-bit K/V tiles, an exact online softmax. FP8 windows
(float8_e4m3fn pools) are widened to the queries' fp16/bf16 as loaded, which is exact."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import inv_sum, partial_rows, split_range, store_lse

__all__ = ["hp_split"]


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
def hp_split(Q, K, V, INDPTR, IDX, O, LSE, qk_scale, split_size, planned, total, h, sp, b, first,
             HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
             BLOCK_N: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """Split ``sp - first`` of sequence ``b``'s 16-bit list for KV head ``h`` (this tier's
    partial states start at index ``first``; splits planned for lists of ``planned`` tokens)."""
    lo, hi = split_range(INDPTR, b, sp - first, split_size, planned, BLOCK_N)
    row, gmask = partial_rows(b, h, sp, total, G, 1, G_PAD, HKV * G)
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
        if V.dtype.element_ty == tl.float8e4nv:  # fp8 windows: the 16-bit MMA of the queries' dtype
            v = v.to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    tl.store(O + row[:, None] * D + offs_d[None, :], acc * inv_sum(l_i)[:, None], mask=gmask[:, None])
    store_lse(LSE, row, gmask, m_i, l_i)
