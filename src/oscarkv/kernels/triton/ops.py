"""The Triton backend's :class:`~oscarkv.kernels.KernelOps` (imported only on CUDA)."""

from __future__ import annotations

import torch

from .. import Backend, KernelOps
from .decode import decode_attention
from .dequantize import dequantize
from .quantize_pack import quantize_pack
from .rotate import rotate_heads, rotate_new_rows

__all__ = ["KERNEL_OPS", "prefill_attention"]


def prefill_attention(q_rot, prefix_k, prefix_v, new_k, new_v, sm_scale):
    """Same contract as ``kernels.ref.prefill_attention``, through PyTorch SDPA (flash/cuDNN/
    efficient) with a bottom-right causal mask; the prefix arrives dequantized."""
    t, hq = q_rot.shape[:2]
    hkv = new_k.shape[1]
    p = prefix_k.shape[0]
    k = torch.cat([prefix_k.to(q_rot.dtype), new_k.to(q_rot.dtype)]).transpose(0, 1)[None]
    v = torch.cat([prefix_v.to(q_rot.dtype), new_v.to(q_rot.dtype)]).transpose(0, 1)[None]
    if p == 0:  # plain causal: lets SDPA pick the flash kernel
        mask, causal = None, True
    else:
        pos = torch.arange(p + t, device=q_rot.device)
        mask, causal = pos[None, :] <= (p + torch.arange(t, device=q_rot.device))[:, None], False
    out = torch.nn.functional.scaled_dot_product_attention(
        q_rot.transpose(0, 1)[None],
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=sm_scale,
        enable_gqa=hq != hkv,
    )
    return out[0].transpose(0, 1)


KERNEL_OPS = KernelOps(
    Backend.TRITON,
    quantize_pack,
    dequantize,
    decode_attention,
    prefill_attention,
    rotate_heads,
    rotate_new_rows,
)
