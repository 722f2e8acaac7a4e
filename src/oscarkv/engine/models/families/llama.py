"""Llama and Mistral (full attention): optional attention and MLP biases."""

from __future__ import annotations

from typing import Any

from ..attention import AttnSpec
from ..family import Build, Family
from .common import dense, dense_sizes


def _attention(c: Any) -> AttnSpec:
    bias = bool(getattr(c, "attention_bias", False))
    return AttnSpec(qkv_bias=bias, o_bias=bias)


def _mlp(b: Build, layer: int) -> tuple[Any, str]:
    return dense(b, int(b.config.intermediate_size), bool(getattr(b.config, "mlp_bias", False))), "mlp"


FAMILY = Family(("llama", "mistral"), _attention, _mlp, dense_sizes)
