"""The 16-bit tier in the merge kernel (``CONFIG['tier_merge']``): one program per (sequence, KV head)
attends its query heads over the whole 16-bit list, writes that partial next to stage 1's INT2
partials (the last of the ``total`` per row), then merges all of them by log-sum-exp.

Launched as a programmatic dependent of stage 1 (compute capability >= 9), the 16-bit part runs
before ``griddepcontrol.wait``: its programs take the slots that stage 1's programs free at the end
of its wave, instead of holding slots at its start (``hp_first``), and only the merge waits for
stage 1. Without PDL (the interpreter, older GPUs) the launches simply run in order.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .decode_tiles import hp_split

__all__ = ["tier_merge"]


@triton.jit
def _merge_row(O, LSE, OUT, row, total, offs_d, D: tl.constexpr, S_BLOCK: tl.constexpr):
    """Log-sum-exp merge of the ``total`` partial outputs of query row ``row`` over dims ``offs_d``
    (a running maximum keeps it exact); stores the result."""
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([offs_d.shape[0]], tl.float32)
    for s0 in range(0, total, S_BLOCK):
        offs_s = s0 + tl.arange(0, S_BLOCK)
        smask = offs_s < total
        lse = tl.load(LSE + row * total + offs_s, mask=smask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_safe)
        o = tl.load(O + (row * total + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
        scale = tl.exp2(m - m_safe)
        acc = acc * scale + tl.sum(o.to(tl.float32) * w[:, None], 0)
        den = den * scale + tl.sum(w, 0)
        m = m_new
    tl.store(OUT + row * D + offs_d, (acc / tl.where(den > 0, den, 1.0)).to(OUT.dtype.element_ty))


@triton.jit(do_not_specialize=["total", "max_h"])
def tier_merge(Q, HK, HV, HPTR, HIDX, O, LSE, OUT, qk_scale, total, max_h, HKV: tl.constexpr, G: tl.constexpr,
               G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr,
               S_BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Program ``b·HKV + h``: the 16-bit tier of sequence ``b``, KV head ``h`` (``max_h`` >= its
    list's length) as partial ``total - 1`` of its ``G`` query rows, then their merge over all
    ``total`` partials (``[B·Hq, total, D]`` fp32 and ``[B·Hq, total]`` base-2 LSEs)."""
    b = tl.program_id(0) // HKV
    h = tl.program_id(0) % HKV
    hp_split(Q, HK, HV, HPTR, HIDX, O, LSE, qk_scale, max_h, total, h, total - 1, b, total - 1,
             HKV, G, G_PAD, D, BLOCK_H, STAGES)  # fmt: skip
    if PDL:  # stage 1's partials: written once its whole grid has finished
        gdc_wait()
    tl.debug_barrier()  # this program's own 16-bit partial, stored by all its threads
    offs_d = tl.arange(0, D)
    for r in tl.static_range(G):
        _merge_row(O, LSE, OUT, (b * HKV + h) * G + r, total, offs_d, D, S_BLOCK)
