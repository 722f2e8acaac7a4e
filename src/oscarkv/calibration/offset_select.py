"""Per-KV-head choice of the static channel offsets (``offsets="auto"``, ours).

For every layer and KV head the K and V offsets are kept or dropped *jointly* from the four
pairs ``{none, offset}²``: the pair with the smallest held-out attention-output error with both K
and V fake-quantized (OSCAR's windows, the layer's clips, the last ``n_queries`` queries; the
measure of :mod:`oscarkv.calibration.error`). Ties drop the offset, so the choice is never worse
on the held-out data than OSCAR as published. A dropped offset is a zero row (``None`` when a
layer keeps none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import QuantSpec
from ..quant import RowFormat
from ..rotation import LayerRotation
from .error import WindowedError, fake_quant_middle

__all__ = ["OffsetSelect"]


class OffsetSelect:
    """Accumulates held-out errors ``[2 (K: none, offset), 2 (V), H_kv]`` per layer and applies
    the choice to ``rotations`` (whose ``k_offset``/``v_offset`` are the candidates)."""

    def __init__(
        self, rotations: dict[int, LayerRotation], spec: QuantSpec, head_dim: int, n_queries: int = 256
    ):
        self.rotations, self.spec, self.n_queries, self.d = rotations, spec, n_queries, head_dim
        self.err: dict[int, torch.Tensor] = {}
        self.ref: dict[int, torch.Tensor] = {}

    def _hats(self, x_rot: torch.Tensor, off: torch.Tensor | None, fmt: RowFormat) -> list[torch.Tensor]:
        """Read-back rows without and with the offset subtracted before quantization."""
        sink, recent = self.spec.sink_tokens, self.spec.recent_tokens
        plain = fake_quant_middle(x_rot, fmt, sink, recent)
        if off is None:
            return [plain, plain]
        c = off.float().to(x_rot.device)[None, :, None, :]
        return [plain, fake_quant_middle(x_rot - c, fmt, sink, recent) + c]

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add one held-out batch (post-RoPE ``q [B, H_q, T, d]``, ``k``/``v [B, H_kv, T, d]``)."""
        lr, spec = self.rotations[layer], self.spec
        kf, vf = lr.formats(spec, self.d)
        we = WindowedError(q, k, v, lr, spec.sink_tokens, spec.recent_tokens, self.n_queries)
        k_hats, v_hats = self._hats(we.k_rot, lr.k_offset, kf), self._hats(we.v_rot, lr.v_offset, vf)
        e = torch.stack([torch.stack([we.head_errors(kh, vh) for vh in v_hats]) for kh in k_hats])
        self.err[layer] = self.err.get(layer, 0) + e
        self.ref[layer] = self.ref.get(layer, 0) + we.head_ref()

    def apply(self) -> tuple[dict[int, LayerRotation], dict[str, dict[str, Any]]]:
        """The rotations with the chosen offsets, and a JSON-ready record for the provenance."""
        out, record = dict(self.rotations), {}
        for layer, e in sorted(self.err.items()):
            lr = self.rotations[layer]
            idx = e.reshape(4, -1).argmin(0)  # first minimum: (none, none) wins ties
            use_k, use_v = (idx // 2).bool(), (idx % 2).bool()

            def keep(off: torch.Tensor | None, use: torch.Tensor) -> torch.Tensor | None:
                if off is None or not bool(use.any()):
                    return None
                return torch.where(use[:, None].to(off.device), off, torch.zeros_like(off))

            out[layer] = dataclasses.replace(
                lr, k_offset=keep(lr.k_offset, use_k), v_offset=keep(lr.v_offset, use_v)
            )
            tot = max(float(self.ref[layer].sum()), 1e-30)
            heads = torch.arange(e.shape[-1])
            record[str(layer)] = {
                "k": [int(x) for x in use_k],
                "v": [int(x) for x in use_v],
                "err_none": float(e[0, 0].sum()) / tot,
                "err_both": float(e[1, 1].sum()) / tot,
                "err_chosen": float(e[idx // 2, idx % 2, heads].sum()) / tot,
            }
        return out, record
