"""Jit helpers of the two padded INT2 loops (:mod:`.loop_bytes`, :mod:`.loop_words`), whose MMA
rows are query heads: one KV head's ``g`` query heads padded to 16 rows, or ``HPB`` KV heads
whose ``HPB·g`` query heads fill them (``q·k`` is one dot per KV head whose rows are kept by head;
``p·V`` one dot per KV head with the other heads' rows of ``p`` zeroed). The accumulators are
rescaled only when a row's running maximum grows by more than 2⁸ (the probabilities then stay
≤ 256, well inside fp16), which skips the rescale on almost every tile."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import SUBNORMAL, meta_pair, partial_rows

__all__ = ["head_rows", "int2_setup", "int2_tile", "keep_head", "must_rescale", "probs", "scores"]


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
    return meta_pair(w, META)


@triton.jit
def int2_setup(b, hg, sp, total, HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr):
    """First KV head ``h0`` of head group ``hg``, the partial-state rows of split ``sp`` and their
    mask, each row's KV head within the group (``>= HPB`` on padding rows) and the rows' query rows."""
    h0 = hg * HPB
    row, rmask = partial_rows(b, h0, sp, total, G, HPB, R_PAD, HKV * G)
    offs_r = tl.arange(0, R_PAD)
    return h0, row, rmask, offs_r // G, b * HKV * G + h0 * G + offs_r


@triton.jit
def int2_tile(IDX, KM, n0, hi, h0, HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr,
              BLOCK_N: tl.constexpr, META: tl.constexpr):  # fmt: skip
    """Tile at slot-list position ``n0``: its mask, the ``(slot, first head)`` rows and the K metadata."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < hi
    sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h0
    ks, kz = _meta_rows(KM, sh, nmask, G, HPB, R_PAD, META)
    return nmask, sh, ks, kz


@triton.jit
def keep_head(t, qc, rhead, j: tl.constexpr, HPB: tl.constexpr):
    """Scores of KV head ``j`` (``t``, computed for every row) kept on that head's rows of ``qc``."""
    return t if HPB == 1 else tl.where(rhead[:, None] == j, t, qc)


@triton.jit
def head_rows(pw, rhead, j: tl.constexpr, HPB: tl.constexpr):
    """``p`` with the rows of the group's other KV heads zeroed, for KV head ``j``'s ``p·V``."""
    return pw if HPB == 1 else tl.where(rhead[:, None] == j, pw, 0.0).to(tl.float16)


@triton.jit
def scores(qc, qsum, ks, kz, qk_scale, nmask, m_i):
    """Scores (base 2) ``s·(q·c) − s·z·Σq`` of a tile, masked columns ``-inf``, and the new row max."""
    s = qc * ks * (qk_scale * SUBNORMAL) - qsum[:, None] * (ks * kz * qk_scale)
    s = tl.where(nmask[None, :], s, float("-inf"))
    return s, tl.maximum(m_i, tl.max(s, 1))


@triton.jit
def must_rescale(m_i, m_new):
    """Lazy rescale: only when some row's max grew by more than 2^8 (``p`` then stays <= 256)."""
    return tl.max(m_new - m_i, 0) > 8.0


@triton.jit
def probs(s, m_i, l_i, zacc, VM, sh, nmask, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr,
          META: tl.constexpr):  # fmt: skip
    """Probabilities against the (lazy) max ``m_i``; returns ``p∘s`` (V scales) as the fp16 operand of
    ``p·V`` and the updated ``(sum, Σ p∘s∘z)``."""
    p = tl.exp2(s - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    vs, vz = _meta_rows(VM, sh, nmask, G, HPB, R_PAD, META)
    ps = p * vs
    zacc = zacc + tl.sum(ps * vz, 1)
    return ps.to(tl.float16), l_i, zacc
