"""Per-layer / per-KV-head selection between the fitted rotation and Hadamard (ours, opt-in).

For every layer the K and V rotations are chosen *jointly* from the four pairs
``{fitted, hadamard}²``: the pair with the smallest held-out attention-output error with *both*
K and V fake-quantized (OSCAR's windows, the global clip ratios, the last ``n_queries`` queries;
the same measure as :mod:`oscarkv.calibration.error` and the evaluation's attention error). With
``kv_head`` granularity each KV head chooses on its own error (heads do not interact in the output
of their query group). Ties keep the fitted rotation, so a selection is never worse than the
fitted rotations on the held-out data, nor than Hadamard.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import QuantSpec
from ..quant import RowFormat
from ..rotation import LayerRotation, hadamard, rotate_heads
from .error import WindowedError, fake_quant_middle

__all__ = ["CANDIDATES", "RotationSelect"]

#: candidate order; index 0 (the fitted rotation) wins ties
CANDIDATES = ("fitted", "hadamard")


def _expand(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.expand_as(like).clone() if like.dim() > x.dim() else x.clone()


class RotationSelect:
    """Accumulates held-out errors of the 2×2 (K, V) rotation candidates and applies the choice.

    ``err[layer]`` is float64 ``[2 (K candidate), 2 (V candidate), H_kv]`` of squared error sums.
    """

    def __init__(
        self,
        fitted: dict[int, LayerRotation],
        spec: QuantSpec,
        head_dim: int,
        granularity: str,
        n_queries: int = 256,
    ):
        self.fitted, self.spec, self.granularity, self.n_queries = fitted, spec, granularity, n_queries
        self.had = hadamard(head_dim, torch.float32)
        self.kf = RowFormat.from_spec(spec, head_dim, "k")
        self.vf = RowFormat.from_spec(spec, head_dim, "v")
        self.eye = torch.eye(head_dim)
        self.err: dict[int, torch.Tensor] = {}
        self.ref: dict[int, torch.Tensor] = {}

    def _roundtrip(self, x: torch.Tensor, r: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
        """Rotate, fake-quantize the middle, rotate back (float32, original basis)."""
        sink, recent = self.spec.sink_tokens, self.spec.recent_tokens
        return rotate_heads(fake_quant_middle(rotate_heads(x, r), fmt, sink, recent), r, inverse=True)

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add one held-out batch (post-RoPE ``q [B, H_q, T, d]``, ``k``/``v [B, H_kv, T, d]``)."""
        lr, eye = self.fitted[layer], self.eye
        ident = LayerRotation(eye, eye, eye[0], eye[0])
        we = WindowedError(
            q, k, v, ident, self.spec.sink_tokens, self.spec.recent_tokens, self.n_queries
        )  # identity basis: candidates are compared in the original basis
        k_hats = [self._roundtrip(we.k_rot, r.float(), self.kf) for r in (lr.k, self.had)]
        v_hats = [self._roundtrip(we.v_rot, r.float(), self.vf) for r in (lr.v, self.had)]
        e = torch.stack([torch.stack([we.head_errors(kh, vh) for vh in v_hats]) for kh in k_hats])
        self.err[layer] = self.err.get(layer, 0) + e
        self.ref[layer] = self.ref.get(layer, 0) + we.head_ref()

    def choices(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: (K choice, V choice) as LongTensors ``[H_kv]`` of candidate indices
        (one shared value per layer for ``layer`` granularity)."""
        out = {}
        for layer, e in self.err.items():
            h = e.shape[-1]
            flat = e.sum(-1, keepdim=True) if self.granularity == "layer" else e
            idx = flat.reshape(4, -1).argmin(0)  # first minimum: (fitted, fitted) wins ties
            out[layer] = ((idx // 2).expand(h), (idx % 2).expand(h))
        return out

    def apply(self) -> tuple[dict[int, LayerRotation], dict[str, dict[str, Any]]]:
        """The selected rotations and a JSON-ready record for the provenance recipe."""
        rots: dict[int, LayerRotation] = {}
        record: dict[str, dict[str, Any]] = {}
        for layer, (ck, cv) in sorted(self.choices().items()):
            lr, e, ref = self.fitted[layer], self.err[layer], self.ref[layer]
            parts = []
            for r, lam, c in ((lr.k, lr.k_eigenvalues, ck), (lr.v, lr.v_eigenvalues, cv)):
                if self.granularity == "layer":
                    use = bool(c[0])
                    parts.append((self.had.clone(), torch.ones_like(lam)) if use else (r, lam))
                else:
                    m = c.bool()
                    r2 = torch.where(m[:, None, None], _expand(self.had, r), r)
                    parts.append((r2, torch.where(m[:, None], torch.ones_like(lam), lam)))
            rots[layer] = LayerRotation(
                parts[0][0], parts[1][0], parts[0][1], parts[1][1], lr.k_clip, lr.v_clip
            )
            tot = max(float(ref.sum()), 1e-30)
            chosen = e[ck, cv, torch.arange(e.shape[-1])].sum()
            names = [[CANDIDATES[int(i)] for i in c] for c in (ck, cv)]
            record[str(layer)] = {
                "k": names[0][0] if self.granularity == "layer" else names[0],
                "v": names[1][0] if self.granularity == "layer" else names[1],
                "err_fitted": float(e[0, 0].sum()) / tot,
                "err_hadamard": float(e[1, 1].sum()) / tot,
                "err_chosen": float(chosen) / tot,
            }
        return rots, record
