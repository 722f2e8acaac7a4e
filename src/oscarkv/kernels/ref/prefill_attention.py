"""Torch twin of the prefill path: new tokens attend to a cached prefix plus themselves.

The prefix (16-bit rows and dequantized quantized rows of the same sequence) is fully visible;
the new tokens are full precision and causal among themselves (spec §5.7). fp32 math.
"""

from __future__ import annotations

import torch

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
