"""Reference rotary embedding (rotate-half) and the per-head q/k RMSNorm before it.

``apply_rotary`` is HF's ``x·cos + rotate_half(x)·sin`` op for op in the model dtype (negation and
subtraction are exact), so the decoder matches transformers bit for bit; ``qk_norm_rope`` is what
an attention layer does to its new queries and keys between the projection and the cache.
"""

from __future__ import annotations

import torch

from .norm import rms_norm

__all__ = ["apply_rotary", "check_norm_weights", "qk_norm_rope"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x [T, H, d]``, ``cos``/``sin`` ``[T, d/2]`` -> ``[T, H, d]`` in ``x``'s dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, Hq, d]``, ``k [T, Hkv, d]`` (model dtype, any row strides) -> the same, each head
    RMS-normalized by ``q_weight``/``k_weight`` ``[d]`` (both ``None``: no norm, as Llama) and then
    rotated by ``cos``/``sin`` ``[T, d/2]`` (fp32)."""
    check_norm_weights(q_weight, k_weight)
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def check_norm_weights(q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> None:
    """Raises ``ValueError`` unless the q/k norm weights are both given or both ``None``."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: q_weight and k_weight are both given (q/k norms) or both None")
