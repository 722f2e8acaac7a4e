"""The two launched kernels: stage 1 (every split of both tiers, one program each) and the
log-sum-exp merge of a query row's splits.

Stage-1 program ``(head group, split, sequence)`` (the byte loop) or ``(head group, sequence,
split)`` (the word and swap loops, which launch the 16-bit splits first so that these short
programs do not trail the INT2 ones into an extra wave) takes one split of the sequence's
quantized list (partial-state index ``< n_q_splits``) or of its 16-bit list (the rest).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import taper_range
from .loop_bytes import int2_split_bytes
from .loop_hp import hp_split
from .loop_swap import int2_split_swap
from .loop_words import int2_split_words

__all__ = ["merge", "stage1"]


@triton.jit(
    do_not_specialize=["split_q", "split_h", "n_q_splits", "total", "n_early", "split_late", "max_q", "max_h"]
)
def stage1(Q, KC, KM, VC, VM, HK, HV, QPTR, QIDX, HPTR, HIDX, O, LSE, qk_scale, split_q, split_h, n_q_splits,
           total, n_early, split_late, max_q, max_h, HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr,
           G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, ASM: tl.constexpr,
           META: tl.constexpr, LOOP: tl.constexpr, HP_STAGES: tl.constexpr, PDL: tl.constexpr,
           KI8: tl.constexpr, KEY_BITS: tl.constexpr = 2):  # fmt: skip
    """``LOOP``: 0 bytes, 1 words, 2 swap (``planner.LOOPS``); ``PDL``: let the merge launch;
    ``KEY_BITS``: 2, or 4 (the byte loop only). The splits were planned for lists of ``max_q`` /
    ``max_h`` tokens (both >= 1); each list's are scaled to its own length (``common.live_split``)."""
    tl.static_assert(KEY_BITS == 2 or LOOP == 0, "4-bit keys are read by the byte loop only")
    if PDL:  # the merge may launch (and wait) once every program of this grid has started
        gdc_launch_dependents()
    # axis 0 is the group of HPB KV heads, so that programs reading the same tokens run together
    hg = tl.program_id(0)
    if LOOP != 0:  # grid (head group, sequence, split): the 16-bit tier's splits launch first
        b = tl.program_id(1)
        p = tl.program_id(2)
        n_h = total - n_q_splits
        sp = tl.where(p >= n_h, p - n_h, n_q_splits + p)  # partial-state index: INT2 splits first
    else:
        sp = tl.program_id(1)
        b = tl.program_id(2)
    if sp < n_q_splits:
        lo, hi = taper_range(QPTR, b, sp, split_q, n_early, split_late, max_q, BLOCK_N)
        if LOOP == 2:
            int2_split_swap(Q, KC, KM, VC, VM, QIDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                            HKV, G, R_PAD, HPB, D, BLOCK_N, ASM, META, KI8)  # fmt: skip
        elif LOOP == 1:
            int2_split_words(Q, KC, KM, VC, VM, QIDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                             HKV, G, HPB, R_PAD, D, BLOCK_N, ASM, META)  # fmt: skip
        else:
            int2_split_bytes(Q, KC, KM, VC, VM, QIDX, O, LSE, qk_scale, lo, hi, total, hg, sp, b,
                             HKV, G, HPB, R_PAD, D, BLOCK_N, ASM, META, KEY_BITS)  # fmt: skip
    else:
        for j in tl.static_range(HPB):  # the 16-bit tier is short (sink + recent): one head at a time
            hp_split(Q, HK, HV, HPTR, HIDX, O, LSE, qk_scale, split_h, max_h, total, hg * HPB + j, sp, b,
                     n_q_splits, HKV, G, G_PAD, D, BLOCK_H, HP_STAGES)  # fmt: skip


@triton.jit(do_not_specialize=["total"])
def merge(O, LSE, OUT, total, S_BLOCK: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, PDL: tl.constexpr):
    """Log-sum-exp merge of the ``total`` partial outputs of one ``(sequence, query head)`` row,
    dims ``DB·program_id(1)`` onwards, ``S_BLOCK`` splits at a time (a running maximum keeps it
    exact). ``PDL``: launched as a programmatic dependent of stage 1, so wait for its writes."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0)  # b * Hq + hq
    offs_d = tl.program_id(1) * DB + tl.arange(0, DB)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([DB], tl.float32)
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
