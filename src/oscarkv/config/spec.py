"""`QuantSpec`: how keys and values are stored (bit widths, groups, windows, clips, codebook)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import SpecError, field_error, help_field, is_int, is_num, packed_bytes, short_repr

__all__ = [
    "CODEBOOKS",
    "MAX_DEMOTE_BLOCK",
    "MAX_GROUP_SIZE",
    "MAX_WINDOW_TOKENS",
    "META_DTYPE_BYTES",
    "WINDOW_DTYPES",
    "WINDOW_DTYPE_BITS",
    "QuantSpec",
]

#: bytes per stored scale or zero, by ``QuantSpec.meta_dtype``
META_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
SUPPORTED_BITS = (2, 3, 4)
CODEBOOKS = ("uniform", "lloyd_max")
#: storage of the sink and recent ring (``QuantSpec.window_dtype``): "model" = the model's dtype,
#: "fp8_e4m3" = float8_e4m3fn without a scale (writes saturate to ±448)
WINDOW_DTYPES = ("model", "fp8_e4m3")
#: nominal bits per window element (the model dtype counts as 16, as OSCAR's formula does)
WINDOW_DTYPE_BITS = {"model": 16, "fp8_e4m3": 8}
#: upper bounds that keep a spec (possibly read from an artifact) from asking for absurd memory
MAX_WINDOW_TOKENS = 1 << 20
MAX_DEMOTE_BLOCK = 4096
MAX_GROUP_SIZE = 4096
_WHY_WINDOWS = "(the unquantized windows are allocated up front for every layer)"


@dataclass(frozen=True)
class QuantSpec:
    """How keys and values are stored: bit widths, groups, windows, clipping, codebook.

    Defaults reproduce OSCAR's evaluated configuration (spec §3-§5) with 16-bit metadata.
    """

    key_bits: int = help_field("bits per key element in the quantized tier (2, 3 or 4)", default=2)
    value_bits: int = help_field("bits per value element in the quantized tier (2, 3 or 4)", default=2)
    group_size: int | None = help_field(
        "elements per (scale, zero) pair along the rotated head dim; default: the head dim",
        default=None,
    )
    sink_tokens: int = help_field(
        "first prompt tokens kept unquantized, in --window-dtype (attention sink)", default=64
    )
    recent_tokens: int = help_field("most recent tokens kept unquantized, in --window-dtype", default=256)
    demote_block: int = help_field(
        "recent tokens are demoted to the quantized tier in blocks of this many", default=8
    )
    k_clip: float = help_field("per-row key clip ratio in [0, 1] (0 = off)", default=0.96)
    v_clip: float = help_field("per-row value clip ratio in [0, 1] (0 = off)", default=0.92)
    codebook: str = help_field("uniform (min-max) or lloyd_max (OSCAR's hybrid)", default="uniform")
    meta_dtype: str = help_field("dtype of the stored scale and zero: fp16, bf16 or fp32", default="fp16")
    window_dtype: str = help_field(
        "storage of the sink and recent window: model (the model's dtype) or fp8_e4m3 "
        "(float8_e4m3fn, no scale, saturating at ±448: 1 byte per element)",
        default="model",
    )

    def __post_init__(self) -> None:
        name = type(self).__name__
        for f in ("key_bits", "value_bits"):
            v = getattr(self, f)
            if not is_int(v) or v not in SUPPORTED_BITS:
                raise field_error(name, f, "one of 2, 3, 4", v, True)
        gs = self.group_size
        if gs is not None and (not is_int(gs) or not 4 <= gs <= MAX_GROUP_SIZE):
            raise field_error(
                name, "group_size", f"None (= head dim) or an integer in [4, {MAX_GROUP_SIZE}]", gs, True
            )
        for f in ("sink_tokens", "recent_tokens"):
            v = getattr(self, f)
            if not is_int(v) or not 0 <= v <= MAX_WINDOW_TOKENS:
                raise field_error(name, f, f"an integer in [0, {MAX_WINDOW_TOKENS}] {_WHY_WINDOWS}", v, True)
        db = self.demote_block
        if not is_int(db) or not 1 <= db <= MAX_DEMOTE_BLOCK:
            raise field_error(
                name, "demote_block", f"an integer in [1, {MAX_DEMOTE_BLOCK}] {_WHY_WINDOWS}", db, True
            )
        for f in ("k_clip", "v_clip"):
            v = getattr(self, f)
            if not is_num(v) or not math.isfinite(v) or not 0.0 <= v <= 1.0:
                raise field_error(name, f, "a number in [0, 1] (0 disables clipping)", v, True)
        if not isinstance(self.codebook, str) or self.codebook not in CODEBOOKS:
            raise field_error(name, "codebook", "one of " + ", ".join(CODEBOOKS), self.codebook, True)
        if self.codebook == "lloyd_max" and (self.key_bits != 2 or self.value_bits != 2):
            raise field_error(
                name,
                "codebook",
                "'uniform' when key_bits/value_bits are not 2 "
                "(OSCAR's Lloyd-Max hybrid is defined for INT2 only)",
                self.codebook,
            )
        if not isinstance(self.meta_dtype, str) or self.meta_dtype not in META_DTYPE_BYTES:
            raise field_error(name, "meta_dtype", "one of fp16, bf16, fp32", self.meta_dtype, True)
        if not isinstance(self.window_dtype, str) or self.window_dtype not in WINDOW_DTYPES:
            raise field_error(
                name, "window_dtype", "one of " + ", ".join(WINDOW_DTYPES), self.window_dtype, True
            )

    # ---- derived quantities -------------------------------------------------------------
    def group_for(self, head_dim: int) -> int:
        """The group size for ``head_dim``; raises if it does not divide the head dim."""
        if head_dim % 4:
            raise SpecError(f"head_dim must be a multiple of 4 for packing; got {head_dim}")
        g = head_dim if self.group_size is None else self.group_size
        if head_dim % g:
            raise field_error(
                "QuantSpec", "group_size", f"a divisor of the head dim {head_dim}", self.group_size
            )
        return g

    def row_bytes(self, head_dim: int, bits: int) -> int:
        """Stored bytes of one quantized row: packed codes + (scale, zero) per group."""
        groups = head_dim // self.group_for(head_dim)
        return packed_bytes(head_dim, bits) + 2 * groups * META_DTYPE_BYTES[self.meta_dtype]

    def quantized_bits_per_element(self, head_dim: int = 128) -> float:
        """Bits per element of the quantized tier alone, K and V averaged (2.25 for INT2/fp16)."""
        total = self.row_bytes(head_dim, self.key_bits) + self.row_bytes(head_dim, self.value_bits)
        return total * 8 / (2 * head_dim)

    @property
    def window_bits(self) -> int:
        """Nominal bits per sink/recent-window element: 16 for the model dtype, 8 for fp8_e4m3."""
        return WINDOW_DTYPE_BITS[self.window_dtype]

    def bits_per_element(
        self, context_len: int | None = None, head_dim: int = 128, hp_bits: int | None = None
    ) -> float:
        """Effective bits per cached K/V element at ``context_len`` tokens (spec §4.4).

        ``None`` gives the quantized tier alone. Otherwise the first ``sink_tokens`` and last
        ``recent_tokens`` tokens count at ``hp_bits`` (default :attr:`window_bits`: 16, or 8 with
        fp8 windows) and the rest at the quantized tier's cost measured from its storage sizes.
        Like OSCAR's formula, it ignores the up to ``demote_block - 1`` extra recent tokens
        between demotions.
        """
        q = self.quantized_bits_per_element(head_dim)
        if context_len is None:
            return q
        if context_len <= 0:
            raise field_error("bits_per_element", "context_len", "a positive integer", context_len)
        bits = self.window_bits if hp_bits is None else hp_bits
        hp = min(context_len, self.sink_tokens + self.recent_tokens)
        return (hp * bits + (context_len - hp) * q) / context_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantSpec:
        """Strict: unknown keys and wrong value types raise :class:`SpecError`."""
        if not isinstance(d, Mapping):
            raise SpecError(f"a QuantSpec must be a mapping of field names to values; got {short_repr(d)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(d) - known))
        if unknown:
            raise SpecError(f"unknown QuantSpec fields {unknown}; known: {sorted(known)}")
        return cls(**d)
