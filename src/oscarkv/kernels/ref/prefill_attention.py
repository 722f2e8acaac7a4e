"""Torch twin of the prefill path: new tokens attend to a cached prefix plus themselves.

The prefix (16-bit rows and dequantized quantized rows of the same sequence) is fully visible;
the new tokens are full precision and causal among themselves (spec §5.7). fp32 math.
"""

from __future__ import annotations

import torch

__all__ = ["prefill_attention"]


def prefill_attention(
    q_rot: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """One sequence's prefill attention in the rotated basis.

    Args:
        q_rot: ``[T, Hq, d]``; new_k, new_v: ``[T, Hkv, d]`` (the same T new tokens).
        prefix_k, prefix_v: ``[P, Hkv, d]`` cached rows (any order), ``P >= 0``.
    Returns:
        ``[T, Hq, d]`` in ``q_rot.dtype``.
    """
    t, hq, d = q_rot.shape
    hkv = new_k.shape[1]
    g = hq // hkv
    k = torch.cat([prefix_k.float(), new_k.float()])  # [P+T, Hkv, d]
    v = torch.cat([prefix_v.float(), new_v.float()])
    p = prefix_k.shape[0]
    qg = q_rot.float().view(t, hkv, g, d)
    s = torch.einsum("thgd,nhd->hgtn", qg, k) * sm_scale
    causal = (
        torch.arange(p + t, device=q_rot.device)[None, :]
        > (p + torch.arange(t, device=q_rot.device))[:, None]
    )
    s = s.masked_fill(causal, float("-inf"))
    o = torch.einsum("hgtn,nhd->thgd", s.softmax(-1), v)
    return o.reshape(t, hq, -1).to(q_rot.dtype)
