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


@dataclass(frozen=True)
class PluginOptions:
    """``kv_dtype``: ``"bf16"`` (16-bit passthrough in our page layout) or ``"int2"`` (not yet
    implemented under vLLM); ``rotations``: the artifact directory (INT2 only); ``hp_store``:
    also allocate the per-request 16-bit store of ``hp_capacity`` tokens per layer
    (:mod:`.hp_store`; allocated and addressed, not yet used)."""

    kv_dtype: str = "bf16"
    rotations: str | None = None
    hp_store: bool = False
    hp_capacity: int = 384

    def __post_init__(self) -> None:
        if self.kv_dtype not in _KV_DTYPES:
            raise InputError(f"oscarkv: kv_dtype must be one of {_KV_DTYPES}, got {self.kv_dtype!r}")
        if self.hp_capacity < 1:
            raise InputError(f"oscarkv: hp_capacity must be positive, got {self.hp_capacity}")
        if self.kv_dtype == "int2":
            raise InputError(
                "oscarkv: kv_dtype='int2' is not implemented under vLLM yet; this prototype "
                "supports kv_dtype='bf16' (16-bit passthrough) only",
                hint="see docs/vllm.md, 'What the INT2 path needs'",
            )

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
        unknown = sorted(set(raw) - {"kv_dtype", "rotations", "hp_store", "hp_capacity"})
        if unknown:
            raise InputError(f"oscarkv: unknown option(s) {unknown} in additional_config['oscarkv']")
        return cls(**raw)
