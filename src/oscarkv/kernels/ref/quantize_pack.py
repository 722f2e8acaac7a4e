"""Torch twin of ``kernels/triton/quantize_pack.py``: clip, quantize and pack rotated rows."""

from __future__ import annotations

import torch

from ...quant import RowFormat, dequantize_rows, quantize_rows

__all__ = ["dequantize", "quantize_pack"]


def quantize_pack(
    rows: torch.Tensor, fmt: RowFormat, tuning: object | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip per row, quantize per group and pack rotated rows (fp32 math).

    Args:
        rows: ``[N, H, d]`` float rows (model dtype) in the rotated basis, one per (token, KV head).
        fmt: bits, group, clip ratio, quantizer and metadata dtype.
        tuning: the Triton twin's launch settings; nothing to tune here.
    Returns:
        ``codes`` uint8 ``[N, H, packed_dim]`` and ``meta`` ``[N, H, groups, 2]`` (scale, zero).
    """
    return quantize_rows(rows.float(), fmt)


def dequantize(
    codes: torch.Tensor, meta: torch.Tensor, fmt: RowFormat, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_pack` in the rotated basis: ``[N, H, packed]`` -> ``[N, H, d]``."""
    return dequantize_rows(codes, meta, fmt).to(out_dtype)
