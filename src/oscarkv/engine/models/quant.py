"""The weight method a checkpoint's ``quantization_config`` asks for (:func:`weight_method`)."""

from __future__ import annotations

from typing import Any

from ...errors import ModelError
from .fp8 import Fp8Block
from .layers import model_error
from .linear import LinearMethod, Unquantized

__all__ = ["weight_method"]

_FP8_FMTS = (None, "e4m3", "float8_e4m3fn")
# modules an FP8 checkpoint may leave unquantized: the engine never builds them as FP8 linears
_NEVER_FP8 = ("gate", "router", "lm_head", "embed_tokens", "e_score_correction_bias")
_SUPPORTED = "quant_method fp8 with fmt e4m3, weight_block_size [128, 128], dynamic activations"


def weight_method(config: Any, where: str = "model") -> LinearMethod:
    """:class:`Unquantized` without a ``quantization_config``; :class:`~.fp8.Fp8Block` for FP8
    128×128 block-scaled checkpoints; anything else is a one-line :class:`ModelError`."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return Unquantized()
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    hint = "use the bf16 checkpoint, or an FP8 one with 128x128 block scales (weight_scale_inv)"

    def refuse(key: str, why: str) -> ModelError:
        return model_error(
            where, f"quantization_config.{key} {qc.get(key)!r}: {why}; supported: {_SUPPORTED}", hint
        )

    if qc.get("quant_method") != "fp8":
        raise refuse("quant_method", "not a quantization the engine loads")
    if qc.get("fmt") not in _FP8_FMTS:
        raise refuse("fmt", "not float8 e4m3")
    block = qc.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or [int(b) for b in block] != [128, 128]:
        why = "per-tensor FP8 (no block size) is not supported" if block is None else "not 128x128 blocks"
        raise refuse("weight_block_size", why)
    if qc.get("activation_scheme") not in (None, "dynamic"):
        raise refuse("activation_scheme", "static activation scales are not supported")
    if qc.get("scale_fmt") not in (None, "float"):
        raise refuse("scale_fmt", "only fp32 block scales are supported")
    if qc.get("expert_dtype") not in (None, "fp8"):
        raise refuse("expert_dtype", "only FP8 experts are supported")
    key = "modules_to_not_convert" if qc.get("modules_to_not_convert") is not None else "ignored_layers"
    bad = [m for m in qc.get(key) or () if not _never_fp8(str(m))]
    if bad:
        names = ", ".join(map(str, bad[:4])) + (" ..." if len(bad) > 4 else "")
        msg = (f"quantization_config.{key} leaves {names} unquantized: unquantized projections in an FP8 "
               "checkpoint are not supported (only the router gate, lm_head, embeddings and norms may be left out)")  # fmt: skip
        raise model_error(where, msg, "use the bf16 checkpoint")
    return Fp8Block()


def _never_fp8(module: str) -> bool:
    """Whether a module name (or pattern) left unquantized names only modules the engine keeps in
    the model dtype anyway: routers, the LM head, embeddings, norms."""
    last = module.rstrip("$").rsplit(".", 1)[-1]
    return last in _NEVER_FP8 or "norm" in last
