"""The Triton backend's :class:`~oscarkv.kernels.KernelOps` (imported only on CUDA).

Prefill attention runs PyTorch's flash-attention kernel in its variable-length form: GQA without
repeating K/V heads, and causal bottom-right aligned when a sequence has more keys than queries,
so no ``[T, P+T]`` mask is built and one launch covers every sequence of a step. The flash
kernel takes bf16/fp16 with head dims that are multiples of 8 up to 256; other inputs (fp32 models,
the CPU in tests) take SDPA with an explicit bottom-right mask, one sequence at a time.
"""

from __future__ import annotations

import torch

from ...quant import RowFormat
from .. import Backend, KernelOps
from ..ref.prefill_attention import per_sequence
from .decode import check_windows, decode_attention
from .decode.attention import _check_format as _decode_check
from .dequantize import dequantize
from .fp8 import fp8_linear, fp8_moe_experts
from .moe import MoeTuning, moe_experts
from .norm import rms_norm, silu_and_mul
from .quantize_pack import _check as _quantize_check
from .quantize_pack import quantize_pack, quantize_pack_into
from .rope import qk_norm_rope
from .rotate import rotate_heads, rotate_new_rows, rotate_rows
from .router import route_topk

__all__ = ["KERNEL_OPS", "prefill_attention", "prefill_attention_varlen"]


def _flash_ok(q: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    )


def _flash(q, k, v, cu_q, cu_k, max_q, max_k, sm_scale):
    out = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous(), cu_q, cu_k, max_q, max_k,
        0.0, True, False, scale=sm_scale,
    )  # fmt: skip
    return out[0]


def _sdpa_masked(q_rot, prefix_k, prefix_v, new_k, new_v, sm_scale):
    t, hq = q_rot.shape[:2]
    hkv = new_k.shape[1]
    p = prefix_k.shape[0]
    k = torch.cat([prefix_k.to(q_rot.dtype), new_k.to(q_rot.dtype)]).transpose(0, 1)[None]
    v = torch.cat([prefix_v.to(q_rot.dtype), new_v.to(q_rot.dtype)]).transpose(0, 1)[None]
    if p == 0:  # plain causal
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


def prefill_attention(q_rot, prefix_k, prefix_v, new_k, new_v, sm_scale):
    """Same contract as ``kernels.ref.prefill_attention`` (see the module docstring)."""
    if not _flash_ok(q_rot):
        return _sdpa_masked(q_rot, prefix_k, prefix_v, new_k, new_v, sm_scale)
    t, p = q_rot.shape[0], prefix_k.shape[0]
    cu = torch.tensor([[0, t], [0, p + t]], dtype=torch.int32).to(q_rot.device, non_blocking=True)
    k, v = torch.cat([prefix_k.to(q_rot.dtype), new_k]), torch.cat([prefix_v.to(q_rot.dtype), new_v])
    return _flash(q_rot, k, v, cu[0], cu[1], t, p + t, sm_scale)


def prefill_attention_varlen(q_rot, k, v, cu_q, cu_k, max_q, max_k, sm_scale):
    """Same contract as ``kernels.ref.prefill_attention_varlen`` (see the module docstring)."""
    if not _flash_ok(q_rot):
        return per_sequence(_sdpa_masked, q_rot, k, v, cu_q, cu_k, sm_scale)
    return _flash(q_rot, k, v, cu_q, cu_k, max_q, max_k, sm_scale)


def check_formats(k_fmt: RowFormat, v_fmt: RowFormat) -> None:
    """Raises ``ValueError`` when quantize_pack cannot write or decode attention cannot read these rows."""
    try:
        _quantize_check(k_fmt), _quantize_check(v_fmt)
        _decode_check(k_fmt, "k"), _decode_check(v_fmt, "v")
    except ValueError as e:  # the caller states the fix
        raise ValueError(str(e).removesuffix(" (use backend='torch')")) from None


KERNEL_OPS = KernelOps(
    Backend.TRITON,
    quantize_pack,
    dequantize,
    decode_attention,
    prefill_attention,
    prefill_attention_varlen,
    rotate_heads,
    rotate_new_rows,
    rms_norm,
    silu_and_mul,
    qk_norm_rope,
    rotate_rows,
    check_formats,
    check_windows,
    quantize_pack_into=quantize_pack_into,
    moe_experts=moe_experts,
    moe_small_tokens=MoeTuning().small_tokens,
    route_topk=route_topk,
    fp8_linear=fp8_linear,
    fp8_moe_experts=fp8_moe_experts,
)
