"""Applying rotations to per-head tensors (shared by calibration, the cache and evaluation)."""

from __future__ import annotations

import torch

__all__ = ["rotate_heads"]


def rotate_heads(x: torch.Tensor, r: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate rows of ``x`` ``[B, H, T, d]`` with ``r``.

    ``r`` is ``[d, d]`` (shared by all heads) or ``[H_r, d, d]`` (per KV head); when ``H`` is a
    multiple of ``H_r`` (query heads of a GQA group), each KV head's matrix is reused for its
    contiguous group of ``H / H_r`` heads. ``inverse`` applies ``rᵀ`` (row convention: ``x @ rᵀ``).
    The math runs in ``x``'s dtype.
    """
    r = r.to(device=x.device, dtype=x.dtype)
    if inverse:
        r = r.transpose(-1, -2)
    if r.dim() == 2:
        return x @ r
    h, hr = x.shape[1], r.shape[0]
    if h % hr:
        raise ValueError(f"{h} heads cannot share {hr} per-head rotations")
    if h != hr:
        r = r.repeat_interleave(h // hr, dim=0)
    return x @ r[None]
