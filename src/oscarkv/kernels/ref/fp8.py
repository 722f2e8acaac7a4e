"""Reference twins of the FP8 block-scaled weight kernels (``kernels.triton.fp8``).

Weights are float8_e4m3fn with one fp32 scale per 128×128 block (``weight_scale_inv``): the value
of ``w[i, j]`` is ``s[i // 128, j // 128] · w[i, j]``. Activations stay in the model dtype; the
products run in fp32 and are rounded to ``x``'s dtype once (``fp8_linear``) or where the bf16
experts round them (``fp8_moe_experts``, the arithmetic of ``kernels.ref.moe.moe_experts``).
"""

from __future__ import annotations

import torch

from .moe import moe_experts

__all__ = ["dequantize_fp8", "fp8_linear", "fp8_moe_experts"]

BLOCK = 128


def dequantize_fp8(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 ``s · w``: ``w`` float8 ``[..., n, k]``, ``s`` fp32 ``[..., ≥ceil(n/128), ≥ceil(k/128)]``
    (extra trailing rows and columns, e.g. padding, are ignored)."""
    n, k = w.shape[-2:]
    full = s.float().repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return w.float() * full


def fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bf16, fp16 or fp32) times the dequantized ``w [N, K]``ᵀ -> ``[M, N]`` in ``x``'s dtype."""
    return (x.float() @ dequantize_fp8(w, s).T).to(x.dtype)


def fp8_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """``kernels.ref.moe.moe_experts`` with FP8 experts: ``w13 [E, 2I, H]`` / ``w2 [E, H, I]``
    float8 with block scales ``s13 [E, ≥2I/128, ≥H/128]`` / ``s2 [E, ≥H/128, ≥I/128]``; ``x [T, H]``,
    ``weights``/``ids [T, k]`` -> ``[T, H]`` in ``x``'s dtype. Only the chosen experts are dequantized."""
    used, local = torch.unique(ids, return_inverse=True)
    return moe_experts(
        x, dequantize_fp8(w13[used], s13[used]), dequantize_fp8(w2[used], s2[used]), weights, local
    )
