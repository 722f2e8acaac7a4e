"""Torch twin of ``kernels/triton/decode_attention.py``: decode attention over two tiers.

For each sequence ``b`` the keys are the union of its quantized slots
``int2_indices[int2_indptr[b]:int2_indptr[b+1]]`` and its 16-bit slots
``hp_indices[hp_indptr[b]:hp_indptr[b+1]]``. Each tier is attended separately, giving a
normalised partial output ``o_t`` and its log-sum-exp ``lse_t``; the merge
``o = Σ_t exp(lse_t − m) o_t / Σ_t exp(lse_t − m)`` with ``m = max_t lse_t`` is exactly one
softmax over the concatenation (the structure the split-K Triton kernel uses). fp32 math.
"""

from __future__ import annotations

import torch

from ...quant import RowFormat
from .quantize_pack import dequantize

__all__ = ["decode_attention", "merge_states", "partial_attention"]


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Hq, d]`` over ``k, v [N, Hkv, d]`` (GQA by contiguous groups).

    Returns the normalised output ``[Hq, d]`` and ``lse [Hq]`` (``-inf`` and zeros when ``N = 0``).
    """
    hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    if n == 0:
        return q.new_zeros(hq, v.shape[-1], dtype=torch.float32), q.new_full((hq,), float("-inf"))
    g = hq // hkv
    qg = q.float().view(hkv, g, d)
    s = torch.einsum("hgd,nhd->hgn", qg, k.float()) * sm_scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    o = torch.einsum("hgn,nhd->hgd", p, v.float())
    return o.reshape(hq, -1), lse.reshape(hq)


def merge_states(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Log-sum-exp merge of partial states ``[Hq, d]`` / ``[Hq]``; all-empty gives zeros."""
    lse = torch.stack(lses)  # [S, Hq]
    m = lse.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)  # exp(-inf) = 0 for empty states
    den = w.sum(0).clamp_min(1e-30)
    return (w[..., None] * torch.stack(outs)).sum(0) / den[..., None]


def decode_attention(
    q_rot: torch.Tensor,
    k_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_codes: torch.Tensor,
    v_meta: torch.Tensor,
    hp_k: torch.Tensor,
    hp_v: torch.Tensor,
    int2_indptr: torch.Tensor,
    int2_indices: torch.Tensor,
    hp_indptr: torch.Tensor,
    hp_indices: torch.Tensor,
    sm_scale: float,
    k_fmt: RowFormat,
    v_fmt: RowFormat,
    lens_hint: tuple[int, int] | None = None,
    plan: object | None = None,
) -> torch.Tensor:
    """Exact decode attention over the quantized and 16-bit tiers, in the rotated basis.

    Args:
        q_rot: ``[B, Hq, d]`` queries already rotated by ``R_K``.
        k_codes, v_codes: uint8 ``[Nq, Hkv, packed]``; k_meta, v_meta: ``[Nq, Hkv, groups, 2]``.
        hp_k, hp_v: ``[Nh, Hkv, d]`` window rows (sink and recent window): the model dtype, or
            float8_e4m3fn (read exactly as fp32).
        int2_indptr, hp_indptr: int ``[B + 1]``; int2_indices, hp_indices: int slot ids.
        sm_scale: softmax scale (``1/sqrt(d)``).
        k_fmt, v_fmt: formats of the quantized tier.
        lens_hint: optional host-side (longest quantized list, longest 16-bit list); the Triton
            twin uses it to size its split grid without a device sync.
        plan: the Triton twin's launch plan (``kernels.triton.decode.plan``); nothing to plan here.
    Returns:
        ``[B, Hq, d]`` rotated outputs in ``q_rot.dtype`` (multiply by ``R_Vᵀ`` to un-rotate).
    """
    b = q_rot.shape[0]
    out = torch.empty_like(q_rot)
    ip, hpp = int2_indptr.tolist(), hp_indptr.tolist()
    for i in range(b):
        qi = int2_indices[ip[i] : ip[i + 1]].long()
        hi = hp_indices[hpp[i] : hpp[i + 1]].long()
        kq = dequantize(k_codes[qi], k_meta[qi], k_fmt)
        vq = dequantize(v_codes[qi], v_meta[qi], v_fmt)
        o1, l1 = partial_attention(q_rot[i], kq, vq, sm_scale)
        o2, l2 = partial_attention(q_rot[i], hp_k[hi], hp_v[hi], sm_scale)
        out[i] = merge_states([o1, o2], [l1, l2]).to(out.dtype)
    return out
