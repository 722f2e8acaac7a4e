"""Triton twins of ``kernels.ref.rms_norm`` / ``silu_and_mul``: one launch per norm or activation.

The eager ops launch 5-8 kernels each (upcast, square, mean, rsqrt, scale, downcast, weight, plus
the residual add); these do the same arithmetic with the same rounding points in one pass over
the rows: the residual add rounded to the model dtype, fp32 statistics, the normalized row rounded
to the model dtype before the weight, the SiLU gate rounded before the ``up`` product. Results
differ from the twins only by fp32 summation order and ``exp``/``rsqrt`` rounding (at most one
step of the output dtype); the new residual is bit-exact.

RMSNorm: program ``i`` normalizes ``BLOCK_R`` rows of a ``[A, B, N]`` view (``A·B`` rows, strides
``s_a``, ``s_b``, unit stride in ``N``), so per-head q/k norms read the heads straight out of the
fused ``qkv`` projection; rows longer than ``MAX_BLOCK`` take two passes (statistics, then scale).
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

from .launch import Launcher

__all__ = ["MAX_BLOCK", "rms_norm", "silu_and_mul"]

MAX_BLOCK = 16384  # longest row normalized from registers in one pass (32 fp32 per thread at 16 warps)
ROW_ELEMS = 2048  # short rows (per-head norms) are packed into programs of about this many elements
SILU_BLOCK = 1024


@triton.jit
def _load_sum(xp, rp, rop, cols, mask, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr):
    """The (residual-added) rows at ``cols`` in the model dtype, stored to ``rop`` if asked."""
    x = tl.load(xp + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(rp + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if STORE_RES:
            tl.store(rop + cols[None, :], x, mask=mask)
    return x


@triton.jit
def _rms_norm(X, RES, W, Y, RES_OUT, n_rows, B, s_xa, s_xb, s_ra, s_rb, eps, N: tl.constexpr,
              HAS_RES: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    rows = rows.to(tl.int64)
    a, b = rows // B, rows % B
    xp = X + (a * s_xa + b * s_xb)[:, None]
    rp = RES + (a * s_ra + b * s_rb)[:, None]
    yp = Y + (rows * N)[:, None]
    rop = RES_OUT + (rows * N)[:, None]
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        mask = rmask[:, None] & (cols < N)[None, :]
        x = _load_sum(xp, rp, rop, cols, mask, HAS_RES, True)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        xn = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
        tl.store(yp + cols[None, :], (xn * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            xf = _load_sum(xp, rp, rop, c, rmask[:, None] & (c < N)[None, :], HAS_RES, True).to(tl.float32)
            acc += xf * xf
        rstd = tl.math.rsqrt(tl.sum(acc, axis=1) / N + eps)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            mask = rmask[:, None] & (c < N)[None, :]
            x = _load_sum(xp, rp, rop, c, mask, HAS_RES, False)  # recomputed: no read-after-write
            w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
            xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            tl.store(yp + c[None, :], (xn * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul(X, Y, s_x, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    xp = X + row * s_x
    g = tl.load(xp + cols, mask=mask, other=0.0)
    u = tl.load(xp + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(Y + row * inter + cols, (s.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


_RMS_NORM, _SILU_AND_MUL = Launcher(_rms_norm), Launcher(_silu_and_mul)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., N]`` as an ``[A, B, N]`` view with unit stride in ``N`` (a copy only if none exists)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, 1, x.shape[-1])


def _warps(elems: int) -> int:
    return max(1, min(16, elems // 512))


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.ref.rms_norm``; ``x`` may be a strided view (outputs are contiguous).

    ``residual`` must have ``x``'s shape and dtype.
    """
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight has shape {list(weight.shape)}; expected [{n}]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual is {residual.dtype} {list(residual.shape)}; expected {x.dtype} {list(x.shape)}"
        )
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else y
    x3 = _rows(x)
    r3 = _rows(residual) if residual is not None else x3
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows and n:
        block_n = triton.next_power_of_2(n)
        one_pass = block_n <= MAX_BLOCK
        if one_pass:
            block_r = max(1, min(ROW_ELEMS // block_n, triton.next_power_of_2(n_rows)))
        else:
            block_n, block_r = MAX_BLOCK, 1
        _RMS_NORM(
            (triton.cdiv(n_rows, block_r),), x3, r3, weight.contiguous(), y, res_out, n_rows, x3.shape[1],
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), float(eps), N=n, HAS_RES=residual is not None,
            ONE_PASS=one_pass, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=_warps(block_r * block_n),
        )  # fmt: skip
    return y if residual is None else (y, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``kernels.ref.silu_and_mul``; ``x`` may have a row stride (output contiguous)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim must be even (gate | up); got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] and inter:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _SILU_AND_MUL(
            (x2.shape[0], triton.cdiv(inter, block)), x2, y, x2.stride(0), inter, BLOCK=block,
            num_warps=_warps(block * 2),
        )  # fmt: skip
    return y
