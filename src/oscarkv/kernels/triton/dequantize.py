"""Triton dequantize of 2- or 4-bit rows with one (scale, zero) per row: the inverse of
:mod:`.quantize_pack` in the rotated basis (the prefill path over a cached quantized prefix)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quant import RowFormat
from .launch import Launcher

__all__ = ["dequantize"]


@triton.jit
def _dequantize(C, M, OUT, n_rows, s_cr, s_mr, s_or, D4: tl.constexpr, BLOCK_R: tl.constexpr,
                BITS: tl.constexpr = 2):  # fmt: skip
    """``D4``: packed bytes per row (``D/4`` for 2 bits, ``D/2`` for 4: byte ``j`` holds dims
    ``j + D4·i`` in bits ``BITS·i`` onwards)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    offs = tl.arange(0, D4)
    c = tl.load(C + rows[:, None] * s_cr + offs[None, :], mask=rmask[:, None], other=0)
    s = tl.load(M + rows * s_mr, mask=rmask, other=0.0).to(tl.float32)[:, None]
    z = tl.load(M + rows * s_mr + 1, mask=rmask, other=0.0).to(tl.float32)[:, None]
    base = OUT + rows[:, None] * s_or + offs[None, :]
    ty = OUT.dtype.element_ty
    if BITS == 2:
        tl.store(base, (((c & 3).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])
        tl.store(base + D4, ((((c >> 2) & 3).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])
        tl.store(base + 2 * D4, ((((c >> 4) & 3).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])
        tl.store(base + 3 * D4, ((((c >> 6) & 3).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])
    else:
        tl.store(base, (((c & 15).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])
        tl.store(base + D4, (((c >> 4).to(tl.float32) - z) * s).to(ty), mask=rmask[:, None])


_DEQUANTIZE = Launcher(_dequantize)


def dequantize(
    codes: torch.Tensor, meta: torch.Tensor, fmt: RowFormat, out_dtype: torch.dtype = torch.float32
):
    """Same contract as ``kernels.ref.dequantize``."""
    if fmt.bits not in (2, 4) or fmt.groups != 1 or fmt.quantizer == "lloyd_max_centroid":
        raise ValueError(
            "the Triton dequantize kernel reads 2- or 4-bit affine rows with one group (use backend='torch')"
        )
    n, h, p = codes.shape
    out = torch.empty(n, h, p * 8 // fmt.bits, dtype=out_dtype, device=codes.device)
    if n * h == 0:
        return out
    c, m = codes.reshape(n * h, p), meta.reshape(n * h, 2)
    block_r = 64
    _DEQUANTIZE(
        (math.ceil(n * h / block_r),), c, m, out, n * h, c.stride(0), m.stride(0), p * 8 // fmt.bits, D4=p,
        BLOCK_R=block_r, BITS=fmt.bits,
    )  # fmt: skip
    return out
