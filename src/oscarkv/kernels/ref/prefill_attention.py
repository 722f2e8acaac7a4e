"""Torch twin of the prefill path: new tokens attend to a cached prefix plus themselves.

The prefix (16-bit rows and dequantized quantized rows of the same sequence) is fully visible;
the new tokens are full precision and causal among themselves (spec §5.7). fp32 math, through torch's
``scaled_dot_product_attention`` (the CPU engine's prefill runs this twin).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["prefill_attention", "prefill_attention_varlen"]


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
    t, p = q_rot.shape[0], prefix_k.shape[0]
    k = torch.cat([prefix_k.float(), new_k.float()]).transpose(0, 1)  # [Hkv, P+T, d]
    v = torch.cat([prefix_v.float(), new_v.float()]).transpose(0, 1)
    q = q_rot.float().transpose(0, 1)  # [Hq, T, d]; query head h reads KV head h // (Hq / Hkv)
    mask = None
    if p:  # causal from the bottom right: new token i sees the prefix and new tokens 0..i
        dev = q_rot.device
        mask = torch.arange(p + t, device=dev)[None, :] <= (p + torch.arange(t, device=dev))[:, None]
    # 4-D inputs: torch's CPU flash kernel (7x the 3-D math path at 1K tokens)
    o = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=not p, scale=sm_scale, enable_gqa=True
    )
    return o[0].transpose(0, 1).to(q_rot.dtype)


def per_sequence(attend, q_rot, k, v, cu_q, cu_k, sm_scale) -> torch.Tensor:
    """The varlen layout of :func:`prefill_attention_varlen` run as one ``attend(q, prefix_k,
    prefix_v, new_k, new_v, sm_scale)`` call per sequence."""
    out = torch.empty_like(q_rot)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        a, b, e = cq[i], cq[i + 1], ck[i + 1]
        m = e - (b - a)  # first new-token key
        out[a:b] = attend(q_rot[a:b], k[ck[i] : m], v[ck[i] : m], k[m:e], v[m:e], sm_scale)
    return out


def prefill_attention_varlen(
    q_rot: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    sm_scale: float,
) -> torch.Tensor:
    """Several sequences' prefill attention, flat: sequence ``i``'s queries
    ``q_rot[cu_q[i]:cu_q[i+1]]`` (``T_i`` rows, ``[T, Hq, d]`` in all) attend to its keys
    ``k[cu_k[i]:cu_k[i+1]]`` (``[K, Hkv, d]``), whose last ``T_i`` rows are its own new tokens:
    the prefix fully visible, causal (bottom-right) among the new ones. ``cu_q``/``cu_k``: int32
    ``[n+1]``; ``max_q``/``max_k`` bound the lengths (used by the fused kernel). Returns
    ``[T, Hq, d]`` in ``q_rot.dtype``."""
    return per_sequence(prefill_attention, q_rot, k, v, cu_q, cu_k, sm_scale)
