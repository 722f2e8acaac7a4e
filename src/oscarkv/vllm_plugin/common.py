"""What the plug-in's CPU and CUDA backends share: the per-process opt-in and INT2 setup, the
per-step metadata, the KV spec we publish, and the impl logic (passthrough and INT2).

Without ``additional_config["oscarkv"]`` nothing here is used. With it:

* ``kv_dtype="bf16"``: the layer's KV pages hold our token-major 16-bit rows (:mod:`.layout`),
  written through vLLM's slot mapping and read through its block tables by our torch reference
  ``prefill_attention`` (``kernels/ref``), which also serves decode;
* ``kv_dtype="int2"``: the pages hold INT2 rows by position, a companion store
  (:mod:`.hp_store`) holds each request's 16-bit sink and ring, and :mod:`.int2_attn` runs our
  engine's attention over both.

This module imports no platform's backend, so the CUDA backend can use it without vLLM's CPU one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata

from ..errors import InputError
from ..kernels.ref import prefill_attention
from .checks import Int2Setup, check_model, int2_setup
from .layout import hp_token_bytes, page_rows, write_rows
from .options import PluginOptions

__all__ = [
    "OscarImplMixin",
    "StepMetadata",
    "customize_spec",
    "enabled_options",
    "int2_state",
    "logger",
    "record_absorbed",
    "step_metadata",
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


def record_absorbed() -> None:
    """Called by the ``oscarkv`` loader once R_V is in ``qkv_proj`` (before the layers' post-load)."""
    _STATE["absorbed"] = True


@dataclass
class StepMetadata:
    """What our paths read per step (host copies: INT2 plans on the host). INT2 on CPU; every
    mode on CUDA (:mod:`.cuda_backend`)."""

    query_start_loc: list[int]
    seq_lens: list[int]
    is_prefilling: list[bool]
    block_table: torch.Tensor  # [reqs, max_blocks]


def step_metadata(m: CommonAttentionMetadata) -> StepMetadata:
    """The :class:`StepMetadata` of vLLM's common per-step metadata."""
    n = m.num_reqs
    if m.is_prefilling is None:
        raise RuntimeError("oscarkv: this vLLM build passes no is_prefilling to attention builders")
    return StepMetadata(
        m.query_start_loc_cpu[: n + 1].tolist(),
        m.seq_lens[:n].tolist(),
        m.is_prefilling[:n].tolist(),
        m.block_table_tensor[:n],
    )


def customize_spec(spec: Any) -> Any:
    """Enabled: one head slot per token whose content is our row pair (16-bit, or INT2 rows as
    uint8 bytes). The backends' ``customize_spec``, called by ``customize_attention_spec``
    (``vllm/v1/worker/utils.py:476``) for every layer's ``AttentionSpec``."""
    if _STATE.get("opts") is None or spec.state_content_bytes is not None:
        return spec
    setup = int2_state()
    if setup is not None:
        logger.info_once("oscarkv: KV pages hold INT2 rows (%d bytes per token per layer)", setup.row_bytes)
        return replace(spec, dtype=torch.uint8, num_head_slots=1, state_content_bytes=setup.row_bytes)
    logger.info_once("oscarkv: KV pages in the oscarkv 16-bit passthrough layout")
    row = hp_token_bytes(spec.num_kv_heads, spec.head_size, spec.dtype.itemsize)
    return replace(spec, num_head_slots=1, state_content_bytes=row)


def _host(x: Any) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else x


class OscarSpecMixin:
    """An attention backend whose KV cache spec is :func:`customize_spec`'s (before the vLLM base
    class in the bases)."""

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        return customize_spec(super().customize_spec(spec))  # type: ignore[misc]


class OscarImplMixin:
    """Our passthrough and INT2 paths, shared by the CPU and CUDA impls; the impl sets vLLM's
    impl attributes (``num_heads``, ``head_size``, ``scale``, ``num_kv_heads``, ...) first."""

    opts: PluginOptions | None
    int2: Any  # the layer's VllmInt2Layer, built once its name is known

    def _enable(self) -> None:
        """Refuse what our paths cannot run (after ``opts`` is set, not ``None``)."""
        self.int2 = None
        problems = []
        if self.attn_type != AttentionType.DECODER:
            problems.append(f"attention type {self.attn_type}")
        if self.sliding_window not in (-1, None):
            problems.append("sliding window")
        if self.alibi_slopes is not None:
            problems.append("ALiBi")
        if self.logits_soft_cap:
            problems.append("logit soft-capping")
        if getattr(self, "sinks", None) is not None:
            problems.append("learned attention sinks")
        if problems:
            raise InputError(f"oscarkv under vLLM does not support: {', '.join(problems)}")
        logger.info_once("oscarkv: attention enabled with %s", self.opts)

    def _build_int2(self, act_dtype: torch.dtype) -> None:
        """After the weights load, before vLLM collects KV specs: in INT2 mode build the layer's
        attention (rotations, formats) and its companion 16-bit store."""
        setup = int2_state()
        if setup is None or self.int2 is not None:
            return
        from .int2_layer import build_int2_layer

        absorbed = bool(_STATE.get("absorbed"))
        if self.opts.absorb_v and not absorbed:
            raise RuntimeError("oscarkv: absorb_v is on but the 'oscarkv' model loader did not absorb R_V")
        self.int2 = build_int2_layer(self, setup, act_dtype, absorbed)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """vLLM's write hook, ours (INT2: ``forward`` writes, by tier)."""
        if self.int2 is None:
            write_rows(page_rows(kv_cache, self.num_kv_heads, self.head_size), key, value, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's attention call, ours: passthrough or INT2."""
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
        starts, seq_lens = _host(attn_metadata.query_start_loc), _host(attn_metadata.seq_lens)
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
