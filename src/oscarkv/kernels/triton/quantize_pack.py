"""Triton rotate-clip-quantize-pack (2-bit, one (scale, zero) per row) and its inverse.

``_quantize_pack``: program = ``BLOCK_R`` rows of ``D`` elements, each held as its four quarters.
Optional rotation by ``tl.dot`` with ``R`` (operands in the rows' dtype, fp32 accumulation, one
quarter of ``R``'s columns and 64 of its rows at a time), the exact clip threshold of the
reference (the ``⌊ratio·D⌋``-th smallest ``|x|``: peeling maxima with tie counts, or an in-register
``tl.sort`` for large drop counts; not OSCAR's bisection), min/max, scale/zero rounded to the
metadata dtype first, codes by correctly rounded division (``div_rn``, as ``torch`` divides), then
the quartered packing as shifts and ORs of the four quarters' codes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quant import RowFormat
from ...quant.quantizer import META_TORCH_DTYPES, clip_index

__all__ = ["dequantize", "quantize_pack"]

# Tuning (set by benchmarks/gpu_check.py's sweep; see its saved results)
BLOCK_R = 64
BLOCK_R_ROT = 64
NUM_WARPS = 4


@triton.jit
def _rotated_quarter(X, rows, rmask, s_xr, rbase, Q: tl.constexpr, D: tl.constexpr, D4: tl.constexpr,
                     BLOCK_R: tl.constexpr, KC: tl.constexpr):  # fmt: skip
    """Columns ``[Q·D4, (Q+1)·D4)`` of ``rows @ R`` with ``R`` at ``rbase``: fp32 accumulation,
    ``KC`` input columns at a time."""
    acc = tl.zeros([BLOCK_R, D4], tl.float32)
    offs_k = tl.arange(0, KC)
    for k0 in range(0, D, KC):
        xk = tl.load(X + rows[:, None] * s_xr + (k0 + offs_k)[None, :], mask=rmask[:, None], other=0.0)
        rk = tl.load(rbase + (k0 + offs_k)[:, None] * D + Q * D4 + tl.arange(0, D4)[None, :])
        acc += tl.dot(xk.to(rk.dtype), rk)
    return acc


@triton.jit
def _max4(a0, a1, a2, a3):
    return tl.maximum(tl.maximum(tl.max(a0, 1), tl.max(a1, 1)), tl.maximum(tl.max(a2, 1), tl.max(a3, 1)))


@triton.jit
def _min4(a0, a1, a2, a3):
    return tl.minimum(tl.minimum(tl.min(a0, 1), tl.min(a1, 1)), tl.minimum(tl.min(a2, 1), tl.min(a3, 1)))


@triton.jit
def _code(x, sf, zf):
    """Correctly rounded ``x / s`` (as torch divides), ``+ z``, round half up, clamp to [0, 3]."""
    q = tl.floor(tl.math.div_rn(x, sf[:, None]) + zf[:, None] + 0.5)
    return tl.minimum(tl.maximum(q, 0.0), 3.0).to(tl.int32)


@triton.jit
def _quantize_pack(X, R, C, M, n_rows, clip_idx, tiny, s_xr, s_rh, s_cr, s_mr,
                   D: tl.constexpr, D4: tl.constexpr, BLOCK_R: tl.constexpr, ROTATE: tl.constexpr,
                   PER_HEAD: tl.constexpr, HEADS: tl.constexpr, CLIP: tl.constexpr, KC: tl.constexpr,
                   N_DROP: tl.constexpr):  # fmt: skip
    # a row is handled as its four quarters (the quartered byte layout: byte j packs elements j,
    # j+D/4, j+D/2, j+3D/4), so packing is elementwise and row reductions stay within few lanes
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    offs = tl.arange(0, D4)
    if ROTATE:
        # rows are (token, head) pairs, head fastest; per-head R picks R[row % HEADS]
        rbase = R + (pid % HEADS) * s_rh if PER_HEAD else R  # BLOCK_R == 1 in the per-head case
        x0 = _rotated_quarter(X, rows, rmask, s_xr, rbase, 0, D, D4, BLOCK_R, KC)
        x1 = _rotated_quarter(X, rows, rmask, s_xr, rbase, 1, D, D4, BLOCK_R, KC)
        x2 = _rotated_quarter(X, rows, rmask, s_xr, rbase, 2, D, D4, BLOCK_R, KC)
        x3 = _rotated_quarter(X, rows, rmask, s_xr, rbase, 3, D, D4, BLOCK_R, KC)
    else:
        xp = X + rows[:, None] * s_xr + offs[None, :]
        x0 = tl.load(xp, mask=rmask[:, None], other=0.0).to(tl.float32)
        x1 = tl.load(xp + D4, mask=rmask[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(xp + 2 * D4, mask=rmask[:, None], other=0.0).to(tl.float32)
        x3 = tl.load(xp + 3 * D4, mask=rmask[:, None], other=0.0).to(tl.float32)
    if CLIP:
        a0, a1, a2, a3 = tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3)
        if N_DROP <= 16:
            # tau = the (N_DROP+1)-th largest |x| counting ties: peel off maxima with their counts
            rem = tl.full([BLOCK_R], N_DROP, tl.int32)
            tau = tl.zeros([BLOCK_R], tl.float32)
            done = rem < 0
            for _ in tl.static_range(N_DROP + 1):
                m = _max4(a0, a1, a2, a3)[:, None]
                h0, h1, h2, h3 = a0 == m, a1 == m, a2 == m, a3 == m
                cnt = tl.sum(h0.to(tl.int32) + h1.to(tl.int32) + h2.to(tl.int32) + h3.to(tl.int32), 1)
                take = (cnt > rem) & (~done)
                tau = tl.where(take, tl.reshape(m, [BLOCK_R]), tau)
                done = done | take
                rem = rem - cnt
                a0, a1 = tl.where(h0, -1.0, a0), tl.where(h1, -1.0, a1)
                a2, a3 = tl.where(h2, -1.0, a2), tl.where(h3, -1.0, a3)
        else:
            # the threshold does not depend on the order of a row's elements
            a = tl.reshape(tl.join(tl.join(a0, a1), tl.join(a2, a3)), [BLOCK_R, D])
            srt = tl.sort(a, 1)
            tau = tl.sum(tl.where(tl.arange(0, D)[None, :] == clip_idx, srt, 0.0), 1)
        t = tau[:, None]
        x0 = tl.minimum(tl.maximum(x0, -t), t)
        x1 = tl.minimum(tl.maximum(x1, -t), t)
        x2 = tl.minimum(tl.maximum(x2, -t), t)
        x3 = tl.minimum(tl.maximum(x3, -t), t)
    lo = _min4(x0, x1, x2, x3)
    hi = _max4(x0, x1, x2, x3)
    s = tl.math.div_rn(tl.maximum(hi - lo, 1e-8), 3.0)
    s = tl.maximum(s, tl.math.div_rn(tl.maximum(tl.abs(lo), tl.abs(hi)), 16384.0))
    s = tl.maximum(s, tiny)
    z = tl.math.div_rn(-lo, s)
    s_m = s.to(M.dtype.element_ty)
    z_m = z.to(M.dtype.element_ty)
    sf = s_m.to(tl.float32)
    zf = z_m.to(tl.float32)
    packed = (
        _code(x0, sf, zf) | (_code(x1, sf, zf) << 2) | (_code(x2, sf, zf) << 4) | (_code(x3, sf, zf) << 6)
    )
    tl.store(C + rows[:, None] * s_cr + offs[None, :], packed.to(tl.uint8), mask=rmask[:, None])
    tl.store(M + rows * s_mr, s_m, mask=rmask)
    tl.store(M + rows * s_mr + 1, z_m, mask=rmask)


@triton.jit
def _dequantize(C, M, OUT, n_rows, s_cr, s_mr, s_or, D4: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    offs = tl.arange(0, D4)
    c = tl.load(C + rows[:, None] * s_cr + offs[None, :], mask=rmask[:, None], other=0)
    s = tl.load(M + rows * s_mr, mask=rmask, other=0.0).to(tl.float32)[:, None]
    z = tl.load(M + rows * s_mr + 1, mask=rmask, other=0.0).to(tl.float32)[:, None]
    base = OUT + rows[:, None] * s_or + offs[None, :]
    ty = OUT.dtype.element_ty
    tl.store(base, (((c & 3).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])
    tl.store(base + D4, ((((c >> 2) & 3).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])
    tl.store(base + 2 * D4, ((((c >> 4) & 3).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])
    tl.store(base + 3 * D4, ((((c >> 6) & 3).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])


def _check(fmt: RowFormat) -> None:
    if (
        fmt.bits != 2
        or fmt.groups != 1
        or fmt.quantizer != "asymmetric"
        or fmt.head_dim not in (64, 128, 256)
    ):
        raise ValueError(
            "the Triton quantize_pack kernel writes 2-bit asymmetric rows with one (scale, zero) per row "
            f"and head_dim 64/128/256; got {fmt.bits}-bit, {fmt.groups} groups, {fmt.quantizer}, "
            f"d={fmt.head_dim} (use backend='torch')"
        )


def quantize_pack(rows: torch.Tensor, rotation: torch.Tensor | None, fmt: RowFormat):
    """Same contract as ``kernels.ref.quantize_pack`` (rows ``[N, H, d]`` on CUDA)."""
    _check(fmt)
    n, h, d = rows.shape
    x = rows.reshape(n * h, d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes = torch.empty(n, h, d // 4, dtype=torch.uint8, device=rows.device)
    meta = torch.empty(n, h, 1, 2, dtype=META_TORCH_DTYPES[fmt.meta_dtype], device=rows.device)
    if n * h == 0:
        return codes, meta
    per_head = rotation is not None and rotation.dim() == 3
    block_r = 1 if per_head else BLOCK_R_ROT if rotation is not None else BLOCK_R
    c = clip_index(fmt.clip, d) if fmt.clip > 0 else 0
    # the rotation GEMM runs in the rows' dtype (bf16 tensor cores for bf16 models), fp32 accumulation
    r = rotation.to(device=rows.device, dtype=rows.dtype).contiguous() if rotation is not None else x
    tiny = torch.finfo(meta.dtype).tiny
    _quantize_pack[(triton.cdiv(n * h, block_r),)](
        x, r, codes, meta, n * h, c, tiny, x.stride(0), r.stride(0) if per_head else 0, d // 4, 2,
        D=d, D4=d // 4, BLOCK_R=block_r, ROTATE=rotation is not None, PER_HEAD=per_head, HEADS=h,
        CLIP=fmt.clip > 0, KC=min(64, d), N_DROP=d - 1 - c, num_warps=NUM_WARPS if d <= 128 else 8,
    )  # fmt: skip
    return codes, meta


def dequantize(
    codes: torch.Tensor, meta: torch.Tensor, fmt: RowFormat, out_dtype: torch.dtype = torch.float32
):
    """Same contract as ``kernels.ref.dequantize``."""
    if fmt.bits != 2 or fmt.groups != 1 or fmt.quantizer == "lloyd_max_centroid":
        raise ValueError(
            "the Triton dequantize kernel reads 2-bit affine rows with one group (use backend='torch')"
        )
    n, h, p = codes.shape
    out = torch.empty(n, h, p * 4, dtype=out_dtype, device=codes.device)
    if n * h == 0:
        return out
    c, m = codes.reshape(n * h, p), meta.reshape(n * h, 2)
    block_r = 64
    _dequantize[(math.ceil(n * h / block_r),)](
        c, m, out, n * h, c.stride(0), m.stride(0), p * 4, D4=p, BLOCK_R=block_r
    )
    return out
