"""Triton split-K decode attention over packed INT2 history and 16-bit windows.

One stage-1 launch covers both tiers: program ``(head group, split, sequence)`` takes a split of
the sequence's quantized slot list (``split < n_q_splits``) or of its 16-bit list (the rest), walks
it in ``BLOCK_N`` tiles with an online softmax (base 2), and writes a normalised partial output and
its log-sum-exp. Stage 2 merges every split of both tiers by log-sum-exp.

An INT2 program takes ``HPB`` KV heads at once, so that their ``HPB·g`` query heads fill the 16
rows of the MMA (4 KV heads × 4 query heads for Qwen3-8B) instead of padding one KV head's ``g``
rows to 16: the softmax and the score scaling run on 16 useful rows, a slot's ``HPB`` value rows
are one contiguous read, and the number of tensor-core instructions is unchanged (``q·k`` is one
dot per KV head whose rows are selected by head; ``p·V`` is one dot against the ``HPB`` heads'
values side by side, whose diagonal blocks are taken once after the loop). The accumulators are
rescaled only when a row's running maximum grows by more than 2⁸ (the probabilities then stay
≤ 256, well inside fp16), which skips the rescale on almost every tile.

The INT2 tile is never dequantized. With codes ``c`` and per-row ``(s, z)``:
``q·k = s·(q·c) − s·z·Σq`` and ``p·V = (p∘s)·c − Σ p∘s∘z``, so ``q·c`` and ``(p∘s)·c`` are four
``tl.dot``s of fp16 operands with the 2-bit *planes* of the codes (the quartered byte layout makes
plane ``i`` the contiguous quarter ``i`` of the head dimension). A plane is built by masking the
code bits in place into the low mantissa bits of an fp16 word: its value is the exact subnormal
``c·4^i·2⁻²⁴``, so building it needs no shift, no int-to-float conversion and no offset
subtraction; query quarter ``i`` is pre-scaled by ``4^-i`` (exact) and the ``2²⁴`` and ``4^-i`` of
the value planes are folded into the final scaling. On CUDA one PTX block builds the four planes
of four bytes at once (two byte permutes, then one mask per plane and pair of codes); the CPU
interpreter, which cannot run PTX, builds the same bit patterns with Triton integer ops.

Strides are derived from the (validated) contiguous layouts, which keeps the launch short.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quant import RowFormat

__all__ = ["decode_attention", "heads_per_program", "num_splits"]

LOG2E = 1.4426950408889634
#: 2**24: an fp16 word holding the bits ``c`` is worth ``c * 2**-24``
SUBNORMAL = tl.constexpr(16777216.0)

# four code bytes in one register -> the four 2-bit planes as pairs of fp16 subnormals: two byte
# permutes spread the bytes over 16-bit lanes, then one mask per plane and pair of codes (plane
# ``i`` keeps its bits in place, so it holds ``c·4^i``; the caller scales by ``4^-i``)
_PLANES_PTX = tl.constexpr("""{
.reg .b32 lo, hi;
prmt.b32 lo, $8, 0, 0x4140;
prmt.b32 hi, $8, 0, 0x4342;
and.b32 $0, lo, 0x00030003;
and.b32 $1, hi, 0x00030003;
and.b32 $2, lo, 0x000c000c;
and.b32 $3, hi, 0x000c000c;
and.b32 $4, lo, 0x00300030;
and.b32 $5, hi, 0x00300030;
and.b32 $6, lo, 0x00c000c0;
and.b32 $7, hi, 0x00c000c0;
}""")


@triton.jit
def _planes(c, ASM: tl.constexpr):
    """uint8 codes -> four fp16 tensors, plane ``i`` holding the exact subnormal ``c_i·4^i·2⁻²⁴``."""
    if ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _PLANES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [c],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        c16 = c.to(tl.int16)
        p0 = (c16 & 3).to(tl.float16, bitcast=True)
        p1 = (c16 & 12).to(tl.float16, bitcast=True)
        p2 = (c16 & 48).to(tl.float16, bitcast=True)
        p3 = (c16 & 192).to(tl.float16, bitcast=True)
    return p0, p1, p2, p3


@triton.jit
def _meta(words, META: tl.constexpr):
    """``(scale, zero)`` as fp32 from one word per row: int32 for 16-bit metadata (``META`` 0 =
    fp16, 1 = bf16), int64 for fp32 (2). One 4/8-byte load per row instead of two 2/4-byte ones
    lets Triton pipeline it with ``cp.async`` like the code tiles."""
    if META == 2:
        s = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        z = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        dt: tl.constexpr = tl.float16 if META == 0 else tl.bfloat16
        s = (words & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
        z = (words >> 16).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
    return s, z


@triton.jit
def _rows(b, h0, sp, total, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, HQ: tl.constexpr):
    """Rows ``(b, h0·g + r, sp)`` of the ``[B, Hq, total]`` partial-state arrays for the ``HPB·g``
    query heads of KV heads ``h0 .. h0 + HPB - 1`` (padded to ``R_PAD``), and their mask."""
    offs_r = tl.arange(0, R_PAD)
    return (b * HQ + h0 * G + offs_r).to(tl.int64) * total + sp, offs_r < HPB * G


@triton.jit
def _store_lse(LSE, row, gmask, m_i, l_i):
    """Log-sum-exp (base 2) of a split; ``-inf`` for a split that saw no token."""
    has = l_i > 0
    tl.store(LSE + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=gmask)


@triton.jit
def _split_range(INDPTR, b, k, split_size):
    """Slot-list positions ``[lo, hi)`` of split ``k`` of sequence ``b`` in one tier."""
    lo = tl.load(INDPTR + b) + k * split_size
    return lo, tl.minimum(lo + split_size, tl.load(INDPTR + b + 1))


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
def _inv(l_i):
    has = l_i > 0
    return tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)


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
    return _meta(w, META)


@triton.jit
def _int2_split(Q, KC, KM, VC, VM, INDPTR, IDX, O, LSE, qk_scale, split_size, total, hg, sp, b,
                HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, ASM: tl.constexpr, META: tl.constexpr):  # fmt: skip
    D4: tl.constexpr = D // 4
    h0 = hg * HPB
    lo, hi = _split_range(INDPTR, b, sp, split_size)
    row, rmask = _rows(b, h0, sp, total, G, HPB, R_PAD, HKV * G)
    offs_r = tl.arange(0, R_PAD)
    rhead = offs_r // G  # KV head of each row within the group (>= HPB on padding rows)
    offs_d = tl.arange(0, D4)
    qp = Q + (b * HKV * G + h0 * G + offs_r)[:, None] * D + offs_d[None, :]
    q0 = tl.load(qp, mask=rmask[:, None], other=0.0).to(tl.float16)
    q1 = tl.load(qp + D4, mask=rmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qp + 2 * D4, mask=rmask[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(qp + 3 * D4, mask=rmask[:, None], other=0.0).to(tl.float32)
    qsum = tl.sum(q0.to(tl.float32) + q1 + q2 + q3, 1)
    # plane i holds c·4^i: scale query quarter i by 4^-i (exact, powers of two)
    q1 = (q1 * 0.25).to(tl.float16)
    q2 = (q2 * 0.0625).to(tl.float16)
    q3 = (q3 * 0.015625).to(tl.float16)
    m_i = tl.full([R_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([R_PAD], tl.float32)
    zacc = tl.zeros([R_PAD], tl.float32)
    a0 = tl.zeros([R_PAD, D4], tl.float32)
    a1 = tl.zeros([R_PAD, D4], tl.float32)
    a2 = tl.zeros([R_PAD, D4], tl.float32)
    a3 = tl.zeros([R_PAD, D4], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h0  # (slot, first head) row
        ks, kz = _meta_rows(KM, sh, nmask, G, HPB, R_PAD, META)
        qc = tl.zeros([R_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(HPB):
            # K codes loaded transposed, [D4, BLOCK_N], so the planes are dot operands as they are
            kc = tl.load(KC + (sh + j)[None, :] * D4 + offs_d[:, None], mask=nmask[None, :], other=0)
            k0, k1, k2, k3 = _planes(kc, ASM)
            t = tl.dot(q0, k0)
            t = tl.dot(q1, k1, t)
            t = tl.dot(q2, k2, t)
            t = tl.dot(q3, k3, t)
            qc = t if HPB == 1 else tl.where(rhead[:, None] == j, t, qc)
        s = qc * ks * (qk_scale * SUBNORMAL) - qsum[:, None] * (ks * kz * qk_scale)
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if tl.max(m_new - m_i, 0) > 8.0:  # rescale only when a row's max grew by more than 2^8
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            zacc = zacc * alpha
            a0 = a0 * alpha[:, None]
            a1 = a1 * alpha[:, None]
            a2 = a2 * alpha[:, None]
            a3 = a3 * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        vs, vz = _meta_rows(VM, sh, nmask, G, HPB, R_PAD, META)
        ps = p * vs
        zacc = zacc + tl.sum(ps * vz, 1)
        pw = ps.to(tl.float16)
        for j in tl.static_range(HPB):
            vc = tl.load(VC + (sh + j)[:, None] * D4 + offs_d[None, :], mask=nmask[:, None], other=0)
            v0, v1, v2, v3 = _planes(vc, ASM)
            pj = pw if HPB == 1 else tl.where(rhead[:, None] == j, pw, 0.0).to(tl.float16)
            a0 = tl.dot(pj, v0, a0)
            a1 = tl.dot(pj, v1, a1)
            a2 = tl.dot(pj, v2, a2)
            a3 = tl.dot(pj, v3, a3)
    inv = _inv(l_i)
    z = zacc * inv
    op = O + row[:, None] * D + offs_d[None, :]
    tl.store(op, a0 * (inv * SUBNORMAL)[:, None] - z[:, None], mask=rmask[:, None])
    tl.store(op + D4, a1 * (inv * SUBNORMAL / 4)[:, None] - z[:, None], mask=rmask[:, None])
    tl.store(op + 2 * D4, a2 * (inv * SUBNORMAL / 16)[:, None] - z[:, None], mask=rmask[:, None])
    tl.store(op + 3 * D4, a3 * (inv * SUBNORMAL / 64)[:, None] - z[:, None], mask=rmask[:, None])
    _store_lse(LSE, row, rmask, m_i, l_i)


@triton.jit
def _hp_split(Q, K, V, INDPTR, IDX, O, LSE, qk_scale, split_size, total, h, sp, b, first,
              HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    lo, hi = _split_range(INDPTR, b, sp - first, split_size)  # this tier's splits start at ``first``
    row, gmask = _rows(b, h, sp, total, G, 1, G_PAD, HKV * G)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (b * HKV * G + h * G + tl.arange(0, G_PAD))[:, None] * D + offs_d[None, :],
                mask=gmask[:, None], other=0.0)  # fmt: skip
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        sh = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) * HKV + h
        k = tl.load(K + sh[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0)
        p, alpha, m_i, l_i = _softmax_step(tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale, nmask, m_i, l_i)
        v = tl.load(V + sh[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    tl.store(O + row[:, None] * D + offs_d[None, :], acc * _inv(l_i)[:, None], mask=gmask[:, None])
    _store_lse(LSE, row, gmask, m_i, l_i)


@triton.jit(do_not_specialize=["split_q", "split_h", "n_q_splits", "total"])
def _stage1(Q, KC, KM, VC, VM, HK, HV, QPTR, QIDX, HPTR, HIDX, O, LSE, qk_scale, split_q, split_h,
            n_q_splits, total, HKV: tl.constexpr, G: tl.constexpr, HPB: tl.constexpr, R_PAD: tl.constexpr,
            G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
            ASM: tl.constexpr, META: tl.constexpr):  # fmt: skip
    # axis 0 is the group of HPB KV heads, so that programs reading the same tokens run together
    hg = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2)
    if sp < n_q_splits:
        _int2_split(Q, KC, KM, VC, VM, QPTR, QIDX, O, LSE, qk_scale, split_q, total, hg, sp, b,
                    HKV, G, HPB, R_PAD, D, BLOCK_N, ASM, META)  # fmt: skip
    else:
        for j in tl.static_range(HPB):  # the 16-bit tier is short (sink + recent): one head at a time
            _hp_split(Q, HK, HV, HPTR, HIDX, O, LSE, qk_scale, split_h, total, hg * HPB + j, sp, b,
                      n_q_splits, HKV, G, G_PAD, D, BLOCK_H)  # fmt: skip


@triton.jit(do_not_specialize=["total"])
def _merge(O, LSE, OUT, total, S_BLOCK: tl.constexpr, D: tl.constexpr):
    """Log-sum-exp merge of the ``total`` partial outputs of one ``(sequence, query head)`` row,
    ``S_BLOCK`` splits at a time (a running maximum keeps it exact)."""
    row = tl.program_id(0)  # b * Hq + hq
    offs_d = tl.arange(0, D)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, total, S_BLOCK):
        offs_s = s0 + tl.arange(0, S_BLOCK)
        smask = offs_s < total
        lse = tl.load(LSE + row * total + offs_s, mask=smask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_safe)
        o = tl.load(O + (row * total + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
        scale = tl.exp2(m - m_safe)
        acc = acc * scale + tl.sum(o * w[:, None], 0)
        den = den * scale + tl.sum(w, 0)
        m = m_new
    tl.store(OUT + row * D + offs_d, (acc / tl.where(den > 0, den, 1.0)).to(OUT.dtype.element_ty))


# Tuning (set by benchmarks/gpu_check.py's sweep; see its saved results)
CONFIG = {
    "block_n": 128,
    "num_warps": 4,
    "num_stages": 3,
    "programs": 1024,
    "min_split": 256,
    "rows": 16,
    "group_tokens": 262144,
}
#: 16-bit tier: tokens per split and per tile (it holds at most sink + recent + 7 = 327 by default)
HP_SPLIT, HP_BLOCK = 128, 32


def heads_per_program(g: int, kv_heads: int, tokens: int | None = None) -> int:
    """KV heads one INT2 program takes together: enough for ``CONFIG['rows']`` query rows (the MMA
    height), at most 8, and a divisor of ``kv_heads``. 1 when ``g`` is not a power of two, or when
    the batch holds fewer than ``CONFIG['group_tokens']`` quantized tokens (``tokens``): small
    batches need the programs of every head to fill the GPU (measured on the H200: grouping wins
    from batch × length ≈ 256K tokens, loses below)."""
    if g & (g - 1) or (tokens is not None and tokens < CONFIG["group_tokens"]):
        return 1
    hpb = max(1, min(8, kv_heads, CONFIG["rows"] // g))
    while kv_heads % hpb:
        hpb -= 1
    return hpb


def num_splits(batch: int, kv_heads: int, max_len: int) -> int:
    """Splits per sequence: about ``CONFIG['programs']`` programs in flight (latency hiding for
    the gathered loads), each split at least ``CONFIG['min_split']`` tokens."""
    if max_len <= 0:
        return 1
    want = max(1, CONFIG["programs"] // max(1, batch * kv_heads))
    return max(1, min(want, math.ceil(max_len / CONFIG["min_split"])))


def _check(fmt: RowFormat) -> None:
    if fmt.bits != 2 or fmt.groups != 1 or fmt.quantizer not in ("asymmetric", "symmetric", "lloyd_max"):
        raise ValueError(
            f"the Triton decode kernel reads 2-bit affine rows with one (scale, zero) per row; got "
            f"{fmt.bits}-bit, {fmt.groups} groups, {fmt.quantizer} (use backend='torch')"
        )


# metadata dtype -> (the word one (scale, zero) pair is read as, the kernel's META id)
_META_WORDS = {
    torch.float16: (torch.int32, 0),
    torch.bfloat16: (torch.int32, 1),
    torch.float32: (torch.int64, 2),
}


def _check_layout(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(
                f"decode_attention: {name} must be contiguous (shape {tuple(t.shape)}, stride "
                f"{t.stride()}); the kernel derives its strides from the pool layout"
            )


def decode_attention(q_rot, k_codes, k_meta, v_codes, v_meta, hp_k, hp_v, int2_indptr, int2_indices,
                     hp_indptr, hp_indices, sm_scale, k_fmt, v_fmt, lens_hint=None):  # fmt: skip
    """Same contract as ``kernels.ref.decode_attention``. ``lens_hint``: optional host-side
    ``(longest quantized list, longest 16-bit list)``, which saves a device sync."""
    _check(k_fmt), _check(v_fmt)
    bsz, hq, d = q_rot.shape
    hkv = hp_k.shape[1]
    g = hq // hkv
    if d % 64 or d > 256 or hq % hkv:
        raise ValueError(f"head_dim must be 64, 128 or 256 and Hq a multiple of Hkv; got d={d}, {hq}/{hkv}")
    _check_layout(k_codes=k_codes, k_meta=k_meta, v_codes=v_codes, v_meta=v_meta, hp_k=hp_k, hp_v=hp_v)
    if k_meta.dtype != v_meta.dtype or k_meta.dtype not in _META_WORDS or k_meta.shape[-2:] != (1, 2):
        raise ValueError(
            f"decode_attention: k_meta/v_meta must both be [N, Hkv, 1, 2] fp16/bf16/fp32 (one scale/zero "
            f"pair per row, as quantize_pack writes); got {k_meta.dtype} {tuple(k_meta.shape)} and "
            f"{v_meta.dtype} {tuple(v_meta.shape)} (use backend='torch' for grouped formats)"
        )
    if lens_hint is None:
        lens = torch.stack(
            [(int2_indptr[1:] - int2_indptr[:-1]).max(), (hp_indptr[1:] - hp_indptr[:-1]).max()]
        )
        lens_hint = tuple(int(x) for x in lens.tolist()) if bsz else (0, 0)
    max_q, max_h = max(int(lens_hint[0]), 1), max(int(lens_hint[1]), 1)
    hpb = heads_per_program(g, hkv, bsz * max_q)
    sq = num_splits(bsz, hkv // hpb, max_q)
    split_q = math.ceil(max_q / sq / 256) * 256  # a multiple of every BLOCK_N the sweep tries
    sq = math.ceil(max_q / split_q)
    sh = math.ceil(max_h / HP_SPLIT)
    total = sq + sh
    o_part = torch.empty(bsz, hq, total, d, device=q_rot.device, dtype=torch.float32)
    lse = torch.empty(bsz, hq, total, device=q_rot.device, dtype=torch.float32)
    # 16-bit queries: the model's bf16/fp16 as they are; anything else (fp32 on the CPU) as fp16
    q = q_rot.contiguous() if q_rot.dtype in (torch.bfloat16, torch.float16) else q_rot.half().contiguous()
    word, meta_id = _META_WORDS[k_meta.dtype]
    _stage1[(hkv // hpb, total, bsz)](
        q, k_codes, k_meta.view(word), v_codes, v_meta.view(word), hp_k, hp_v, int2_indptr, int2_indices, hp_indptr, hp_indices,
        o_part, lse, sm_scale * LOG2E, split_q, HP_SPLIT, sq, total,
        HKV=hkv, G=g, HPB=hpb, R_PAD=max(16, triton.next_power_of_2(hpb * g)), G_PAD=max(16, triton.next_power_of_2(g)),
        D=d, BLOCK_N=CONFIG["block_n"],
        BLOCK_H=HP_BLOCK, ASM=q.is_cuda, META=meta_id, num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"],
    )  # fmt: skip
    out = torch.empty_like(q_rot)
    _merge[(bsz * hq,)](o_part, lse, out, total, S_BLOCK=min(64, max(2, triton.next_power_of_2(total))), D=d)
    return out
