"""Steps over one layer's flat slot pools: CSR lists, demote, write, gather (any slot layout).

A layer's pools are flat in the slot id: INT2 codes uint8 ``[Nq, H, packed_dim]`` and their
metadata ``[Nq, H, groups, 2]`` for K and V, and window rows ``[Nh, H, d]`` (sink and recent
window; the model dtype, or float8_e4m3fn with fp8 windows, ``quant.window``). With fp8 windows a
row's INT2 value is the quantization of its fp8 value however it reaches the INT2 tier (a
demotion reads the fp8 ring; an INT2 write rounds through fp8 first), so it depends on the token
alone, not on chunking or the path it took.
Where the slots sit (per-sequence regions, pages) is the caller's business. A step writes in
this order, which :func:`write_step` fixes: demotions, then INT2 writes, then 16-bit writes
(a 16-bit slot freed by a demotion may receive a new token in the same step).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..quant import RowFormat
from ..quant.window import is_fp8, through_window, to_window
from . import KernelOps

__all__ = ["FlatPools", "demote", "gather_prefix", "ranges_to_csr", "write_hp", "write_int2", "write_step"]


class FlatPools(Protocol):
    """One layer's pool tensors and formats (``hf.pools.LayerPools`` is one)."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_meta: torch.Tensor
    v_meta: torch.Tensor
    hp_k: torch.Tensor
    hp_v: torch.Tensor
    k_fmt: RowFormat
    v_fmt: RowFormat


def ranges_to_csr(ranges: list[list[tuple[int, int]]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-sequence lists of ``(start, length)`` -> ``(indptr int32 [B+1], indices int32)``.

    Only the ranges travel to ``device``; the indices are expanded there (a decode step's lists
    hold batch × context ids: building those on the host cost ~14 ms per list at batch 16 / 32K).
    """
    lens = [sum(n for _, n in r) for r in ranges]
    indptr = torch.zeros(len(ranges) + 1, dtype=torch.int32)
    if lens:
        indptr[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    flat = [(s, n) for r in ranges for s, n in r if n > 0]
    total = sum(lens)
    if not flat:
        return indptr.to(device), torch.zeros(0, dtype=torch.int32, device=device)
    # per range: its first slot minus the position of its first entry in the flat list
    spec = torch.tensor([(s, n) for s, n in flat], dtype=torch.int64)
    first = spec[:, 1].cumsum(0) - spec[:, 1]
    spec = torch.stack([spec[:, 0] - first, spec[:, 1]]).to(device, non_blocking=True)
    which = torch.repeat_interleave(torch.arange(len(flat), device=device), spec[1], output_size=total)
    idx = spec[0][which] + torch.arange(total, device=device)
    return indptr.to(device, non_blocking=True), idx.to(torch.int32)


def write_int2(
    pools: FlatPools, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ops: KernelOps
) -> None:
    """Quantize rotated rows ``k, v [N, H, d]`` into INT2 ``slots`` (long ``[N]``); with fp8
    windows the rows are rounded through fp8 first (what a demotion of them would quantize)."""
    if is_fp8(pools.hp_k.dtype):
        k, v = through_window(k, pools.hp_k.dtype), through_window(v, pools.hp_v.dtype)
    ops.quantize_pack_into(k, pools.k_fmt, pools.k_codes, pools.k_meta, slots)
    ops.quantize_pack_into(v, pools.v_fmt, pools.v_codes, pools.v_meta, slots)


def demote(pools: FlatPools, src: torch.Tensor, dst: torch.Tensor, ops: KernelOps) -> None:
    """Quantize the 16-bit rows of slots ``src`` into INT2 slots ``dst`` (long ``[N]`` each): one
    gather-quantize-scatter op each for K and V."""
    if src.numel():
        ops.quantize_pack_into(pools.hp_k, pools.k_fmt, pools.k_codes, pools.k_meta, dst, src)
        ops.quantize_pack_into(pools.hp_v, pools.v_fmt, pools.v_codes, pools.v_meta, dst, src)


def write_hp(pools: FlatPools, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store rotated rows ``k, v [N, H, d]`` in window ``slots`` (cast to the pool dtype; fp8
    saturates at ±448)."""
    pools.hp_k[slots] = to_window(k, pools.hp_k.dtype)
    pools.hp_v[slots] = to_window(v, pools.hp_v.dtype)


def write_step(
    pools: FlatPools,
    demote_src: torch.Tensor,
    demote_dst: torch.Tensor,
    q_slots: torch.Tensor,
    q_rows: tuple[torch.Tensor, torch.Tensor],
    hp_slots: torch.Tensor,
    hp_rows: tuple[torch.Tensor, torch.Tensor],
    ops: KernelOps,
) -> None:
    """One step's writes in the required order; ``q_rows``/``hp_rows`` are ``(k, v)`` ``[N, H, d]``."""
    demote(pools, demote_src, demote_dst, ops)
    if q_slots.numel():
        write_int2(pools, q_slots, *q_rows, ops)
    if hp_slots.numel():
        write_hp(pools, hp_slots, *hp_rows)


def gather_prefix(
    pools: FlatPools, int2_idx: torch.Tensor, hp_idx: torch.Tensor, ops: KernelOps, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V ``[P, H, d]`` in ``dtype`` (the model's: the window pools
    may be fp8): the rows of ``hp_idx`` then the dequantized rows of ``int2_idx`` (slot ids, any
    int dtype)."""
    qi, hi, dt = int2_idx.long(), hp_idx.long(), dtype
    k = torch.cat(
        [pools.hp_k[hi].to(dt), ops.dequantize(pools.k_codes[qi], pools.k_meta[qi], pools.k_fmt, dt)]
    )
    v = torch.cat(
        [pools.hp_v[hi].to(dt), ops.dequantize(pools.v_codes[qi], pools.v_meta[qi], pools.v_fmt, dt)]
    )
    return k, v
