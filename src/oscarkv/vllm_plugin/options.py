"""The plug-in's options, read from vLLM's ``additional_config["oscarkv"]``.

vLLM validates ``--kv-cache-dtype`` against a closed ``Literal`` (``vllm/config/cache.py:39``),
so a plug-in cannot add ``oscar_int2`` there; the opt-in lives in ``additional_config``, which
vLLM passes through untouched and folds into its config hash (``vllm/config/vllm.py:549``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InputError

__all__ = ["KEY", "PluginOptions"]

KEY = "oscarkv"
_KV_DTYPES = ("bf16", "int2")
_KNOWN = ("kv_dtype", "rotations", "absorb_v")


@dataclass(frozen=True)
class PluginOptions:
    """``kv_dtype``: ``"bf16"`` (16-bit passthrough in our page layout) or ``"int2"`` (our
    three-tier format); ``rotations``: the artifact (a directory or ``.safetensors`` file; INT2
    only; default: a ``rotations.safetensors`` inside the model directory); ``absorb_v`` (INT2):
    fold ``R_V`` into ``qkv_proj`` at load (needs ``load_format="oscarkv"``, :mod:`.loader`),
    as our engine does by default; ``False`` rotates values on write instead."""

    kv_dtype: str = "bf16"
    rotations: str | None = None
    absorb_v: bool = True

    def __post_init__(self) -> None:
        if self.kv_dtype not in _KV_DTYPES:
            raise InputError(f"oscarkv: kv_dtype must be one of {_KV_DTYPES}, got {self.kv_dtype!r}")
        if self.rotations is not None and self.kv_dtype != "int2":
            raise InputError(
                f"oscarkv: kv_dtype={self.kv_dtype!r} keeps every token in 16 bits and uses no "
                f"rotations; got rotations={self.rotations!r}",
                hint="drop 'rotations', or set kv_dtype='int2'",
            )
        if not isinstance(self.absorb_v, bool):
            raise InputError(f"oscarkv: absorb_v must be true or false, got {self.absorb_v!r}")

    @classmethod
    def from_additional_config(cls, extra: Any) -> PluginOptions | None:
        """``None`` when the run did not opt in (no ``"oscarkv"`` key)."""
        if not isinstance(extra, dict) or KEY not in extra:
            return None
        raw = extra[KEY]
        if raw is True or raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise InputError(f"oscarkv: additional_config['oscarkv'] must be a dict, got {raw!r}")
        unknown = sorted(set(raw) - set(_KNOWN))
        if unknown:
            raise InputError(
                f"oscarkv: unknown option(s) {unknown} in additional_config['oscarkv']; "
                f"known: {', '.join(_KNOWN)}"
            )
        if "absorb_v" in raw and raw.get("kv_dtype", "bf16") != "int2":
            raise InputError(
                "oscarkv: absorb_v applies to kv_dtype='int2' only (16-bit passthrough uses no rotations)"
            )
        return cls(**raw)
