"""Bit packing of integer codes along the last dimension (documented in docs/kv_format.md).

All layouts split the row into equal contiguous parts and put element ``j`` of every part
into byte ``j`` of a plane, so unpacking is a handful of shifts and a concatenation (and a
GPU kernel reads one contiguous byte vector per plane):

* 2 bit, OSCAR's "quartered" order (spec §4.2): ``d/4`` bytes; byte j holds elements
  j, j+d/4, j+d/2, j+3d/4 in bits 1:0, 3:2, 5:4, 7:6.
* 4 bit, "halved" order: ``d/2`` bytes; byte j holds elements j and j+d/2 in bits 3:0, 7:4.
* 3 bit, two planes, ``3d/8`` bytes: the low two bits of every code in the 2-bit quartered
  layout (``d/4`` bytes), followed by the high bit in an "eighthed" plane (``d/8`` bytes;
  byte j holds bit 2 of elements j + i·d/8 at bit i, i = 0..7).
"""

from __future__ import annotations

import torch

__all__ = ["pack", "packed_dim", "unpack"]


def packed_dim(d: int, bits: int) -> int:
    """Packed bytes per row of ``d`` codes. ``d`` must be a multiple of 4 (8 for 3 bits)."""
    if bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4; got {bits}")
    need = 8 if bits == 3 else 4
    if d % need:
        raise ValueError(f"{bits}-bit packing needs the last dim to be a multiple of {need}; got {d}")
    return d * bits // 8


def _pack_parts(codes: torch.Tensor, parts: int, width: int) -> torch.Tensor:
    """Split the last dim into ``parts`` chunks; chunk i goes to bits [i*width, (i+1)*width)."""
    chunks = codes.to(torch.uint8).chunk(parts, dim=-1)
    out = chunks[0].clone()
    for i in range(1, parts):
        out |= chunks[i] << (i * width)
    return out


def _unpack_parts(packed: torch.Tensor, parts: int, width: int) -> torch.Tensor:
    mask = (1 << width) - 1
    return torch.cat([(packed >> (i * width)) & mask for i in range(parts)], dim=-1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)``.

    Args:
        codes: integer tensor ``[..., d]`` (any integer dtype), values in ``[0, 2**bits)``.
        bits: 2, 3 or 4.
    Returns:
        uint8 ``[..., packed_dim(d, bits)]``.
    """
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor; got {codes.dtype}")
    d = codes.shape[-1]
    packed_dim(d, bits)
    if bits == 2:
        return _pack_parts(codes, 4, 2)
    if bits == 4:
        return _pack_parts(codes, 2, 4)
    c = codes.to(torch.uint8)
    return torch.cat([_pack_parts(c & 3, 4, 2), _pack_parts(c >> 2, 8, 1)], dim=-1)


def unpack(packed: torch.Tensor, bits: int, d: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., packed_dim]`` -> uint8 codes ``[..., d]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8; got {packed.dtype}")
    n = packed.shape[-1]
    d = n * 8 // bits if d is None else d
    if packed_dim(d, bits) != n:
        raise ValueError(f"{n} packed bytes do not hold {d} codes of {bits} bits")
    if bits == 2:
        return _unpack_parts(packed, 4, 2)
    if bits == 4:
        return _unpack_parts(packed, 2, 4)
    lo, hi = packed.split([d // 4, d // 8], dim=-1)
    return _unpack_parts(lo, 4, 2) | (_unpack_parts(hi, 8, 1) << 2)
