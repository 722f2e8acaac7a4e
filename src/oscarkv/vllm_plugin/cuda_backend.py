"""The attention backend for vLLM's CUDA platform: ``--attention-backend CUSTOM``.

**Never run**: vLLM's CUDA wheel does not fit our GPU machine, so this module has only been
imported and inspected on CPU. :func:`oscarkv.vllm_plugin.register` points vLLM's placeholder
member ``AttentionBackendEnum.CUSTOM`` here (``vllm/v1/attention/backends/registry.py:158``);
the CUDA platform honours an explicitly selected backend after ``validate_configuration``
(``vllm/platforms/cuda.py:418-446``), and never picks ``CUSTOM`` by itself. The run must also
opt in with ``additional_config["oscarkv"]``; this backend refuses to start without it.

Everything else is what the CPU backend runs when enabled (:mod:`.common`): the same KV spec,
the same passthrough and INT2 paths, and :class:`~oscarkv.store.TierAttention`,
whose kernels resolve to our Triton kernels on CUDA (``kernels.resolve("auto", device)`` in
:mod:`.int2_layer`). Steps plan on the host, so the builder declares no CUDA-graph support.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from ..errors import InputError
from .common import OscarImplMixin, OscarSpecMixin, StepMetadata, enabled_options, step_metadata

__all__ = ["OscarCudaAttentionBackend", "OscarCudaAttentionImpl", "OscarCudaMetadataBuilder"]


class OscarCudaMetadataBuilder(AttentionMetadataBuilder[StepMetadata]):
    """:class:`StepMetadata` in every mode (``_cudagraph_support`` stays ``NEVER``)."""

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> StepMetadata:
        return step_metadata(common_attn_metadata)


class OscarCudaAttentionBackend(OscarSpecMixin, AttentionBackend):
    """Our KV format on vLLM's CUDA platform (decoder self-attention, ``--kv-cache-dtype auto``)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the layer maps the name back to the enum member (attention.py:433)

    @staticmethod
    def get_impl_cls() -> type[OscarCudaAttentionImpl]:
        return OscarCudaAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OscarCudaMetadataBuilder]:
        return OscarCudaMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class OscarCudaAttentionImpl(OscarImplMixin, AttentionImpl[StepMetadata]):
    """Our passthrough or INT2 attention; refuses to start without the opt-in."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.alibi_slopes, self.sliding_window = alibi_slopes, sliding_window
        self.kv_cache_dtype, self.logits_soft_cap, self.attn_type = kv_cache_dtype, logits_soft_cap, attn_type
        self.kv_sharing_target_layer_name, self.sinks = kv_sharing_target_layer_name, sinks
        if kv_sharing_target_layer_name is not None:
            raise InputError("oscarkv under vLLM does not support KV sharing between layers")
        self.opts = enabled_options()
        if self.opts is None:
            raise InputError(
                "oscarkv: --attention-backend CUSTOM is oscarkv's backend and needs "
                """--additional-config '{"oscarkv": {...}}' (docs/vllm.md)"""
            )
        self._enable()

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self._build_int2(act_dtype)
