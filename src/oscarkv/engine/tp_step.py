"""What rank 0 sends the other tensor-parallel ranks each step, and each rank's share of the
rotations (``engine/distributed.py`` carries the messages; :class:`~.model_runner.ModelRunner`
builds and runs them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..rotation import LayerRotation
from ..store import Csr, PrefillTensors
from .decode_buffers import HostDecode
from .models.loader import kv_head_slice

__all__ = ["StepMsg", "prefill_to", "rank_rotation"]


@dataclass(frozen=True)
class StepMsg:
    """One step's host plan as rank 0 sends it to the other ranks: a decode (``decode``, with
    ``n`` real rows) or a prefill (``ids`` int64 ``[T]`` and ``prefill``, both on the CPU)."""

    n: int = 0
    decode: HostDecode | None = None
    ids: torch.Tensor | None = None
    prefill: PrefillTensors | None = None


def prefill_to(p: PrefillTensors, device: torch.device) -> PrefillTensors:
    """``p`` with every tensor on ``device``."""
    if device.type == "cpu":
        return p

    def move(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return v.to(device, non_blocking=True)
        if isinstance(v, Csr):
            return Csr(v.indptr.to(device, non_blocking=True), v.indices.to(device, non_blocking=True),
                       v.indptr_host)  # fmt: skip
        return v

    return PrefillTensors(**{f.name: move(getattr(p, f.name)) for f in dataclasses.fields(p)})


def rank_rotation(lr: LayerRotation, tp: int, rank: int) -> LayerRotation:
    """``lr`` for one rank's KV heads: per-KV-head rotations and the offsets sliced; per-layer
    ``[d, d]`` rotations whole."""

    def cut(t: torch.Tensor | None, per_head: bool) -> torch.Tensor | None:
        return t if t is None or not per_head else kv_head_slice(t, tp, rank)

    return dataclasses.replace(
        lr, k=cut(lr.k, lr.k.dim() == 3), v=cut(lr.v, lr.v.dim() == 3),
        k_offset=cut(lr.k_offset, True), v_offset=cut(lr.v_offset, True),
    )  # fmt: skip
