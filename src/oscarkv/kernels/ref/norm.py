"""Reference RMSNorm (optionally with the residual add before it) and SiLU-and-mul.

The decoder's per-token elementwise ops, in the arithmetic of the transformers modules they replace:
RMSNorm takes its statistics in fp32, rounds the normalized rows to the input dtype and then
multiplies by the weight (HF ``LlamaRMSNorm``); the residual add and the SiLU gate run in the
model dtype as the eager decoder's ``h + attn(...)`` and ``silu(gate) * up`` do.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "silu_and_mul"]


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight · x / rms(x)`` over the last dim of ``x [..., N]``; ``weight [N]``.

    Without ``residual``: the normalized ``[..., N]`` in the promoted dtype of ``x`` and ``weight``.
    With ``residual`` (``x``'s shape and dtype): ``residual = x + residual`` in that dtype, then
    ``(rms_norm(residual), residual)``: the pre-norm decoder's add and next norm in one call.
    """
    if residual is not None:
        x = residual = x + residual
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I]`` (``gate | up``) -> ``silu(gate) · up`` ``[..., I]`` in ``x``'s dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
