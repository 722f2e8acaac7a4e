"""The attention backend vLLM's CPU platform runs once :func:`oscarkv.vllm_plugin.register`
has pointed ``CPU_ATTN`` here.

Without ``additional_config["oscarkv"]`` every method defers to vLLM's ``CPU_ATTN`` classes, so
an install of ``oscarkv[vllm]`` changes nothing by itself. With it:

* ``kv_dtype="bf16"``: the layer's KV pages hold our token-major 16-bit rows (:mod:`.layout`),
  written through vLLM's slot mapping and read through its block tables by our torch reference
  ``prefill_attention`` (``kernels/ref``), which also serves decode;
* ``kv_dtype="int2"``: the pages hold INT2 rows by position, a companion store
  (:mod:`.hp_store`) holds each request's 16-bit sink and ring, and :mod:`.int2_attn` runs our
  engine's attention over both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ..errors import InputError
from ..kernels.ref import prefill_attention
from .checks import Int2Setup, check_model, int2_setup
from .layout import hp_token_bytes, page_rows, write_rows
from .options import PluginOptions

__all__ = [
    "Int2Metadata",
    "OscarCPUAttentionBackend",
    "OscarCPUAttentionImpl",
    "OscarMetadataBuilder",
    "enabled_options",
    "int2_state",
]

logger = init_logger("vllm.plugins.oscarkv")  # under "vllm" so that vLLM's log handler prints it

# Set by the first layer built in this process (layers are built before vLLM asks the backend
# for the KV spec, in the same worker process); ``customize_spec`` is a classmethod with no
# config argument, so it reads the decision from here. One decision per process: two engines
# with different options in one process (in-process mode) are not supported.
_STATE: dict[str, Any] = {}


def enabled_options() -> PluginOptions | None:
    """This process's plug-in options (validated against the model), or ``None`` without opt-in."""
    if "opts" not in _STATE:
        cfg = get_current_vllm_config()
        opts = PluginOptions.from_additional_config(cfg.additional_config)
        if opts is not None:
            check_model(cfg, opts)
            if opts.kv_dtype == "int2":
                _STATE["int2"] = int2_setup(cfg, opts)
        _STATE["opts"] = opts
    return _STATE["opts"]


def int2_state() -> Int2Setup | None:
    """This process's INT2 setup (after :func:`enabled_options`), or ``None``."""
    return _STATE.get("int2")


@dataclass
class Int2Metadata:
    """What the INT2 path reads per step (host copies: it plans on the host)."""

    query_start_loc: list[int]
    seq_lens: list[int]
    is_prefilling: list[bool]
    block_table: torch.Tensor  # [reqs, max_blocks]


class OscarMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder, or in INT2 mode a plain one that also passes ``is_prefilling``."""

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
        m, n = common_attn_metadata, common_attn_metadata.num_reqs
        if m.is_prefilling is None:
            raise RuntimeError("oscarkv: this vLLM build passes no is_prefilling to attention builders")
        return Int2Metadata(
            m.query_start_loc_cpu[: n + 1].tolist(),
            m.seq_lens[:n].tolist(),
            m.is_prefilling[:n].tolist(),
            m.block_table_tensor[:n],
        )


class OscarCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with our page layout when enabled. ``get_name`` stays ``"CPU_ATTN"``: vLLM
    maps the name back to the enum (``attention.py:433``) and the CPU platform's checks key on it."""

    @staticmethod
    def get_impl_cls() -> type[OscarCPUAttentionImpl]:
        return OscarCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OscarMetadataBuilder]:
        return OscarMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """Enabled: one head slot per token whose content is our row pair (16-bit, or INT2 rows
        as uint8 bytes). Called by ``customize_attention_spec`` (``vllm/v1/worker/utils.py:476``)
        for every layer's ``AttentionSpec``."""
        spec = super().customize_spec(spec)
        if _STATE.get("opts") is None or spec.state_content_bytes is not None:
            return spec
        setup = int2_state()
        if setup is not None:
            logger.info_once(
                "oscarkv: KV pages hold INT2 rows (%d bytes per token per layer)", setup.row_bytes
            )
            return replace(spec, dtype=torch.uint8, num_head_slots=1, state_content_bytes=setup.row_bytes)
        logger.info_once("oscarkv: KV pages in the oscarkv 16-bit passthrough layout")
        row = hp_token_bytes(spec.num_kv_heads, spec.head_size, spec.dtype.itemsize)
        return replace(spec, num_head_slots=1, state_content_bytes=row)


class OscarCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU impl when disabled; ours (passthrough or INT2) when enabled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opts = enabled_options()
        self.int2: Any = None  # the layer's Int2Layer, built once its name is known
        if self.opts is None:
            return
        problems = []
        if self.attn_type != AttentionType.DECODER:
            problems.append(f"attention type {self.attn_type}")
        if self.sliding_window not in (-1, None):
            problems.append("sliding window")
        if self.alibi_slopes is not None:
            problems.append("ALiBi")
        if self.logits_soft_cap:
            problems.append("logit soft-capping")
        if self.sinks is not None:
            problems.append("learned attention sinks")
        if problems:
            raise InputError(f"oscarkv under vLLM does not support: {', '.join(problems)}")
        logger.info_once("oscarkv: attention enabled with %s", self.opts)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """After the model is loaded, before vLLM collects KV specs: in INT2 mode build the
        layer's attention (rotations, formats) and its companion 16-bit store."""
        super().process_weights_after_loading(act_dtype)
        setup = int2_state()
        if setup is None or self.int2 is not None:
            return
        from .int2_layer import build_int2_layer

        self.int2 = build_int2_layer(self, setup, act_dtype)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.opts is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self.int2 is not None:
            return None  # INT2: forward writes, since where a token goes depends on its tier
        pages = page_rows(kv_cache, self.num_kv_heads, self.head_size)
        write_rows(pages, key, value, slot_mapping)
        return None

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | Int2Metadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.opts is None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("oscarkv: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        if self.int2 is not None:
            store = get_forward_context().attn_metadata[self.int2.store.prefix]
            return self.int2.forward(query, key, value, kv_cache, attn_metadata, store.block_table, output)
        return self._passthrough(query, key, value, kv_cache, attn_metadata, output)

    def _passthrough(self, query, key, value, kv_cache, attn_metadata, output) -> torch.Tensor:
        pages = page_rows(kv_cache, self.num_kv_heads, self.head_size)
        bs = pages.shape[1]
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            a, b = starts[i], starts[i + 1]
            if b == a:
                continue
            prefix_len = seq_len - (b - a)
            n_blocks = -(-prefix_len // bs)
            blocks = attn_metadata.block_table[i, :n_blocks].long()
            rows = pages[blocks].flatten(0, 1)[:prefix_len]  # [P, 2, H, d], in position order
            output[a:b] = prefill_attention(
                query[a:b], rows[:, 0], rows[:, 1], key[a:b], value[a:b], self.scale
            ).to(output.dtype)
        return output
