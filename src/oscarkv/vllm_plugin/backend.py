"""The attention backend vLLM's CPU platform runs once :func:`oscarkv.vllm_plugin.register`
has pointed ``CPU_ATTN`` here.

Without ``additional_config["oscarkv"]`` every method defers to vLLM's ``CPU_ATTN`` classes, so
an install of ``oscarkv[vllm]`` changes nothing by itself. With it (``kv_dtype="bf16"``), the
layer's KV pages hold our token-major 16-bit rows (:mod:`.layout`): writes go through
``do_kv_cache_update`` (vLLM's slot mapping), reads gather each request's rows through its block
table and run our torch reference ``prefill_attention`` (``kernels/ref``), which also serves
decode (one query row over the cached prefix).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from ..errors import InputError
from ..kernels.ref import prefill_attention
from .layout import hp_token_bytes, page_rows, write_rows
from .options import PluginOptions

__all__ = ["OscarCPUAttentionBackend", "OscarCPUAttentionImpl", "enabled_options"]

logger = init_logger("vllm.plugins.oscarkv")  # under "vllm" so that vLLM's log handler prints it

# Set by the first layer built in this process (layers are built before vLLM asks the backend
# for the KV spec, in the same worker process); ``customize_spec`` is a classmethod with no
# config argument, so it reads the decision from here. One decision per process: two engines
# with different options in one process (in-process mode) are not supported.
_OPTIONS: dict[str, PluginOptions | None] = {}


def enabled_options() -> PluginOptions | None:
    """This process's plug-in options, or ``None`` when the run did not opt in."""
    if "opts" not in _OPTIONS:
        _OPTIONS["opts"] = PluginOptions.from_additional_config(get_current_vllm_config().additional_config)
    return _OPTIONS["opts"]


class OscarCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with our page layout when enabled. ``get_name`` stays ``"CPU_ATTN"``: vLLM
    maps the name back to the enum (``attention.py:433``) and the CPU platform's checks key on it."""

    @staticmethod
    def get_impl_cls() -> type[OscarCPUAttentionImpl]:
        return OscarCPUAttentionImpl

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """Enabled: one head slot per token whose content is our 16-bit row pair (same bytes as
        vLLM's layout, different order). Called by ``customize_attention_spec``
        (``vllm/v1/worker/utils.py:476``) for every layer's ``AttentionSpec``."""
        spec = super().customize_spec(spec)
        if _OPTIONS.get("opts") is None or spec.state_content_bytes is not None:
            return spec
        from dataclasses import replace

        elem = torch.tensor([], dtype=spec.dtype).element_size()
        logger.info_once("oscarkv: KV pages in the oscarkv 16-bit passthrough layout")
        return replace(
            spec,
            num_head_slots=1,
            state_content_bytes=hp_token_bytes(spec.num_kv_heads, spec.head_size, elem),
        )


class OscarCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU impl when disabled; ours (16-bit passthrough) when enabled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opts = enabled_options()
        self.hp_name: str | None = None  # the companion 16-bit store's layer name (hp_store)
        if self.opts is None:
            return
        problems = []
        if self.attn_type != AttentionType.DECODER:
            problems.append(f"attention type {self.attn_type}")
        if self.sliding_window != -1:
            problems.append("sliding window")
        if self.alibi_slopes is not None:
            problems.append("ALiBi")
        if self.logits_soft_cap:
            problems.append("logit soft-capping")
        if self.sinks is not None:
            problems.append("learned attention sinks")
        if self.kv_cache_dtype != "auto":
            problems.append(f"--kv-cache-dtype {self.kv_cache_dtype} (use auto)")
        if problems:
            raise InputError(f"oscarkv under vLLM does not support: {', '.join(problems)}")
        logger.info_once("oscarkv: attention enabled with %s", self.opts)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """After the model is built and loaded, before vLLM collects KV specs: create this
        layer's companion 16-bit store when asked (``hp_store``)."""
        super().process_weights_after_loading(act_dtype)
        if self.opts is None or not self.opts.hp_store or self.hp_name is not None:
            return
        from .hp_store import SUFFIX, HPStore

        ctx = get_current_vllm_config().compilation_config.static_forward_context
        name = next(n for n, m in ctx.items() if getattr(m, "impl", None) is self)
        self.hp_name = name + SUFFIX
        self._hp = HPStore(self.hp_name, self.num_kv_heads, self.head_size, act_dtype, self.opts.hp_capacity)

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
        pages = page_rows(kv_cache, self.num_kv_heads, self.head_size)
        write_rows(pages, key, value, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
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
        pages = page_rows(kv_cache, self.num_kv_heads, self.head_size)
        bs = pages.shape[1]
        if self.hp_name is not None:
            self._check_hp_store(len(attn_metadata.seq_lens))
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

    def _check_hp_store(self, num_reqs: int) -> None:
        """Prototype check: the companion store has one distinct block per batch row."""
        meta = get_forward_context().attn_metadata[self.hp_name]
        blocks = meta.block_table[:num_reqs, 0].tolist()
        if len(set(blocks)) != len(blocks):
            raise RuntimeError(f"oscarkv: 16-bit store blocks shared between requests: {blocks}")
        if num_reqs > 1:
            logger.info_once(
                "oscarkv: 16-bit store %s, blocks of a %d-request batch: %s",
                str(tuple(self._hp.kv_cache.shape)),
                num_reqs,
                str(blocks),
            )
