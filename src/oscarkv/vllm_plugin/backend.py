"""The attention backend vLLM's CPU platform runs once :func:`oscarkv.vllm_plugin.register`
has pointed ``CPU_ATTN`` here.

Without ``additional_config["oscarkv"]`` every method defers to vLLM's ``CPU_ATTN`` classes, so
an install of ``oscarkv[vllm]`` changes nothing by itself. With it, our paths run
(:mod:`.common`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from .common import OscarImplMixin, OscarSpecMixin, StepMetadata, enabled_options, int2_state, step_metadata

__all__ = ["OscarCPUAttentionBackend", "OscarCPUAttentionImpl", "OscarMetadataBuilder"]


class OscarMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder, or in INT2 mode a plain one that builds :class:`StepMetadata`."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        self.int2 = int2_state() is not None
        if self.int2:
            AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        else:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> Any:
        if not self.int2:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        return step_metadata(common_attn_metadata)


class OscarCPUAttentionBackend(OscarSpecMixin, CPUAttentionBackend):
    """``CPU_ATTN`` with our page layout when enabled. ``get_name`` stays ``"CPU_ATTN"``: vLLM
    maps the name back to the enum (``attention.py:433``) and the CPU platform's checks key on it."""

    @staticmethod
    def get_impl_cls() -> type[OscarCPUAttentionImpl]:
        return OscarCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OscarMetadataBuilder]:
        return OscarMetadataBuilder


class OscarCPUAttentionImpl(OscarImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU impl when disabled; ours (passthrough or INT2) when enabled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        CPUAttentionBackendImpl.__init__(self, *args, **kwargs)
        self.opts, self.int2 = enabled_options(), None
        if self.opts is not None:
            self._enable()

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        self._build_int2(act_dtype)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.opts is None:
            return CPUAttentionBackendImpl.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)
        return OscarImplMixin.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | StepMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        impl = CPUAttentionBackendImpl if self.opts is None else OscarImplMixin
        return impl.forward(
            self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
