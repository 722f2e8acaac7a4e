"""Triton twin of ``kernels.ref.rotate_heads``: a decode step's rotations in one launch each.

Program ``(head, batch block)`` loads ``BLOCK_B`` rows of one head, multiplies them by the head's
fp32 matrix with an IEEE fp32 ``tl.dot`` (no TF32: R·Rᵀ must stay I to fp32 rounding), in column
blocks of ``BLOCK_C`` (R of d=256 is 256 KB), rounds once to the output dtype and stores the rows
densely or to their slots ``dst[b]`` (skipping negative ones). Replaces the 3-4 PyTorch ops per
rotation (upcast, matmul, downcast, scatter) whose launches dominated an eager decode step's host
time (benchmarks/results/profile_e2e.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ref.rotate import check_rotate_args
from .launch import Launcher

__all__ = ["rotate_heads"]

BLOCK_B = 16  # tl.dot needs M >= 16; smaller batches are masked
BLOCK_C = 64


@triton.jit
def _rotate(X, R, Y, DST, n_b, s_xb, s_xh, s_rh, s_yb, s_yh, D: tl.constexpr, GROUP: tl.constexpr,
            ROTATE: tl.constexpr, INVERSE: tl.constexpr, SCATTER: tl.constexpr, BLOCK_B: tl.constexpr,
            BLOCK_C: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = offs_b < n_b
    offs_d = tl.arange(0, D)
    x = tl.load(X + offs_b[:, None] * s_xb + h * s_xh + offs_d[None, :], mask=bmask[:, None], other=0.0)
    if SCATTER:
        rows = tl.load(DST + offs_b, mask=bmask, other=-1).to(tl.int64)
        keep = bmask & (rows >= 0)
    else:
        rows = offs_b.to(tl.int64)
        keep = bmask
    yp = Y + rows[:, None] * s_yb + h * s_yh
    if ROTATE:
        x = x.to(tl.float32)
        rh = R + (h // GROUP) * s_rh
        offs_c = tl.arange(0, BLOCK_C)
        for c0 in tl.static_range(0, D, BLOCK_C):
            if INVERSE:  # (Rᵀ)[k, c] = R[c, k]
                m = tl.load(rh + (c0 + offs_c)[None, :] * D + offs_d[:, None])
            else:
                m = tl.load(rh + offs_d[:, None] * D + (c0 + offs_c)[None, :])
            y = tl.dot(x, m, input_precision="ieee")
            tl.store(yp + (c0 + offs_c)[None, :], y.to(Y.dtype.element_ty), mask=keep[:, None])
    else:
        tl.store(yp + offs_d[None, :], x.to(Y.dtype.element_ty), mask=keep[:, None])


_ROTATE = Launcher(_rotate)


def rotate_heads(
    x: torch.Tensor,
    r: torch.Tensor | None,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    dst: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.ref.rotate_heads`` (tensors on one CUDA device)."""
    check_rotate_args(x, r, out, dst)
    b, h, d = x.shape
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"the Triton rotate_heads kernel takes head dims 16-256, powers of two; got {d}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    scatter = out is not None
    y = out if out is not None else torch.empty_like(x)
    if y.stride(-1) != 1:
        raise ValueError("rotate_heads: out must have unit stride in its last dim")
    if b == 0:
        return y
    group, s_rh = 1, 0
    if r is not None:
        r = r.contiguous()
        if r.dim() == 3:
            group, s_rh = h // r.shape[0], d * d
    _ROTATE(
        (h, triton.cdiv(b, BLOCK_B)), x, r if r is not None else x, y, dst if scatter else x, b, x.stride(0),
        x.stride(1), s_rh, y.stride(0), y.stride(1), D=d, GROUP=group, ROTATE=r is not None, INVERSE=inverse,
        SCATTER=scatter, BLOCK_B=BLOCK_B, BLOCK_C=min(d, BLOCK_C), num_warps=4,
    )  # fmt: skip
    return y
