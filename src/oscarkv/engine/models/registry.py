"""The model registry: one :class:`Family` per architecture, found by the config's ``model_type``.

A family says what its layers are made of (the attention variant, each layer's MLP: dense or a
mixture of experts), what it checks in a config beyond the common checks, which checkpoint
tensors it skips, and which sizes tensor parallelism must divide. The decoder, the loader and
the tensor-parallel split read only this. A new architecture is one file in ``families/`` and
one line in :data:`FAMILIES`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ...errors import ModelError
from .families import glm4_moe, llama, minimax_m2, qwen2, qwen3, qwen3_moe
from .family import Family
from .layers import head_dim_of, model_error, rope_inv_freq

__all__ = ["FAMILIES", "check_config", "check_split", "family_of", "supported_model_types"]


FAMILIES: tuple[Family, ...] = (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, glm4_moe.FAMILY, minimax_m2.FAMILY
)  # fmt: skip
_BY_TYPE = MappingProxyType({t: f for f in FAMILIES for t in f.model_types})


def supported_model_types() -> tuple[str, ...]:
    return tuple(_BY_TYPE)


def _supported() -> str:
    return ", ".join(t for f in FAMILIES for t in f.model_types) + " (full attention only)"


def family_of(config: Any, where: str = "model") -> Family:
    """The :class:`Family` of a text config, after every check (:func:`check_config`)."""
    check_config(config, where)
    return _BY_TYPE[config.model_type]


def check_config(config: Any, where: str = "model") -> None:
    """Raise :class:`ModelError` (one line) unless the text config is one the decoder serves."""
    mt = getattr(config, "model_type", None)
    fam = _BY_TYPE.get(mt)  # type: ignore[arg-type]
    if fam is None:
        msg = f"model_type {mt!r} is not supported by the engine; supported: {_supported()}"
        raise model_error(where, msg, "run other architectures through oscarkv.hf.OscarCache (transformers)")
    window = getattr(config, "sliding_window", None)
    sliding_layers = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if sliding_layers or (mt == "mistral" and window is not None):
        msg = f"{mt} with sliding-window attention (sliding_window={window}) is not supported"
        raise model_error(where, f"{msg}; the engine serves full attention only")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise model_error(where, f"hidden_act {act!r} is not supported; the engine's MLPs are SiLU-gated")
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    if hq % hkv:
        raise model_error(where, f"{hq} attention heads are not a multiple of {hkv} KV heads")
    try:
        rope_inv_freq(config, head_dim_of(config))
    except ModelError as e:
        raise model_error(where, str(e), e.hint) from None
    fam.check(config, where)


def check_split(config: Any, tp: int, where: str = "model") -> None:
    """Raise :class:`ModelError` unless ``tp`` ranks split the family's sizes evenly."""
    if tp == 1:
        return
    sizes = family_of(config, where).split_sizes(config)
    for name, n in sizes.items():
        if n % tp:
            ok = [t for t in range(1, n + 1) if all(m % t == 0 for m in sizes.values())]
            raise ModelError(
                f"{where}: tensor_parallel={tp} splits {name} ({n}) across ranks, and {n} % {tp} != 0",
                f"use a tensor_parallel that divides it: {', '.join(map(str, ok))}",
            )
