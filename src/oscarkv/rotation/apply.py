"""Applying rotations to per-head tensors (shared by calibration, the cache and evaluation)."""

from __future__ import annotations

import torch

__all__ = ["absorb_output_weight", "absorb_value_weight", "rotate_heads"]


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


@torch.no_grad()
def absorb_value_weight(
    w: torch.Tensor, b: torch.Tensor | None, r_v: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold ``R_V`` into a value projection ``y = x Wᵀ + b`` so that it emits ``v·R_V`` per KV head.

    ``w`` is ``[Hkv·d, in]``, ``b`` is ``[Hkv·d]`` or ``None`` and ``r_v`` is ``[d, d]`` (every head)
    or ``[Hkv, d, d]`` (per KV head). Per head ``h``: ``W_h ← R_Vᵀ W_h`` and ``b_h ← b_h R_V``, in fp32
    math; returns new tensors in the dtypes (and on the device) of ``w`` and ``b``.
    """
    d = head_dim
    if w.dim() != 2 or d < 1 or w.shape[0] % d:
        raise ValueError(f"value weight {tuple(w.shape)} is not [Hkv·{d}, in]")
    hkv = w.shape[0] // d
    if r_v.dim() not in (2, 3) or r_v.shape[-2:] != (d, d) or (r_v.dim() == 3 and r_v.shape[0] != hkv):
        raise ValueError(f"R_V {tuple(r_v.shape)} is neither [{d}, {d}] nor [{hkv}, {d}, {d}]")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"value bias {tuple(b.shape)} is not [{w.shape[0]}]")
    r = r_v.to(device=w.device, dtype=torch.float32)
    rt = r.transpose(-1, -2)
    wf = w.float().view(-1, d, w.shape[1])  # [Hkv, d, in]
    w_new = (rt @ wf) if r.dim() == 2 else torch.einsum("hed,hdi->hei", rt, wf)
    b_new = None
    if b is not None:
        bf = b.float().view(-1, d)
        b_new = (bf @ r if r.dim() == 2 else torch.einsum("hd,hde->he", bf, r)).reshape_as(b).to(b.dtype)
    return w_new.reshape_as(w).to(w.dtype), b_new


@torch.no_grad()
def absorb_output_weight(w: torch.Tensor, r_v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Fold ``R_Vᵀ`` into an output projection ``y = o Wᵀ`` so that it takes attention outputs in
    the rotated basis (``o·R_V`` per query head) and gives the same ``y``.

    ``w`` is ``[out, Hq·d]`` (input columns: query heads), ``r_v`` is ``[d, d]`` (every head) or
    ``[Hkv, d, d]`` (per KV head; query head ``h`` uses KV head ``h // (Hq / Hkv)``). Per query head:
    ``W[:, h] ← W[:, h] R_V``, in fp32 math; returns a new tensor in ``w``'s dtype and device.
    """
    d = head_dim
    if w.dim() != 2 or d < 1 or w.shape[1] % d:
        raise ValueError(f"output weight {tuple(w.shape)} is not [out, Hq·{d}]")
    hq = w.shape[1] // d
    if r_v.dim() not in (2, 3) or r_v.shape[-2:] != (d, d) or (r_v.dim() == 3 and hq % r_v.shape[0]):
        raise ValueError(
            f"R_V {tuple(r_v.shape)} is neither [{d}, {d}] nor [Hkv, {d}, {d}] with Hkv dividing {hq}"
        )
    r = r_v.to(device=w.device, dtype=torch.float32)
    wf = w.float().view(w.shape[0], hq, d).transpose(0, 1)  # [Hq, out, d]
    if r.dim() == 3:
        r = r.repeat_interleave(hq // r.shape[0], dim=0)
    return (wf @ r).transpose(0, 1).reshape_as(w).to(w.dtype)
