"""Torch twin of ``kernels/triton/quantize_pack.py``: clip, quantize and pack rotated rows."""

from __future__ import annotations

import torch

from ...quant import RowFormat, dequantize_rows, quantize_rows
from ...quant.quantizer import META_TORCH_DTYPES

__all__ = ["check_into", "dequantize", "quantize_pack", "quantize_pack_into"]


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


def quantize_pack_into(
    rows: torch.Tensor,
    fmt: RowFormat,
    codes: torch.Tensor,
    meta: torch.Tensor,
    dst: torch.Tensor,
    src: torch.Tensor | None = None,
    tuning: object | None = None,
) -> None:
    """:func:`quantize_pack` of ``rows[src]`` (``src`` int ``[N]``, or ``None``: ``rows`` ``[N, H, d]``
    themselves) stored in place at ``codes[dst]`` / ``meta[dst]`` (``dst`` int ``[N]``, distinct
    slots): a demotion (16-bit pool rows into INT2 slots) or a prefill's INT2 write in one op.
    ``codes``/``meta`` are the pools ``[S, H, packed_dim]`` / ``[S, H, groups, 2]`` (the format's
    metadata dtype), at any token and head strides with whole 4-byte words per code row."""
    check_into(rows, fmt, codes, meta, dst, src)
    c, m = quantize_pack(rows if src is None else rows[src.long()], fmt)
    codes[dst.long()], meta[dst.long()] = c, m


def check_into(rows, fmt: RowFormat, codes, meta, dst, src) -> None:
    """Raises ``ValueError`` naming the first argument of ``quantize_pack_into`` that does not fit."""
    n = dst.shape[0] if dst.dim() == 1 else -1
    h = rows.shape[1] if rows.dim() == 3 else -1
    want_meta = META_TORCH_DTYPES[fmt.meta_dtype]
    bad_rows = rows.dim() != 3 or rows.shape[2] != fmt.head_dim
    bad_idx = n < 0 or (src is None and rows.shape[0] != n) or (src is not None and src.shape != (n,))
    # any token and head strides (vLLM's pages interleave the pools), whole 4-byte words per row
    bad_codes = (codes.shape[1:] != (h, fmt.packed_dim) or codes.dtype != torch.uint8 or codes.stride(-1) != 1
                 or codes.stride(0) % 4 or codes.stride(1) % 4 or codes.storage_offset() % 4)  # fmt: skip
    bad_meta = meta.shape[1:] != (h, fmt.groups, 2) or meta.dtype != want_meta or meta.stride(-1) != 1
    problems = [
        (bad_rows, f"rows must be [N, H, {fmt.head_dim}]"),
        (bad_idx, "dst must be [N] and src [N] (or None with N rows)"),
        (bad_codes, f"codes must be a uint8 pool [S, {h}, {fmt.packed_dim}] of whole 4-byte words per row"),
        (
            bad_meta,
            f"meta must be a {str(want_meta)[6:]} pool [S, {h}, {fmt.groups}, 2] with a unit last stride",
        ),
    ]
    for bad, msg in problems:
        if bad:
            raise ValueError(f"quantize_pack_into: {msg}; got rows {list(rows.shape)}, codes {list(codes.shape)} "
                             f"{codes.dtype}, meta {list(meta.shape)} {meta.dtype}, dst {list(dst.shape)}")  # fmt: skip
