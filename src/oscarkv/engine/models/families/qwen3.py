"""Qwen3: per-head q/k RMSNorm; optional attention biases."""

from __future__ import annotations

from typing import Any

from ..attention import AttnSpec
from ..family import Build, Family
from .common import dense, dense_sizes


def attention(c: Any) -> AttnSpec:
    bias = bool(getattr(c, "attention_bias", False))
    return AttnSpec(qkv_bias=bias, o_bias=bias, qk_norm="head")


def _mlp(b: Build, layer: int) -> tuple[Any, str]:
    return dense(b, int(b.config.intermediate_size)), "mlp"


FAMILY = Family(("qwen3",), attention, _mlp, dense_sizes)
