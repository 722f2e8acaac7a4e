"""Reference rotary embedding (rotate-half, full or partial) and the per-head q/k RMSNorm before it.

``apply_rotary`` is HF's ``x·cos + rotate_half(x)·sin`` op for op in the model dtype (negation and
subtraction are exact), so the decoder matches transformers bit for bit; ``qk_norm_rope`` is what
an attention layer does to its new queries and keys between the projection and the cache.

The width of ``cos`` tells the rotary width: ``cos``/``sin`` ``[T, r/2]`` rotate the first ``r``
of the ``d`` head dims, ``i`` paired with ``i + r/2``, and pass dims ``[r, d)`` through unchanged
(partial rotary, as GLM-4.x MoE and MiniMax-M2; ``r == d`` is the full rotation).
"""

from __future__ import annotations

import torch

from .norm import rms_norm

__all__ = ["apply_rotary", "check_norm_weights", "check_rotary", "qk_norm_rope"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the first ``r`` dims: ``x [T, H, d]``, ``cos``/``sin`` ``[T, r/2]``
    with ``2 <= r <= d`` -> ``[T, H, d]`` in ``x``'s dtype, dims ``[r, d)`` as they were."""
    r = check_rotary(x.shape[-1], cos, sin)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if r == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    x1, x2, x_pass = x.split([r // 2, r // 2, x.shape[-1] - r], dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x_pass), dim=-1)


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
    RMS-normalized over all ``d`` dims by ``q_weight``/``k_weight`` ``[d]`` (both ``None``: no
    norm, as Llama) and then its first ``r`` dims rotated by ``cos``/``sin`` ``[T, r/2]`` (fp32)."""
    check_norm_weights(q_weight, k_weight)
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def check_norm_weights(q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> None:
    """Raises ``ValueError`` unless the q/k norm weights are both given or both ``None``."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: q_weight and k_weight are both given (q/k norms) or both None")


def check_rotary(d: int, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """The rotary width ``r = 2·cos.shape[-1]`` for head dim ``d``; raises ``ValueError`` unless
    ``cos`` and ``sin`` are ``[T, r/2]`` alike with ``2 <= r <= d``."""
    r = 2 * cos.shape[-1]
    if cos.dim() != 2 or sin.shape != cos.shape or not 2 <= r <= d:
        raise ValueError(
            f"rotary embedding: cos/sin [T, r/2] alike, rotating r (even, 2 <= r <= d) of the d={d} head "
            f"dims; got cos {list(cos.shape)}, sin {list(sin.shape)} (r={r}): pass the first half of "
            "HF's cos/sin rows"
        )
    return r
