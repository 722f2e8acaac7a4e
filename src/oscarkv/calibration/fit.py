"""Targets -> rotations: eigendecomposition and OSCAR's ``U·H·P`` per layer or per KV head."""

from __future__ import annotations

import torch

from ..rotation import LayerRotation, compose, hadamard

__all__ = ["fit_layer", "fixed_layer"]


def _sym(c: torch.Tensor) -> torch.Tensor:
    return (c + c.transpose(-1, -2)) / 2


def _eig_rotation(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``c [d, d]`` float64 -> (fp32 rotation ``U·H·P``, fp32 ascending eigenvalues)."""
    lam, u = torch.linalg.eigh(_sym(c).cpu())
    return compose(lam, u).float(), lam.float()


def fit_layer(ck: torch.Tensor, cv: torch.Tensor, granularity: str) -> LayerRotation:
    """Fit one layer from per-KV-head targets ``[H_kv, d, d]`` (float64).

    ``layer``: one matrix from the head-averaged, symmetrised target (spec §2.2-2.3).
    ``kv_head``: one matrix per KV head from that head's own target.
    """
    if granularity == "layer":
        rk, lk = _eig_rotation(ck.mean(0))
        rv, lv = _eig_rotation(cv.mean(0))
        return LayerRotation(rk, rv, lk, lv)
    ks = [_eig_rotation(c) for c in ck]
    vs = [_eig_rotation(c) for c in cv]
    return LayerRotation(
        torch.stack([r for r, _ in ks]),
        torch.stack([r for r, _ in vs]),
        torch.stack([e for _, e in ks]),
        torch.stack([e for _, e in vs]),
    )


def fixed_layer(method: str, head_dim: int, num_kv_heads: int, granularity: str) -> LayerRotation:
    """Data-free rotations: ``hadamard`` (R = H, eigenvalues 1, as OSCAR writes them) or ``identity``."""
    r = hadamard(head_dim, torch.float32) if method == "hadamard" else torch.eye(head_dim)
    lam = torch.ones(head_dim)
    if granularity == "kv_head":
        r, lam = r.expand(num_kv_heads, -1, -1).clone(), lam.expand(num_kv_heads, -1).clone()
    return LayerRotation(r, r.clone(), lam, lam.clone())
