"""Torch twin of ``kernels/triton/quantize_pack.py``: rotate, clip, quantize and pack rows."""

from __future__ import annotations

import torch

from ...quant import RowFormat, dequantize_rows, quantize_rows
from ...rotation import rotate_heads

__all__ = ["dequantize", "quantize_pack"]


def quantize_pack(
    rows: torch.Tensor, rotation: torch.Tensor | None, fmt: RowFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (optional), clip per row, quantize per group and pack (fp32 math).

    Args:
        rows: ``[N, H, d]`` float rows (model dtype), one per (token, KV head).
        rotation: ``[d, d]``, ``[H, d, d]`` or ``None`` when ``rows`` are already rotated.
        fmt: bits, group, clip ratio, quantizer and metadata dtype.
    Returns:
        ``codes`` uint8 ``[N, H, packed_dim]`` and ``meta`` ``[N, H, groups, 2]`` (scale, zero).
    """
    x = rows.float()
    if rotation is not None:
        x = rotate_heads(x.transpose(0, 1)[None], rotation.float())[0].transpose(0, 1)
    return quantize_rows(x, fmt)


def dequantize(
    codes: torch.Tensor, meta: torch.Tensor, fmt: RowFormat, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_pack` in the rotated basis: ``[N, H, packed]`` -> ``[N, H, d]``."""
    return dequantize_rows(codes, meta, fmt).to(out_dtype)
