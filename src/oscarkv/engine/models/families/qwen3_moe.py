"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention; softmax top-k routing,
renormalized when ``norm_topk_prob``; dense MLPs on ``mlp_only_layers`` and off the
``decoder_sparse_step`` grid."""

from __future__ import annotations

from typing import Any

from ..family import Build, Family
from ..moe import Routing
from .common import attention_sizes, dense, sparse
from .qwen3 import attention


def _is_sparse(c: Any, layer: int) -> bool:
    only = set(getattr(c, "mlp_only_layers", None) or ())
    step = int(getattr(c, "decoder_sparse_step", 1) or 1)
    return layer not in only and int(c.num_experts) > 0 and (layer + 1) % step == 0


def _mlp(b: Build, layer: int) -> tuple[Any, str]:
    c = b.config
    if not _is_sparse(c, layer):
        return dense(b, int(c.intermediate_size)), "mlp"
    routing = Routing("softmax", int(c.num_experts_per_tok), bool(c.norm_topk_prob))
    return sparse(b, experts=int(c.num_experts), inter=int(c.moe_intermediate_size), routing=routing), "mlp"


def _sizes(c: Any) -> dict[str, int]:
    sizes = {**attention_sizes(c), "moe_intermediate_size": int(c.moe_intermediate_size)}
    if any(not _is_sparse(c, i) for i in range(int(c.num_hidden_layers))):
        sizes["intermediate_size"] = int(c.intermediate_size)
    return sizes


FAMILY = Family(("qwen3_moe",), attention, _mlp, _sizes)
