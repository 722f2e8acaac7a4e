"""Our page layout inside the raw page buffer that vLLM allocates for a layer.

The backend's ``customize_spec`` publishes ``num_head_slots=1`` and
``state_content_bytes=token_bytes`` (``vllm/v1/kv_cache_interface.py:522-527``), so vLLM sizes
each page as ``block_size * token_bytes`` and hands the layer a ``[num_blocks, 1, block_size,
C]`` view (``create_kv_cache_views``, same file, line 377). How the ``C`` bytes of one token
are laid out is ours. Passthrough: token-major ``[2 (K, V), H_kv, d]`` in the model dtype, the
16-bit tier's row layout of our engine (``[slots, H_kv, d]`` per K and V).
"""

from __future__ import annotations

import torch

__all__ = ["hp_token_bytes", "int2_token_bytes", "page_rows", "write_rows"]


def hp_token_bytes(num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes one token occupies in one layer in the 16-bit layout (K and V)."""
    return 2 * num_kv_heads * head_dim * elem_bytes


def int2_token_bytes(num_kv_heads: int, head_dim: int, groups: int = 1, meta_bytes: int = 2) -> int:
    """Bytes one token would occupy in one layer as INT2 rows (K and V): ``d/4`` code bytes plus
    ``groups`` (scale, zero) pairs per (token, head) row (``docs/kv_format.md``)."""
    return 2 * num_kv_heads * (head_dim // 4 + 2 * groups * meta_bytes)


def page_rows(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """View a layer's ``[num_blocks, 1, block_size, 2*H*d]`` cache as ``[num_blocks,
    block_size, 2, H, d]`` (no copy; the block stride may be anything)."""
    _, slots, _, c = kv_cache.shape
    if slots != 1 or c != 2 * num_kv_heads * head_dim:
        raise RuntimeError(
            f"oscarkv: unexpected KV page view {tuple(kv_cache.shape)}; expected "
            f"[blocks, 1, block_size, {2 * num_kv_heads * head_dim}] (customize_spec not applied?)"
        )
    return kv_cache[:, 0].unflatten(-1, (2, num_kv_heads, head_dim))


def write_rows(
    pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` ``[T, H, d]`` at flat slots ``block * block_size + offset``;
    slots ``< 0`` (padding) are skipped."""
    bs = pages.shape[1]
    slots = slot_mapping[: key.shape[0]].long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[: keep.numel()][keep], value[: keep.numel()][keep]
    blk, off = slots // bs, slots % bs
    pages[blk, off, 0] = key.to(pages.dtype)
    pages[blk, off, 1] = value.to(pages.dtype)
