"""Guards on what enters an :class:`~oscarkv.hf.cache.OscarCache`: finite K/V, metadata that
fits its dtype, and 16-bit windows that fit in memory.

The per-layer flags live on the device and are read once per forward (the first layer of the
next forward, or :meth:`OscarCache.memory_report`), so no extra host sync is added per layer.
"""

from __future__ import annotations

import os

import torch

from ..config import QuantSpec, SpecError
from ..errors import KVValueError
from ..quant.tiers import window_limit

__all__ = ["KVHealth", "check_window_memory", "raise_if_unhealthy"]


class KVHealth:
    """Device flags of one layer: ``[max |x| of K/V that entered, non-finite stored metadata]``."""

    def __init__(self, device: torch.device):
        self.flags = torch.zeros(2, dtype=torch.float32, device=device)

    @torch.no_grad()
    def note_entry(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fold ``max |x|`` of the new ``key/value`` in (NaN and Inf propagate)."""
        for x in (key, value):
            m = torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32)
            torch.maximum(self.flags[0], m, out=self.flags[0])

    @torch.no_grad()
    def note_meta(self, *metas: torch.Tensor) -> None:
        """Flag non-finite entries in freshly written ``(scale, zero)`` rows (an fp16 overflow)."""
        for m in metas:
            if m.numel():
                self.flags[1] += (~torch.isfinite(m)).any()


def raise_if_unhealthy(health: list[KVHealth | None], layer_ids: list[int], spec: QuantSpec) -> None:
    """One host read of every layer's flags; raises :class:`KVValueError` for the first bad layer."""
    live = [(i, h) for i, h in zip(layer_ids, health, strict=True) if h is not None]
    if not live:
        return
    rows = torch.stack([h.flags for _, h in live]).tolist()
    for (i, _), (amax, bad_meta) in zip(live, rows, strict=True):
        if amax != amax or amax == float("inf"):  # NaN or Inf
            raise KVValueError(
                f"layer {i}: the model produced NaN or Inf keys/values, and they entered the KV cache",
                "check the model's weights and dtype (fp16 overflows more easily than bf16: try --dtype bf16)",
            )
        if bad_meta:
            raise KVValueError(
                f"layer {i}: keys/values up to |x| = {amax:.3g} overflow the {spec.meta_dtype} scale/zero of "
                "the quantized tier",
                "store the metadata in bf16 or fp32: --meta-dtype bf16 at calibrate, or QuantSpec(meta_dtype='bf16')",
            )


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            return None
    return None


def check_window_memory(
    spec: QuantSpec,
    batch: int,
    layers: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Refuse (``SpecError``) windows that cannot fit: the sink and recent ring of every sequence
    and layer (``dtype``: the window pools') are allocated up front."""
    rows = spec.sink_tokens + window_limit(spec)
    need = batch * rows * layers * heads * head_dim * 2 * torch.tensor([], dtype=dtype).element_size()
    free = _free_bytes(device)
    if free is not None and need > free:
        raise SpecError(
            f"the windows (sink_tokens {spec.sink_tokens} + recent ring {window_limit(spec)} tokens, "
            f"batch {batch}, {layers} layers) need {need / 2**30:.1f} GiB; {device} has {free / 2**30:.1f} GiB free",
            "lower --sink-tokens / --recent-tokens (QuantSpec) or the batch size",
        )
