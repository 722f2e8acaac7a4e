"""Fake-quantized attention-output error with OSCAR's windows, and the per-layer clip search.

The error of one layer on one sequence: the last ``n_queries`` queries attend over keys whose
first ``sink`` and last ``recent`` tokens are exact (rotated, 16-bit tiers) and whose middle is
clipped, INT2-quantized and dequantized in the rotated basis; the output is rotated back with
``R_Vᵀ`` and compared with exact attention: ``Σ‖o_q − o‖² / Σ‖o‖²`` (relative squared error;
computed in the rotated basis, which is the same number since ``R_V`` is orthogonal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..config import QuantSpec
from ..quant import RowFormat, fake_quantize_rows
from ..rotation import LayerRotation, rotate_heads

__all__ = ["ClipSearch", "WindowedError", "fake_quant_middle"]


def fake_quant_middle(x_rot: torch.Tensor, fmt: RowFormat, sink: int, recent: int) -> torch.Tensor:
    """Quantize-dequantize rows ``[sink, T - recent)`` of ``x_rot [B, H, T, d]`` (float32)."""
    t = x_rot.shape[2]
    lo, hi = min(sink, t), max(min(sink, t), t - recent)
    out = x_rot.float().clone()
    if hi > lo:
        out[:, :, lo:hi] = fake_quantize_rows(out[:, :, lo:hi], fmt)
    return out


@dataclass
class WindowedError:
    """Evaluates one layer's fake-quantized attention error on one captured sequence batch."""

    q: torch.Tensor  # [B, H_q, T, d]
    k: torch.Tensor  # [B, H_kv, T, d]
    v: torch.Tensor
    rot: LayerRotation
    sink: int
    recent: int
    n_queries: int = 256

    def __post_init__(self) -> None:
        b, hkv, t, d = self.k.shape
        self.g = self.q.shape[1] // hkv
        self.nq = min(self.n_queries, t)
        q_rot = rotate_heads(self.q[:, :, t - self.nq :].float(), self.rot.k.float())
        # group the query heads of each KV head: [B, H_kv, g*nq, d] (no K/V repeat needed)
        self.q_rot = q_rot.reshape(b, hkv, self.g * self.nq, d)
        self.k_rot = rotate_heads(self.k.float(), self.rot.k.float())
        self.v_rot = rotate_heads(self.v.float(), self.rot.v.float())
        qpos = torch.arange(t - self.nq, t, device=self.k.device).repeat(self.g)[:, None]
        self.mask = torch.arange(t, device=self.k.device)[None, :] > qpos
        self.scale = 1.0 / math.sqrt(d)
        # R_V is orthogonal per head, so errors are measured in the rotated basis
        self.ref = self._probs(self.k_rot) @ self.v_rot
        self.ref_sq = float(self.ref.square().sum())

    def _probs(self, k_rot: torch.Tensor) -> torch.Tensor:
        s = (self.q_rot @ k_rot.transpose(-1, -2)) * self.scale
        return s.masked_fill(self.mask, float("-inf")).softmax(-1)

    def _out_error(self, p: torch.Tensor, v_hat: torch.Tensor) -> float:
        return float((p @ v_hat - self.ref).square().sum())

    def error(self, k_hat: torch.Tensor, v_hat: torch.Tensor) -> float:
        """Squared error sum of the attention output with the given (rotated) K and V."""
        return self._out_error(self._probs(k_hat), v_hat)

    def head_errors(self, k_hat: torch.Tensor, v_hat: torch.Tensor) -> torch.Tensor:
        """Per-KV-head squared error sums ``[H_kv]`` (float64) with the given (rotated) K and V."""
        return (self._probs(k_hat) @ v_hat - self.ref).square().sum((0, 2, 3)).double()

    def head_ref(self) -> torch.Tensor:
        """Per-KV-head ``Σ‖o‖²`` of the exact output ``[H_kv]`` (float64)."""
        return self.ref.square().sum((0, 2, 3)).double()

    def quantized_k(self, fmt: RowFormat) -> torch.Tensor:
        return fake_quant_middle(self.k_rot, fmt, self.sink, self.recent)

    def quantized_v(self, fmt: RowFormat) -> torch.Tensor:
        return fake_quant_middle(self.v_rot, fmt, self.sink, self.recent)

    def sweep(
        self, kf: RowFormat, vf: RowFormat, k_grid: tuple[float, ...], v_grid: tuple[float, ...]
    ) -> tuple[list[float], list[float]]:
        """Errors over ``k_grid`` (V at ``vf.clip``) and ``v_grid`` (K at ``kf.clip``)."""
        k_def, v_def = self.quantized_k(kf), self.quantized_v(vf)
        k_errs = [self.error(self.quantized_k(replace(kf, clip=c)), v_def) for c in k_grid]
        p_def = self._probs(k_def)
        v_errs = [self._out_error(p_def, self.quantized_v(replace(vf, clip=c))) for c in v_grid]
        return k_errs, v_errs


class ClipSearch:
    """Accumulates per-layer clip-ratio errors over held-out batches and picks the minimisers.

    K and V ratios are searched one at a time (the other at the spec's global ratio); the
    global ratio is always in the grid, so the chosen pair is never worse on the held-out data
    for either coordinate.
    """

    def __init__(
        self,
        rotations: dict[int, LayerRotation],
        spec: QuantSpec,
        head_dim: int,
        k_grid: tuple[float, ...],
        v_grid: tuple[float, ...],
        n_queries: int = 256,
    ):
        self.rotations, self.spec, self.n_queries = rotations, spec, n_queries
        self.k_grid = tuple(sorted(set(k_grid) | {spec.k_clip}))
        self.v_grid = tuple(sorted(set(v_grid) | {spec.v_clip}))
        self.kf = RowFormat.from_spec(spec, head_dim, "k")
        self.vf = RowFormat.from_spec(spec, head_dim, "v")
        self.k_err: dict[int, torch.Tensor] = {}
        self.v_err: dict[int, torch.Tensor] = {}
        self.ref: dict[int, float] = {}

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        we = WindowedError(
            q, k, v, self.rotations[layer], self.spec.sink_tokens, self.spec.recent_tokens, self.n_queries
        )
        ke, ve = we.sweep(self.kf, self.vf, self.k_grid, self.v_grid)
        self.k_err[layer] = self.k_err.get(layer, 0) + torch.tensor(ke, dtype=torch.float64)
        self.v_err[layer] = self.v_err.get(layer, 0) + torch.tensor(ve, dtype=torch.float64)
        self.ref[layer] = self.ref.get(layer, 0.0) + we.ref_sq

    def result(self) -> dict[int, dict[str, float]]:
        """Per layer: chosen ``k_clip``/``v_clip`` and relative errors at the global and chosen ratios."""
        out = {}
        for layer, ke in self.k_err.items():
            ve, ref = self.v_err[layer], max(self.ref[layer], 1e-30)
            ik, iv = int(ke.argmin()), int(ve.argmin())
            out[layer] = {
                "k_clip": self.k_grid[ik],
                "v_clip": self.v_grid[iv],
                "k_err_global": float(ke[self.k_grid.index(self.spec.k_clip)]) / ref,
                "k_err_best": float(ke[ik]) / ref,
                "v_err_global": float(ve[self.v_grid.index(self.spec.v_clip)]) / ref,
                "v_err_best": float(ve[iv]) / ref,
            }
        return out
