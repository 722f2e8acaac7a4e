"""Glue between one vLLM attention layer and :class:`.int2_attn.Int2Layer` (INT2 mode).

Built after the weights load (``process_weights_after_loading``), when the layer's name is
known: the name gives the layer index (its rotations and formats) and names the companion
16-bit store (:mod:`.hp_store`), which must be in vLLM's static forward context before vLLM
collects the KV cache specs.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index

from ..kernels import resolve
from ..rotation import LayerShift
from ..store import LayerViews, TierAttention
from .checks import Int2Setup, store_capacity
from .hp_store import SUFFIX, HPStore
from .int2_attn import Int2Layer
from .layout import flat_rows, int2_pools, store_pools

__all__ = ["VllmInt2Layer", "build_int2_layer"]


class VllmInt2Layer:
    """One layer's INT2 state under vLLM: the :class:`Int2Layer`, its store, its pool views."""

    def __init__(self, layer: Int2Layer, store: HPStore, heads: int, head_dim: int):
        self.layer, self.store, self.heads, self.head_dim = layer, store, heads, head_dim
        self._views: tuple[int, int, LayerViews, int, int, int] | None = None

    def _pools(self, kv_cache: torch.Tensor) -> tuple[LayerViews, int, int, int]:
        """The flat views of both buffers (rebuilt only if vLLM rebinds them)."""
        key = (kv_cache.data_ptr(), self.store.kv_cache.data_ptr())
        if self._views is None or self._views[:2] != key:
            rows, rpb = flat_rows(kv_cache)
            srows, rpb_s = flat_rows(self.store.kv_cache)
            need = self.layer.spec.sink_tokens + self.layer.ring
            if self.store.kv_cache.shape[2] < need:
                raise RuntimeError(
                    f"oscarkv: 16-bit store blocks of {self.store.kv_cache.shape[2]} < {need} rows"
                )
            a = self.layer.attn
            hp_k, hp_v = store_pools(srows, self.heads, self.head_dim)
            pools = LayerViews(**int2_pools(rows, self.heads, a.k_fmt, a.v_fmt), hp_k=hp_k, hp_v=hp_v,
                              k_fmt=a.k_fmt, v_fmt=a.v_fmt)  # fmt: skip
            self._views = (*key, pools, kv_cache.shape[2], rpb, rpb_s)
        return self._views[2:]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Any,
        store_table: torch.Tensor,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """``query [T, Hq, d]``, ``key, value [T, Hkv, d]`` -> ``output [T, Hq, d]`` (filled)."""
        pools, bs, rpb, rpb_s = self._pools(kv_cache)
        n = len(meta.seq_lens)
        store_blocks = store_table[:n, 0].tolist()
        pre, dec = self.layer.plan(
            meta.query_start_loc,
            meta.seq_lens,
            meta.is_prefilling,
            meta.block_table,
            store_blocks,
            bs,
            rpb,
            rpb_s,
        )
        t = meta.query_start_loc[-1]
        q, k, v = query[:t], key[:t], value[:t]
        if pre:
            idx, out = self.layer.prefill(q, k, v, pools, pre)
            output[idx] = out.to(output.dtype)
        if dec:
            idx, out = self.layer.decode(q, k, v, pools, dec)
            output[idx] = out.to(output.dtype)
        return output


def build_int2_layer(impl: Any, setup: Int2Setup, act_dtype: torch.dtype, absorbed: bool) -> VllmInt2Layer:
    """The INT2 state of the vLLM layer whose impl is ``impl`` (found by identity); ``absorbed``:
    ``R_V`` is folded into ``qkv_proj`` (:mod:`.loader`), so new values arrive rotated."""
    cfg = get_current_vllm_config()
    ctx = cfg.compilation_config.static_forward_context
    name = next(n for n, m in ctx.items() if getattr(m, "impl", None) is impl)
    i = extract_layer_index(name)
    lr = setup.rotations.layers[i]
    device = torch.device(cfg.device_config.device)
    k_fmt, v_fmt = setup.fmts[i]
    h, d = impl.num_kv_heads, impl.head_size
    attn = TierAttention(
        i,
        lr.k.to(device, torch.float32),
        lr.v.to(device, torch.float32),
        k_fmt,
        v_fmt,
        resolve("auto" if device.type == "cuda" else "torch", device),
        impl.scale,
        values_prerotated=absorbed,
        shift=LayerShift.build(lr, impl.num_heads, absorbed, device, act_dtype),
    )
    hp_row = 2 * h * d * act_dtype.itemsize
    cap = store_capacity(setup.store_rows, cfg.cache_config.block_size * setup.row_bytes, hp_row)
    store = HPStore(name + SUFFIX, h, d, act_dtype, cap)
    return VllmInt2Layer(Int2Layer(attn, setup.spec), store, h, d)
