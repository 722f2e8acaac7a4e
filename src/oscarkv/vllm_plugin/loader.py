"""R_V absorption at weight load: vLLM's default loader, then ``R_V`` folded into ``qkv_proj``.

vLLM lets a plug-in add a load format (``register_model_loader``,
``vllm/model_executor/model_loader/__init__.py:69``) but not a hook after every loader, so this is
the load format ``oscarkv``: the user passes ``load_format="oscarkv"`` (``--load-format oscarkv``)
and :mod:`.checks` refuses ``absorb_v`` without it. Weights are read as with ``auto``; then, before
vLLM's own post-processing (CPU GEMM packing, ``base_loader.py:109``), the V rows of every layer's
fused ``qkv_proj`` become ``R_Vᵀ W_v`` per KV head (bias ``b R_V``), with the same function and
rounding as our engine's loader (``rotation.absorb_value_weight``). ``o_proj`` is untouched: as in
our engine, the attention rotates its output back by ``R_Vᵀ`` (``store.TierAttention``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.models.utils import extract_layer_index

from ..errors import InputError
from ..rotation import RotationSet, absorb_value_weight
from .checks import LOAD_FORMAT

__all__ = ["LOAD_FORMAT", "OscarModelLoader", "absorb_value_rotations"]


def _v_rows(qkv: nn.Module) -> tuple[slice, int, int]:
    """``(rows of the V block in this rank's fused weight, first KV head, KV heads)``."""
    q = qkv.num_heads * qkv.head_size
    kv = qkv.num_kv_heads * qkv.head_size
    first = (getattr(qkv, "tp_rank", 0) // qkv.num_kv_head_replicas) * qkv.num_kv_heads
    return slice(q + kv, q + kv + qkv.num_kv_heads * qkv.v_head_size), first, qkv.num_kv_heads


@torch.no_grad()
def absorb_value_rotations(model: nn.Module, rotations: RotationSet) -> int:
    """Fold each layer's ``R_V`` into the V rows of the ``qkv_proj`` next to its attention layer
    (the attention's parent module must have one, unquantized). Returns the layers absorbed."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import QKVParallelLinear

    done = 0
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        qkv = getattr(parent, "qkv_proj", None)
        if not isinstance(qkv, QKVParallelLinear) or not torch.is_floating_point(qkv.weight):
            raise InputError(
                f"oscarkv: cannot absorb R_V into {type(parent).__name__} ({name}): it has no "
                "unquantized fused qkv_proj",
                hint="set absorb_v=false in additional_config['oscarkv']",
            )
        r = rotations.layers[extract_layer_index(module.layer_name)].v
        rows, first, n = _v_rows(qkv)
        if r.dim() == 3:  # per KV head: this rank's heads
            r = r[first : first + n]
        w = qkv.weight.data[rows]
        b = None if qkv.bias is None else qkv.bias.data[rows]
        w_new, b_new = absorb_value_weight(w, b, r, qkv.v_head_size)
        w.copy_(w_new)
        if b is not None and b_new is not None:
            b.copy_(b_new)
        done += 1
    return done


@register_model_loader(LOAD_FORMAT)
class OscarModelLoader(DefaultModelLoader):
    """``load_format="oscarkv"``: the default loader (files found as with ``auto``), then R_V
    absorbed when the run opted in with ``kv_dtype="int2"`` and ``absorb_v`` (the default)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(replace(load_config, load_format="auto"))

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        super().load_weights(model, model_config)
        from .common import enabled_options, int2_state, logger, record_absorbed

        opts, setup = enabled_options(), int2_state()
        if opts is None or setup is None or not opts.absorb_v:
            return
        n = absorb_value_rotations(model, setup.rotations)
        record_absorbed()
        logger.info_once("oscarkv: R_V absorbed into qkv_proj of %d layers", n)
