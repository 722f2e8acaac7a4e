"""GLM-4.5/4.6/4.7 (``glm4_moe``): q/k/v biases, per-head q/k norms when ``use_qk_norm``, partial
rotary; the first ``first_k_dense_replace`` layers dense, the rest routed by sigmoid scores with a
correction bias (selection only), group-limited top-k, renormalized, times ``routed_scaling_factor``,
plus shared experts. The multi-token-prediction layers (``num_nextn_predict_layers``, stored as
layers past ``num_hidden_layers``) are not used by the engine and are skipped at load."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..attention import AttnSpec
from ..family import Build, Family
from ..layers import model_error
from ..moe import Routing
from .common import attention_sizes, dense, sparse


def _attention(c: Any) -> AttnSpec:
    return AttnSpec(qkv_bias=bool(c.attention_bias), o_bias=False,
                    qk_norm="head" if getattr(c, "use_qk_norm", False) else None)  # fmt: skip


def _mlp(b: Build, layer: int) -> tuple[Any, str]:
    c = b.config
    if layer < int(c.first_k_dense_replace):
        return dense(b, int(c.intermediate_size)), "mlp"
    routing = Routing("sigmoid", int(c.num_experts_per_tok), bool(c.norm_topk_prob), n_group=int(c.n_group),
                      topk_group=int(c.topk_group), scale=float(c.routed_scaling_factor), fp32_logits=True,
                      renorm_eps=1e-20)  # fmt: skip
    inter = int(c.moe_intermediate_size)
    shared = inter * int(getattr(c, "n_shared_experts", 0) or 0)
    moe = sparse(b, experts=int(c.n_routed_experts), inter=inter, routing=routing, shared_inter=shared,
                 bias_name="gate.e_score_correction_bias")  # fmt: skip
    return moe, "mlp"


def _sizes(c: Any) -> dict[str, int]:
    sizes = {**attention_sizes(c), "moe_intermediate_size": int(c.moe_intermediate_size)}
    if int(c.first_k_dense_replace) > 0:
        sizes["intermediate_size"] = int(c.intermediate_size)
    return sizes


def _skipped(c: Any) -> Callable[[str], bool]:
    n = int(c.num_hidden_layers)
    if not int(getattr(c, "num_nextn_predict_layers", 0) or 0):
        return lambda key: False
    pat = re.compile(r"model\.layers\.(\d+)\.")
    return lambda key: (m := pat.match(key)) is not None and int(m.group(1)) >= n


def _check(c: Any, where: str) -> None:
    e, g = int(c.n_routed_experts), int(c.n_group)
    if g < 1 or e % g or not 1 <= int(c.topk_group) <= g:
        raise model_error(
            where,
            f"n_routed_experts {e}, n_group {g}, topk_group {c.topk_group}: groups must split the experts",
        )


FAMILY = Family(("glm4_moe",), _attention, _mlp, _sizes, check=_check, skipped=_skipped)
