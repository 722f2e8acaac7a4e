"""Our page layout inside the raw page buffer that vLLM allocates for a layer.

The backend's ``customize_spec`` publishes ``num_head_slots=1`` and
``state_content_bytes=token_bytes`` (``vllm/v1/kv_cache_interface.py:522-527``), so vLLM sizes
each page as ``block_size * token_bytes`` and hands the layer a ``[num_blocks, 1, block_size,
C]`` view (``create_kv_cache_views``, same file, line 377). How the ``C`` bytes of one token
are laid out is ours. Passthrough: token-major ``[2 (K, V), H_kv, d]`` in the model dtype, the
16-bit tier's row layout of our engine (``[slots, H_kv, d]`` per K and V). INT2: each token's
row pair is ``[k_meta | v_meta | k_codes | v_codes]`` (metadata first, so it stays aligned),
padded to a multiple of 4 bytes.

Our kernels take one layer's rows as flat tensors indexed by a slot id. :func:`flat_rows` views
a page buffer that way: slot ``block * rows_per_block + offset``, where ``rows_per_block`` is
the block stride in rows (vLLM may place other layers' pages in between; those rows are never
addressed).
"""

from __future__ import annotations

import torch

from ..config import META_DTYPE_BYTES
from ..quant import RowFormat

__all__ = [
    "flat_rows",
    "hp_token_bytes",
    "int2_pools",
    "int2_row_bytes",
    "int2_token_bytes",
    "page_rows",
    "store_pools",
    "write_rows",
]

_META = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def hp_token_bytes(num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes one token occupies in one layer in the 16-bit layout (K and V)."""
    return 2 * num_kv_heads * head_dim * elem_bytes


def int2_token_bytes(num_kv_heads: int, head_dim: int, groups: int = 1, meta_bytes: int = 2) -> int:
    """Bytes one token would occupy in one layer as INT2 rows (K and V): ``d/4`` code bytes plus
    ``groups`` (scale, zero) pairs per (token, head) row (``docs/kv_format.md``)."""
    return 2 * num_kv_heads * (head_dim // 4 + 2 * groups * meta_bytes)


def int2_row_bytes(num_kv_heads: int, k_fmt: RowFormat, v_fmt: RowFormat) -> int:
    """Bytes of one token's INT2 K and V rows in one layer (codes and metadata), padded to 4."""
    meta = META_DTYPE_BYTES[k_fmt.meta_dtype] * 2 * (k_fmt.groups + v_fmt.groups)
    n = num_kv_heads * (meta + k_fmt.packed_dim + v_fmt.packed_dim)
    return -(-n // 4) * 4


def flat_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A layer's ``[blocks, 1, block_size, C]`` page view as ``([rows, C], rows_per_block)``, no
    copy: slot ``block * rows_per_block + offset``."""
    nb, slots, bs, c = kv_cache.shape
    sb, _, st, se = kv_cache.stride()
    if slots != 1 or st != c or se != 1 or sb % c:
        raise RuntimeError(
            f"oscarkv: KV pages {tuple(kv_cache.shape)} with strides {kv_cache.stride()} are not "
            "token-major rows (customize_spec not applied, or an unexpected KV cache layout)"
        )
    rpb = sb // c
    rows = torch.as_strided(kv_cache, ((nb - 1) * rpb + bs, c), (c, 1), kv_cache.storage_offset())
    return rows, rpb


def int2_pools(rows: torch.Tensor, heads: int, k_fmt: RowFormat, v_fmt: RowFormat) -> dict[str, torch.Tensor]:
    """The INT2 views of flat uint8 ``rows [N, C]`` (:func:`flat_rows`) for one layer's formats."""
    mb = META_DTYPE_BYTES[k_fmt.meta_dtype]
    out, at = {}, 0
    for name, width, shape in (
        ("k_meta", heads * k_fmt.groups * 2 * mb, (heads, k_fmt.groups, 2)),
        ("v_meta", heads * v_fmt.groups * 2 * mb, (heads, v_fmt.groups, 2)),
        ("k_codes", heads * k_fmt.packed_dim, (heads, k_fmt.packed_dim)),
        ("v_codes", heads * v_fmt.packed_dim, (heads, v_fmt.packed_dim)),
    ):
        part = rows[:, at : at + width]
        if name.endswith("meta"):
            part = part.view(_META[k_fmt.meta_dtype])
        out[name], at = part.unflatten(-1, shape), at + width
    if at > rows.shape[1]:
        raise RuntimeError(f"oscarkv: INT2 rows of {rows.shape[1]} bytes cannot hold {at}")
    return out


def store_pools(rows: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hp_k, hp_v)`` ``[Nh, H, d]`` views of the 16-bit store's flat rows ``[Nh, 2*H*d]``."""
    kv = rows.unflatten(-1, (2, heads, head_dim))
    return kv[:, 0], kv[:, 1]


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
