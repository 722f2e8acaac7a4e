"""MiniMax-M2 (``minimax_m2``): RMSNorm over the full q and k width, partial rotary; every layer a
mixture of experts (``block_sparse_moe``: experts ``w1`` gate, ``w3`` up, ``w2`` down) routed by
sigmoid scores with a correction bias (selection only), renormalized."""

from __future__ import annotations

from typing import Any

from ..attention import AttnSpec
from ..family import Build, Family
from ..layers import model_error
from ..moe import Routing
from .common import attention_sizes, sparse


def _mlp(b: Build, layer: int) -> tuple[Any, str]:
    c = b.config
    routing = Routing("sigmoid", int(c.num_experts_per_tok), True)
    moe = sparse(b, experts=int(c.num_local_experts), inter=int(c.intermediate_size), routing=routing,
                 bias_name="e_score_correction_bias", names=("w1", "w3", "w2"))  # fmt: skip
    return moe, "block_sparse_moe"


def _check(c: Any, where: str) -> None:
    scoring = getattr(c, "scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise model_error(where, f"scoring_func {scoring!r}: MiniMax-M2 routing is sigmoid")
    kinds = set(getattr(c, "attn_type_list", None) or [1])
    if kinds != {1}:
        raise model_error(
            where, f"attn_type_list {sorted(kinds)}: only full-attention layers (1) are supported"
        )


FAMILY = Family(("minimax_m2",), lambda c: AttnSpec(qk_norm="full"), _mlp,
                lambda c: {**attention_sizes(c), "intermediate_size": int(c.intermediate_size)}, check=_check)  # fmt: skip
