"""Readable PyTorch reference kernels (fp32 math): the CPU path and the test oracle."""

from .decode_attention import decode_attention, merge_states, partial_attention
from .fp8 import dequantize_fp8, fp8_linear, fp8_moe_experts
from .moe import moe_experts
from .norm import rms_norm, silu_and_mul
from .prefill_attention import prefill_attention, prefill_attention_varlen
from .quantize_pack import dequantize, quantize_pack, quantize_pack_into
from .rope import apply_rotary, qk_norm_rope
from .rotate import rotate_heads, rotate_new_rows, rotate_rows
from .router import route_topk

__all__ = [
    "apply_rotary",
    "decode_attention",
    "dequantize",
    "dequantize_fp8",
    "fp8_linear",
    "fp8_moe_experts",
    "merge_states",
    "moe_experts",
    "partial_attention",
    "prefill_attention",
    "prefill_attention_varlen",
    "qk_norm_rope",
    "quantize_pack",
    "quantize_pack_into",
    "rms_norm",
    "rotate_heads",
    "rotate_new_rows",
    "rotate_rows",
    "route_topk",
    "silu_and_mul",
]
