"""Qwen2: q/k/v biases."""

from __future__ import annotations

from typing import Any

from ..attention import AttnSpec
from ..family import Build, Family
from .common import dense, dense_sizes


def _mlp(b: Build, layer: int) -> tuple[Any, str]:
    return dense(b, int(b.config.intermediate_size)), "mlp"


FAMILY = Family(("qwen2",), lambda c: AttnSpec(qkv_bias=True), _mlp, dense_sizes)
