"""Builders the families share: a dense SiLU MLP, a sparse MoE block, the split sizes."""

from __future__ import annotations

from typing import Any

from ..family import Build
from ..layers import SiluAndMul
from ..moe import DenseMLP, Experts, Routing, SparseMoe

__all__ = ["GATE_UP_DOWN", "attention_sizes", "dense", "sparse"]

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def dense(b: Build, inter: int, bias: bool = False) -> DenseMLP:
    """The SiLU-gated MLP ``down(silu(gate(x)) · up(x))`` of width ``inter``."""
    return DenseMLP(int(b.config.hidden_size), inter, bias, b.method, SiluAndMul(b.ops.silu_and_mul), **b.kw)


def sparse(
    b: Build,
    *,
    experts: int,
    inter: int,
    routing: Routing,
    shared_inter: int = 0,
    bias_name: str | None = None,
    names: tuple[str, str, str] = GATE_UP_DOWN,
) -> SparseMoe:
    """A router over ``experts`` experts of width ``inter`` (+ a shared MLP of ``shared_inter``)."""
    hidden = int(b.config.hidden_size)
    ex = Experts(experts, hidden, inter, b.method, names=names, **b.kw)
    shared = dense(b, shared_inter) if shared_inter else None
    return SparseMoe(hidden, routing, ex, shared, bias_name=bias_name, **b.kw)


def attention_sizes(config: Any) -> dict[str, int]:
    """The attention sizes tensor parallelism splits: query and KV heads."""
    hq = int(config.num_attention_heads)
    return {
        "num_attention_heads": hq,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or hq),
    }


def dense_sizes(config: Any) -> dict[str, int]:
    """Heads and the dense MLP width."""
    return {**attention_sizes(config), "intermediate_size": int(config.intermediate_size)}
