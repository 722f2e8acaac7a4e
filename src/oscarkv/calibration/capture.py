"""Seeing post-RoPE (post-QK-norm) Q, K and V at every attention layer, with no per-model code.

A function registered in transformers' ``AttentionInterface`` (and the matching mask function)
receives exactly the tensors OSCAR dumps (spec §1.2): ``query [B, H_q, T, d]`` and
``key/value [B, H_kv, T, d]`` after QK-norm and RoPE. It hands them, with the SDPA output, to a
callback, then returns that output, so the model computes what it always computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import ModelError
from ..utils.models import supports_attention_interface

__all__ = [
    "CAPTURE_IMPL",
    "UnsupportedModelError",
    "attention_geometry",
    "capture_attention",
    "check_supported",
    "supports_attention_interface",
]

CAPTURE_IMPL = "oscarkv_capture"

#: callback(layer_idx, query, key, value, output); output is ``[B, T, H_q, d]``
Callback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

#: attribute set on a model's attention modules while a capture of that model is active
_HOOK = "_oscarkv_capture"


class UnsupportedModelError(ModelError, TypeError):
    """The model does not route attention through transformers' AttentionInterface."""


def _capture_forward(module: Any, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    stack = getattr(module, _HOOK, None)
    if stack:
        stack[-1](int(module.layer_idx), query, key, value, out)
    return out, weights


def attention_geometry(model: Any) -> dict[str, Any]:
    """Head counts, head dim and attention layer ids of a loaded transformers model."""
    from ..rotation import attention_layer_ids, model_head_dim

    cfg = model.config.get_text_config()
    return {
        "num_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        "head_dim": model_head_dim(cfg),
        "layer_ids": attention_layer_ids(cfg),
    }


def check_supported(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` if ``model`` cannot be hooked through the interface."""
    if not supports_attention_interface(model):
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route attention through transformers' "
            "AttentionInterface, so oscarkv cannot see its queries and keys. Supported: models "
            "whose attention calls ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen2/Qwen3, Gemma, ...)."
        )


@contextlib.contextmanager
def route_attention(model: Any, name: str, forward: Callable[..., Any]) -> Iterator[None]:
    """Register ``forward`` as attention implementation ``name`` (with the SDPA mask function)
    and route ``model``'s attention through it while the block runs; the previous
    implementation is restored on exit."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    check_supported(model)
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise UnsupportedModelError(
                f"{type(model).__name__} refused the attention implementation {name!r}; "
                "oscarkv cannot see its queries and keys"
            )
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def capture_attention(model: Any, callback: Callback) -> Iterator[set[int]]:
    """Route ``model``'s attention through the capture function while the block runs.

    Yields the set of layer ids seen so far (callers check coverage). The previous attention
    implementation is restored on exit.
    """
    check_supported(model)
    seen: set[int] = set()

    def wrapped(layer: int, q, k, v, o) -> None:
        seen.add(layer)
        callback(layer, q, k, v, o)

    # callbacks live on this model's attention modules, so captures of two models never mix
    modules = [m for m in model.modules() if hasattr(m, "layer_idx")]
    for m in modules:
        m.__dict__.setdefault(_HOOK, []).append(wrapped)
    try:
        with route_attention(model, CAPTURE_IMPL, _capture_forward):
            yield seen
    finally:
        for m in modules:
            m.__dict__[_HOOK].pop()
            if not m.__dict__[_HOOK]:
                del m.__dict__[_HOOK]
