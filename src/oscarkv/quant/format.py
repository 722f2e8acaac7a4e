"""The stored row format: clip -> quantize -> pack, and its inverse (spec §3-§4).

A :class:`RowFormat` is what one K or V tier needs to know to write and read rows; build it
from a :class:`~oscarkv.config.QuantSpec` with :meth:`RowFormat.from_spec` (its K or V side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import QuantSpec
from .packing import pack, packed_dim, unpack
from .quantizer import (
    clip_rows,
    dequantize_affine,
    dequantize_codebook,
    quantize_asymmetric,
    quantize_lloyd_max,
    quantize_symmetric,
)

__all__ = ["QUANTIZERS", "RowFormat", "dequantize_rows", "fake_quantize_rows", "quantize_rows"]

#: quantizer name -> how codes are read back ("affine" or "codebook")
QUANTIZERS = {
    "asymmetric": "affine",
    "symmetric": "affine",
    "lloyd_max": "affine",  # OSCAR's hybrid stores affine (scale, zero)
    "lloyd_max_centroid": "codebook",
}


@dataclass(frozen=True)
class RowFormat:
    """Format of one quantized tier (K or V) for rows of ``head_dim`` elements."""

    head_dim: int
    bits: int = 2
    group: int = 128
    clip: float = 0.0
    quantizer: str = "asymmetric"
    meta_dtype: str = "fp16"

    def __post_init__(self) -> None:
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {sorted(QUANTIZERS)}; got {self.quantizer!r}")
        packed_dim(self.head_dim, self.bits)
        if self.head_dim % self.group:
            raise ValueError(f"group {self.group} must divide head_dim {self.head_dim}")

    @property
    def groups(self) -> int:
        return self.head_dim // self.group

    @property
    def packed_dim(self) -> int:
        return packed_dim(self.head_dim, self.bits)

    @classmethod
    def from_spec(
        cls,
        spec: QuantSpec,
        head_dim: int,
        kind: str,
        clip: float | None = None,
        quantizer: str | None = None,
        bits: int | None = None,
    ):
        """``kind`` is ``"k"`` or ``"v"``; ``clip`` overrides the spec's (per-layer clips),
        ``quantizer`` the spec's codebook (the evaluation baselines use it), ``bits`` the spec's
        width (per-layer key bits)."""
        if kind not in ("k", "v"):
            raise ValueError(f"kind must be 'k' or 'v'; got {kind!r}")
        if bits is None:
            bits = spec.key_bits if kind == "k" else spec.value_bits
        default_clip = spec.k_clip if kind == "k" else spec.v_clip
        if quantizer is None:
            quantizer = "lloyd_max" if spec.codebook == "lloyd_max" else "asymmetric"
        return cls(
            head_dim=head_dim,
            bits=bits,
            group=spec.group_for(head_dim),
            clip=default_clip if clip is None else clip,
            quantizer=quantizer,
            meta_dtype=spec.meta_dtype,
        )


def _quantize(x: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] != fmt.head_dim:
        raise ValueError(f"rows have last dim {x.shape[-1]}, format expects {fmt.head_dim}")
    xc = clip_rows(x.float(), fmt.clip)
    if fmt.quantizer == "asymmetric":
        return quantize_asymmetric(xc, fmt.bits, fmt.group, fmt.meta_dtype)
    if fmt.quantizer == "symmetric":
        return quantize_symmetric(xc, fmt.bits, fmt.group, fmt.meta_dtype)
    mode = "centroid" if fmt.quantizer == "lloyd_max_centroid" else "hybrid"
    return quantize_lloyd_max(xc, fmt.bits, fmt.group, fmt.meta_dtype, mode=mode)


def _dequantize(q: torch.Tensor, meta: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    if QUANTIZERS[fmt.quantizer] == "codebook":
        return dequantize_codebook(q, meta, fmt.bits)
    return dequantize_affine(q, meta)


def quantize_rows(x: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip, quantize and pack rows.

    Args:
        x: float ``[..., head_dim]`` rows, already in the rotated basis.
    Returns:
        ``codes`` uint8 ``[..., packed_dim]`` and ``meta`` ``[..., groups, 2]`` (scale, zero)
        in ``fmt.meta_dtype``.
    """
    codes, meta = _quantize(x, fmt)
    return pack(codes, fmt.bits), meta


def dequantize_rows(codes: torch.Tensor, meta: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """Unpack and dequantize: uint8 ``[..., packed_dim]`` + meta -> float32 ``[..., head_dim]``."""
    return _dequantize(unpack(codes, fmt.bits, fmt.head_dim), meta, fmt)


def fake_quantize_rows(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """``dequantize_rows(*quantize_rows(x, fmt), fmt)`` without the (lossless) packing step."""
    return _dequantize(*_quantize(x, fmt), fmt)
