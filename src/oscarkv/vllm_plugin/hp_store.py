"""The per-request 16-bit store (sink + recent ring) as a companion vLLM "layer".

vLLM gives an attention layer one KV cache spec, and its pages are per position; the 16-bit
tiers need a private, fixed-size area per running request instead. vLLM has exactly that for
its own compressor state caches: a module that registers itself in the static forward context
with a ``CircularBufferSpec`` (one block per request for the request's lifetime, no prefix
caching; ``vllm/v1/kv_cache_interface.py:909``, manager at
``vllm/v1/core/single_type_kv_cache_manager.py:1173``; in-tree user:
``vllm/models/deepseek_v41/compressor.py:139``). One :class:`HPStore` per attention layer
gives that layer ``capacity`` token-major 16-bit rows ``[2 (K, V), H_kv, d]`` per request (one
head slot per token, as the INT2 pages: ``[blocks, 1, capacity, 2*H*d]``); the layer's forward
finds the request's block in ``attn_metadata[store_name].block_table[i, 0]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheSpec

__all__ = ["SUFFIX", "HPStore", "HPStoreBackend", "HPStoreMetadata"]

SUFFIX = ".oscarkv_hp"


@dataclass
class HPStoreMetadata:
    """``block_table[i, 0]``: the private block of batch row ``i``."""

    block_table: torch.Tensor
    query_start_loc: torch.Tensor


class HPStoreBuilder(AttentionMetadataBuilder):
    """Hands the group's one-block-per-request table to the attention layer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # abstract in the base class
        super().__init__(*args, **kwargs)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> HPStoreMetadata:
        m = common_attn_metadata
        return HPStoreMetadata(
            block_table=m.block_table_tensor[: m.num_reqs], query_start_loc=m.query_start_loc
        )


class HPStoreBackend(AttentionBackend):
    """A bookkeeping backend: it runs no attention, it only names the builder."""

    @staticmethod
    def get_name() -> str:
        return "OSCARKV_HP_STORE"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_impl_cls() -> Any:
        raise NotImplementedError("the oscarkv 16-bit store runs no attention of its own")

    @staticmethod
    def get_builder_cls() -> type[HPStoreBuilder]:
        return HPStoreBuilder


class HPStore(nn.Module, AttentionLayerBase):
    """``capacity`` 16-bit (K, V) token rows per request for one attention layer."""

    def __init__(self, prefix: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int):
        super().__init__()
        self.prefix = prefix
        self.num_kv_heads, self.head_dim, self.dtype, self.capacity = num_kv_heads, head_dim, dtype, capacity
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"oscarkv: duplicate layer name {prefix}")
        ctx[prefix] = self

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache  # [blocks, 1, capacity (or more), 2*H_kv*d]

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        del vllm_config
        spec = CircularBufferSpec(
            block_size=self.capacity,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )
        row = 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return replace(spec, num_head_slots=1, state_content_bytes=row)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return HPStoreBackend

    def forward(self) -> None:  # never called: the attention layer reads and writes the store
        raise NotImplementedError
