"""Triton split-K decode attention over packed INT2 history and 16-bit windows.

Stage 1 (one launch per tier): program ``(kv_head, split, sequence)`` walks ``split_size`` slots
of the sequence's CSR list in ``BLOCK_N`` tiles, with all ``g`` query heads of the KV head
together (padded to 16 rows for ``tl.dot``), an online softmax (base-2), and writes its
normalised partial output and log-sum-exp. The INT2 tile is never dequantized to a K matrix:
with codes ``c`` and per-row ``(s, z)``, ``q·k = s·(q·c) − s·z·Σq``, so ``q·c`` is four
``tl.dot``s of query quarters with the unpacked 2-bit planes, built as bf16 ``128 + c`` (fp16
``1024 + c`` for V) by OR-ing the code into the mantissa bits and subtracting the offset in 16-bit
arithmetic (exact) — no int-to-float conversions — and
``p·V = (p∘s)·c − Σ p∘s∘z`` likewise; the quartered byte layout makes each plane a contiguous
quarter of the head dimension. Stage 2 merges every split of both tiers by log-sum-exp.

Grid axis 0 is the KV head so that programs reading the same tokens' interleaved metadata run
together and share L2 sectors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quant import RowFormat

__all__ = ["decode_attention", "num_splits"]

LOG2E = 1.4426950408889634
#: tokens per program in the 16-bit tier (it holds at most sink + recent + 7 = 327 by default)
HP_SPLIT = 128


@triton.jit
def _plane(c16, shift: tl.constexpr, BF16: tl.constexpr):
    """2-bit plane ``c`` of int16 codes as exact bf16/fp16 values, built from the bits."""
    bits = ((c16 >> shift) & 3) | (0x4300 if BF16 else 0x6400)
    # subtracting the offset in 16-bit arithmetic is exact and keeps the dot free of a large
    # constant term (tensor-core accumulation lost too many bits with it)
    dt = tl.bfloat16 if BF16 else tl.float16
    return (bits.to(tl.int16).to(dt, bitcast=True) - (128.0 if BF16 else 1024.0)).to(dt)


@triton.jit
def _split(INDPTR, split_size):
    """Program ``(kv_head, split, sequence)`` -> its slot-list range ``[lo, hi)``."""
    h = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2)
    lo = tl.load(INDPTR + b) + sp * split_size
    hi = tl.minimum(lo + split_size, tl.load(INDPTR + b + 1))
    return h, sp, b, lo, hi


@triton.jit
def _store_lse(ptr, m_i, l_i, mask):
    """Log-sum-exp (base 2) of a split; ``-inf`` for a split that saw no token."""
    has = l_i > 0
    tl.store(ptr, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=mask)


@triton.jit
def _int2_stage1(Q, KC, KM, VC, VM, INDPTR, IDX, O, LSE, qk_scale, split_size, split_base,
                 s_qb, s_qh, s_kcn, s_kch, s_kmn, s_kmh, s_vcn, s_vch, s_vmn, s_vmh, s_ob, s_oh, s_os,
                 s_lb, s_lh,
                 G: tl.constexpr, G_PAD: tl.constexpr, D4: tl.constexpr, BLOCK_N: tl.constexpr,
                 KBF16: tl.constexpr):  # fmt: skip
    h, sp, b, lo, hi = _split(INDPTR, split_size)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D4)
    gmask = offs_g < G
    qp = Q + b * s_qb + (h * G + offs_g)[:, None] * s_qh + offs_d[None, :]
    q0 = tl.load(qp, mask=gmask[:, None], other=0.0)
    q1 = tl.load(qp + D4, mask=gmask[:, None], other=0.0)
    q2 = tl.load(qp + 2 * D4, mask=gmask[:, None], other=0.0)
    q3 = tl.load(qp + 3 * D4, mask=gmask[:, None], other=0.0)
    qsum = tl.sum(q0.to(tl.float32) + q1.to(tl.float32) + q2.to(tl.float32) + q3.to(tl.float32), 1)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    a0 = tl.zeros([G_PAD, D4], tl.float32)
    a1 = tl.zeros([G_PAD, D4], tl.float32)
    a2 = tl.zeros([G_PAD, D4], tl.float32)
    a3 = tl.zeros([G_PAD, D4], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        slot = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64)
        # K codes loaded transposed, [D4, BLOCK_N], so the planes are dot operands as they are
        kc = tl.load(KC + slot[None, :] * s_kcn + h * s_kch + offs_d[:, None], mask=nmask[None, :], other=0)
        ks = tl.load(KM + slot * s_kmn + h * s_kmh, mask=nmask, other=0.0).to(tl.float32)
        kz = tl.load(KM + slot * s_kmn + h * s_kmh + 1, mask=nmask, other=0.0).to(tl.float32)
        # planes straight from the bits (no int->float conversions)
        k16 = kc.to(tl.int16)
        qc = tl.dot(q0, _plane(k16, 0, KBF16))
        qc += tl.dot(q1, _plane(k16, 2, KBF16))
        qc += tl.dot(q2, _plane(k16, 4, KBF16))
        qc += tl.dot(q3, _plane(k16, 6, KBF16))
        s = (qc * ks[None, :] - qsum[:, None] * (ks * kz)[None, :]) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vc = tl.load(VC + slot[:, None] * s_vcn + h * s_vch + offs_d[None, :], mask=nmask[:, None], other=0)
        vs = tl.load(VM + slot * s_vmn + h * s_vmh, mask=nmask, other=0.0).to(tl.float32)
        vz = tl.load(VM + slot * s_vmn + h * s_vmh + 1, mask=nmask, other=0.0).to(tl.float32)
        ps = p * vs[None, :]
        pw = ps.to(tl.float16)
        pz = tl.sum(ps * vz[None, :], 1)
        v16 = vc.to(tl.int16)
        a0 = a0 * alpha[:, None] + tl.dot(pw, _plane(v16, 0, False)) - pz[:, None]
        a1 = a1 * alpha[:, None] + tl.dot(pw, _plane(v16, 2, False)) - pz[:, None]
        a2 = a2 * alpha[:, None] + tl.dot(pw, _plane(v16, 4, False)) - pz[:, None]
        a3 = a3 * alpha[:, None] + tl.dot(pw, _plane(v16, 6, False)) - pz[:, None]
        m_i = m_new
    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    op = O + b * s_ob + (h * G + offs_g)[:, None] * s_oh + (split_base + sp) * s_os + offs_d[None, :]
    tl.store(op, a0 * inv[:, None], mask=gmask[:, None])
    tl.store(op + D4, a1 * inv[:, None], mask=gmask[:, None])
    tl.store(op + 2 * D4, a2 * inv[:, None], mask=gmask[:, None])
    tl.store(op + 3 * D4, a3 * inv[:, None], mask=gmask[:, None])
    _store_lse(LSE + b * s_lb + (h * G + offs_g) * s_lh + split_base + sp, m_i, l_i, gmask)


@triton.jit
def _hp_stage1(Q, K, V, INDPTR, IDX, O, LSE, qk_scale, split_size, split_base,
               s_qb, s_qh, s_kn, s_kh, s_vn, s_vh, s_ob, s_oh, s_os, s_lb, s_lh,
               G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    h, sp, b, lo, hi = _split(INDPTR, split_size)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    q = tl.load(
        Q + b * s_qb + (h * G + offs_g)[:, None] * s_qh + offs_d[None, :], mask=gmask[:, None], other=0.0
    )
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        slot = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64)
        k = tl.load(K + slot[:, None] * s_kn + h * s_kh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * s_vn + h * s_vh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    op = O + b * s_ob + (h * G + offs_g)[:, None] * s_oh + (split_base + sp) * s_os + offs_d[None, :]
    tl.store(op, acc * inv[:, None], mask=gmask[:, None])
    _store_lse(LSE + b * s_lb + (h * G + offs_g) * s_lh + split_base + sp, m_i, l_i, gmask)


@triton.jit
def _merge(O, LSE, OUT, n_splits, s_ob, s_oh, s_os, s_lb, s_lh, s_outb, s_outh,
           S_PAD: tl.constexpr, D: tl.constexpr):  # fmt: skip
    hq = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    smask = offs_s < n_splits
    lse = tl.load(LSE + b * s_lb + hq * s_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(
        O + b * s_ob + hq * s_oh + offs_s[:, None] * s_os + offs_d[None, :], mask=smask[:, None], other=0.0
    )
    den = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(OUT + b * s_outb + hq * s_outh + offs_d, res.to(OUT.dtype.element_ty))


# Tuning (set by benchmarks/gpu_check.py's sweep; see its saved results)
CONFIG = {"block_n": 128, "num_warps": 4, "num_stages": 4, "programs": 1024, "min_split": 512}


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
    if lens_hint is None:
        lens = torch.stack(
            [(int2_indptr[1:] - int2_indptr[:-1]).max(), (hp_indptr[1:] - hp_indptr[:-1]).max()]
        )
        lens_hint = tuple(int(x) for x in lens.tolist()) if bsz else (0, 0)
    max_q, max_h = max(int(lens_hint[0]), 1), max(int(lens_hint[1]), 1)
    bn_q, bn_h = CONFIG["block_n"], 32
    sq = num_splits(bsz, hkv, max_q)
    split_q = math.ceil(max_q / sq / 256) * 256  # a multiple of every BLOCK_N the sweep tries
    sq = math.ceil(max_q / split_q)
    split_h = HP_SPLIT
    sh = math.ceil(max_h / split_h)
    total = sq + sh
    o_part = torch.empty(bsz, hq, total, d, device=q_rot.device, dtype=torch.float32)
    lse = torch.empty(bsz, hq, total, device=q_rot.device, dtype=torch.float32)
    g_pad = max(16, triton.next_power_of_2(g))
    scale = sm_scale * LOG2E
    # bf16 queries dot bf16 planes; anything else runs in fp16 (also what the CPU interpreter emulates)
    q = q_rot.contiguous() if q_rot.dtype in (torch.bfloat16, torch.float16) else q_rot.half().contiguous()
    _int2_stage1[(hkv, sq, bsz)](
        q, k_codes, k_meta, v_codes, v_meta, int2_indptr, int2_indices, o_part, lse, scale, split_q, 0,
        q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1), k_meta.stride(0), k_meta.stride(1),
        v_codes.stride(0), v_codes.stride(1), v_meta.stride(0), v_meta.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        G=g, G_PAD=g_pad, D4=d // 4, BLOCK_N=bn_q, KBF16=q.dtype == torch.bfloat16, num_warps=CONFIG["num_warps"],
        num_stages=CONFIG["num_stages"],
    )  # fmt: skip
    _hp_stage1[(hkv, sh, bsz)](
        q, hp_k, hp_v, hp_indptr, hp_indices, o_part, lse, scale, split_h, sq,
        q.stride(0), q.stride(1), hp_k.stride(0), hp_k.stride(1), hp_v.stride(0), hp_v.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        G=g, G_PAD=g_pad, D=d, BLOCK_N=bn_h, num_warps=4, num_stages=2,
    )  # fmt: skip
    out = torch.empty_like(q_rot)
    _merge[(hq, bsz)](
        o_part, lse, out, total, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), S_PAD=max(2, triton.next_power_of_2(total)), D=d,
    )  # fmt: skip
    return out
