"""The engine's KV storage: one INT2 page pool and one 16-bit pool per layer (engine.md §3.1, §5.2).

Every tensor kind is allocated once as ``[L, N, ...]``; :meth:`KVPool.layer` hands out the
contiguous ``[l]`` views the kernels read (``kernels.pool_ops.FlatPools``). Row ids are flat:

* INT2 pool, ``N = q_pages·ps`` rows: codes uint8 ``[N, Hkv, packed]``, meta ``[N, Hkv, G, 2]``
  (the spec's meta dtype), for K and V. Page 0 is ``DUMMY_Q``. The key codes are one tensor per
  layer (``k_codes[l]``): layers may store keys in different widths (per-layer key bits).
* 16-bit pool ``[Nh, Hkv, d]`` for K and V, in the window dtype (the model's, or float8_e4m3fn
  with ``QuantSpec.window_dtype="fp8_e4m3"``: 1 byte per element): pages ``0 .. hp_pages-1``
  (page 0 = ``DUMMY_H``, then sink pages; page ``p`` = rows ``p·ps .. p·ps+ps-1``), then one ring
  slab of ``ring_cap`` rows per request slot from row ``ring0 = hp_pages·ps``.
* BF16 mode (``kv_dtype="bf16"``): no INT2 rows and no rings; every token lives in 16-bit pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..config import META_DTYPE_BYTES, EngineConfig, QuantSpec
from ..config.engine import AUTO_MAX_RUNNING, MIN_AUTO_MODEL_LEN
from ..errors import InputError
from ..quant import RowFormat
from ..quant.tiers import window_limit
from ..quant.window import window_torch_dtype
from ..store import LayerViews, PoolPlan
from ..store.windows import window_block
from .kv_budget import GIB

__all__ = ["DUMMY_PAGE", "GIB", "KVPool", "hp_dtype", "longest_request", "plan_pools"]

DUMMY_PAGE = 0  # page 0 of both pools: never handed out; the target of no-op writes
_META = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _int2_row_bytes(fk: RowFormat, fv: RowFormat, heads: int) -> int:
    """Bytes of one token of one layer in the INT2 tier (codes + (scale, zero), K and V)."""
    meta = META_DTYPE_BYTES[fk.meta_dtype]
    return heads * (fk.packed_dim + fv.packed_dim + 2 * meta * (fk.groups + fv.groups))


def _shape(
    cfg: EngineConfig,
    spec: QuantSpec | None,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layer_fmts: Sequence[tuple[RowFormat, RowFormat]] | None,
) -> tuple[PoolPlan, int]:
    """The page and slot sizes of a plan (no pages yet), and the bytes outside the request
    slots: the dummy page of each pool. INT2 mode stores the windows in ``spec.window_dtype``."""
    ps = cfg.page_tokens
    if cfg.kv_dtype == "bf16":
        hp_page = ps * 2 * layers * kv_heads * head_dim * dtype.itemsize
        return PoolPlan(False, ps, 0, 0, 0, 0, 0, 0, 0, hp_page, 0), hp_page
    if spec is None:
        raise InputError("int2 KV pools need a QuantSpec (from the rotations or EngineConfig.spec)")
    cfg.check_spec(spec)
    hp_page = ps * 2 * layers * kv_heads * head_dim * window_torch_dtype(spec.window_dtype, dtype).itemsize
    if layer_fmts is None:
        uniform = (RowFormat.from_spec(spec, head_dim, "k"), RowFormat.from_spec(spec, head_dim, "v"))
        layer_fmts = [uniform] * layers
    if len(layer_fmts) != layers:
        raise ValueError(f"plan_pools: {len(layer_fmts)} layer formats for {layers} layers")
    q_page = ps * sum(_int2_row_bytes(fk, fv, kv_heads) for fk, fv in layer_fmts)
    ring = window_limit(spec)
    cap = -(-ring // ps) * ps
    block = window_block(spec.recent_tokens, ps) if cfg.prefill_attention == "invariant" else 0
    score = (spec.recent_tokens, spec.demote_block) if cfg.prompt_scoring == "decode" else (0, 0)
    shape = PoolPlan(True, ps, 0, spec.sink_tokens // ps, 0, 0, ring, cap, q_page, hp_page, 0, block, score)
    return shape, hp_page + q_page


def plan_pools(
    cfg: EngineConfig,
    spec: QuantSpec | None,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    budget_bytes: int,
    layer_fmts: Sequence[tuple[RowFormat, RowFormat]] | None = None,
    max_model_len: int | None = None,
) -> PoolPlan:
    """Split ``budget_bytes`` over the pools (§5.2). ``kv_heads`` are this rank's KV heads;
    ``layer_fmts``: every layer's ``(k_fmt, v_fmt)`` when they differ (per-layer key bits; else
    the spec's formats, the same for every layer).

    INT2 mode: the 16-bit part is fixed, ``(1 + max_running·sink_pages·2)`` pages plus
    ``max_running`` ring slabs; the INT2 pages take the rest. BF16 mode: all 16-bit pages.
    With ``cfg.max_running`` unset, the slots are as many requests of ``max_model_len`` tokens
    as the budget holds whole, at most ``AUTO_MAX_RUNNING``.
    Raises :class:`~oscarkv.errors.InputError` when the budget cannot hold one usable page per
    tier, or (slots unset) one request of ``max_model_len`` tokens.
    """
    shape, overhead = _shape(cfg, spec, layers, kv_heads, head_dim, dtype, layer_fmts)
    ps, mr, hp_page = cfg.page_tokens, cfg.max_running, shape.hp_page_bytes
    if mr is None:
        mr = _slots(
            budget_bytes - overhead,
            shape.request_bytes(_length(max_model_len)),
            max_model_len,
            hp_dtype(cfg, spec, dtype),
        )
    if not shape.int2:
        hp_pages = budget_bytes // hp_page
        _need(budget_bytes, 2 * hp_page, "two 16-bit pages (the dummy page and one usable page)")
        return replace(shape, max_running=mr, hp_pages=hp_pages, total_bytes=hp_pages * hp_page)
    q_page, sink_pages = shape.q_page_bytes, shape.sink_pages
    hp_pages = 1 + mr * sink_pages * 2
    fixed = hp_pages * hp_page + mr * shape.ring_cap * (hp_page // ps)
    _need(
        budget_bytes,
        fixed + 2 * q_page,
        f"the 16-bit sinks and rings of max_running={mr} requests ({fixed} bytes) plus two INT2 pages",
    )
    q_pages = (budget_bytes - fixed) // q_page
    total = fixed + q_pages * q_page
    return replace(shape, max_running=mr, q_pages=q_pages, hp_pages=hp_pages, total_bytes=total)


def longest_request(
    cfg: EngineConfig,
    spec: QuantSpec | None,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    budget_bytes: int,
    layer_fmts: Sequence[tuple[RowFormat, RowFormat]] | None,
    max_model_len: int,
) -> int:
    """The longest request, at most ``max_model_len`` tokens, that a budget of ``budget_bytes``
    holds whole as one slot of :func:`plan_pools` (a multiple of ``page_tokens`` when shorter).
    Raises the plan's :class:`~oscarkv.errors.InputError` when it holds no request of
    ``min(max_model_len, MIN_AUTO_MODEL_LEN)`` tokens."""
    shape, overhead = _shape(cfg, spec, layers, kv_heads, head_dim, dtype, layer_fmts)
    room = budget_bytes - overhead
    if shape.request_bytes(max_model_len) <= room:
        return max_model_len
    short = min(max_model_len, MIN_AUTO_MODEL_LEN)
    _slots(room, shape.request_bytes(short), short, hp_dtype(cfg, spec, dtype))
    lo, hi = short, max_model_len  # request_bytes grows with the length: lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if shape.request_bytes(mid) <= room else (lo, mid)
    return lo


def _length(max_model_len: int | None) -> int:
    if max_model_len is None:
        raise ValueError("plan_pools: max_running unset needs max_model_len")
    return max_model_len


def hp_dtype(cfg: EngineConfig, spec: QuantSpec | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the 16-bit pool: the model's ``dtype``, or in INT2 mode the spec's window dtype."""
    if cfg.kv_dtype == "bf16" or spec is None:
        return dtype
    return window_torch_dtype(spec.window_dtype, dtype)


def stored_as(dtype: torch.dtype) -> str:
    """How the unquantized KV rows are stored, e.g. "fp32 (4 bytes per element)": the model dtype,
    which is fp32 where a model runs in fp32 on a CPU, or fp8 e4m3 with fp8 windows."""
    names = {
        torch.float32: "fp32",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float8_e4m3fn: "fp8 e4m3",
    }
    return f"{names.get(dtype, str(dtype))} ({dtype.itemsize} bytes per element)"


def _slots(room: int, per_request: int, max_model_len: int | None, dtype: torch.dtype) -> int:
    """Requests of ``per_request`` bytes that ``room`` holds, at most ``AUTO_MAX_RUNNING``."""
    n = min(AUTO_MAX_RUNNING, max(room, 0) // per_request)
    if n < 1:
        raise InputError(
            f"the KV budget is too small for one request of max_model_len={max_model_len} tokens: one "
            f"needs {per_request} bytes ({per_request / GIB:.3g} GiB; its unquantized rows stored as "
            f"{stored_as(dtype)}), the budget has {max(room, 0)} left after the dummy pages",
            "raise kv_budget_gb (--kv-budget-gb), or lower max_model_len (--max-model-len)",
        )
    return n


def _need(budget: int, need: int, what: str) -> None:
    if budget < need:
        raise InputError(
            f"the KV budget of {budget} bytes ({budget / GIB:.3g} GiB) is too small: it needs at least "
            f"{need} bytes ({need / GIB:.3g} GiB) for {what}",
            "raise kv_budget_gb (--kv-budget-gb), or lower max_running or page_tokens",
        )


class KVPool:
    """The allocated pools of all layers. ``fmts[l] = (k_fmt, v_fmt)`` (per-layer clips); in BF16
    mode ``fmts`` may be ``None`` (a 2-bit format of one group only shapes the empty INT2 views).
    ``window_dtype``: the 16-bit pool's dtype (:func:`hp_dtype`; default the model's ``dtype``)."""

    def __init__(
        self,
        plan: PoolPlan,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        fmts: Sequence[tuple[RowFormat, RowFormat]] | None,
        device: torch.device | str,
        window_dtype: torch.dtype | None = None,
    ):
        if fmts is None:
            if plan.int2:
                raise ValueError("KVPool: int2 pools need the per-layer (k_fmt, v_fmt)")
            fmts = [(RowFormat(head_dim, group=head_dim),) * 2] * layers
        if len(fmts) != layers:
            raise ValueError(f"KVPool: {len(fmts)} layer formats for {layers} layers")
        kshapes = {(f[0].groups, f[0].meta_dtype) for f in fmts}
        vshapes = {(f[1].packed_dim, f[1].groups, f[1].meta_dtype) for f in fmts}
        if len(kshapes) != 1 or len(vshapes) != 1:
            raise ValueError("KVPool: the layers' formats may differ only in the key bits")
        self.plan, self.fmts = plan, list(fmts)
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.device = torch.device(device)
        fk, fv = self.fmts[0]
        nq, nh, h, d = plan.q_rows, plan.hp_rows, kv_heads, head_dim

        def zeros(*shape: int, dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(layers, *shape, dtype=dt, device=self.device)

        try:
            self.k_codes = [
                torch.zeros(nq, h, f.packed_dim, dtype=torch.uint8, device=self.device) for f, _ in self.fmts
            ]
            self.v_codes = zeros(nq, h, fv.packed_dim, dt=torch.uint8)
            self.k_meta = zeros(nq, h, fk.groups, 2, dt=_META[fk.meta_dtype])
            self.v_meta = zeros(nq, h, fv.groups, 2, dt=_META[fv.meta_dtype])
            hp = dtype if window_dtype is None else window_dtype
            self.hp_k = zeros(nh, h, d, dt=hp)
            self.hp_v = zeros(nh, h, d, dt=hp)
        except RuntimeError as e:  # torch.OutOfMemoryError, or the CPU allocator's RuntimeError
            if not isinstance(e, torch.OutOfMemoryError) and "alloc" not in str(e):
                raise
            raise InputError(
                f"the KV pools ({plan.total_bytes / GIB:.3g} GiB) could not be allocated on {self.device}: "
                "out of memory",
                "lower kv_budget_gb (--kv-budget-gb), or leave it unset to size the pools from free memory",
            ) from None

    def layer(self, l: int) -> LayerViews:
        """Layer ``l``'s contiguous views and formats."""
        k_fmt, v_fmt = self.fmts[l]
        return LayerViews(
            self.k_codes[l], self.v_codes[l], self.k_meta[l], self.v_meta[l], self.hp_k[l], self.hp_v[l],
            k_fmt, v_fmt,
        )  # fmt: skip

    def _int2_tensors(self) -> list[torch.Tensor]:
        """The INT2 tensors, each with the layers as dim 0 (a key-code tensor is ``[1, N, ...]``)."""
        return [t[None] for t in self.k_codes] + [self.v_codes, self.k_meta, self.v_meta]

    def memory_report(self, tokens_quantized: int = 0, tokens_hp: int = 0) -> dict[str, Any]:
        """Allocated bytes per tier (from the tensors), per-token bytes (all layers, K and V), and
        the bits per stored element of ``tokens_quantized`` INT2 and ``tokens_hp`` 16-bit tokens."""

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        int2 = sum(nbytes(t) for t in self._int2_tensors())
        hp = nbytes(self.hp_k) + nbytes(self.hp_v)
        ring = nbytes(self.hp_k[:, self.plan.ring0 :]) + nbytes(self.hp_v[:, self.plan.ring0 :])
        q_tok = sum(nbytes(t[:, :1]) for t in self._int2_tensors()) if self.plan.q_rows else 0
        hp_tok = nbytes(self.hp_k[:, :1]) + nbytes(self.hp_v[:, :1])
        elems = 2 * (tokens_quantized + tokens_hp) * self.layers * self.kv_heads * self.head_dim
        held = tokens_quantized * q_tok + tokens_hp * hp_tok
        return {
            "int2_bytes": int2,
            "hp_bytes": hp,
            "hp_paged_bytes": hp - ring,
            "ring_bytes": ring,
            "total_bytes": int2 + hp,
            "int2_bytes_per_token": q_tok,
            "hp_bytes_per_token": hp_tok,
            "tokens_quantized": tokens_quantized,
            "tokens_hp": tokens_hp,
            "held_bytes": held,
            "bits_per_element": 8 * held / elems if elems else float("nan"),
        }
