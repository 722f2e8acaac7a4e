"""Fused router for a few tokens: the twin of ``kernels.ref.router.route_topk``.

At decode sizes the router's arithmetic is nothing, but eager torch runs it as six to eight
launches (GEMV, softmax or sigmoid, bias add, top-k, sum, divide, casts) of a few µs each, about
30 µs a layer on an H100. Two launches do it here:

- ``_logits``: program ``(token, tile)`` computes ``BE`` logits over ``BK``-column steps in fp32,
  rounded to the model dtype unless the router's logits are fp32 (GLM);
- ``_select``: program ``token`` scores all ``E`` experts (softmax or sigmoid), adds the correction
  bias for selection, takes the top ``k`` by repeated maxima (ties to the lower expert id), and
  writes renormalized, scaled weights and int64 ids in descending order of choice.

Group-limited selection (``n_group > 1``) is not fused: :func:`route_topk` refuses it, and the
engine routes such models with the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launcher

__all__ = ["RouterTuning", "route_topk"]


@dataclass(frozen=True)
class RouterTuning:
    """Tiles of the fused router: ``be`` experts per logits program, ``bk`` columns per step."""

    be: int = 4
    bk: int = 256
    num_warps: int = 2


@triton.jit
def _logits(X, W, L, H, E, FP32: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    em = e < E
    acc = tl.zeros([BE, BK], dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < H
        xv = tl.load(X + t * H + kk, mask=km, other=0.0).to(tl.float32)[None, :]
        w = tl.load(W + e[:, None].to(tl.int64) * H + kk[None, :], mask=em[:, None] & km[None, :], other=0.0)
        acc += w.to(tl.float32) * xv
    lg = tl.sum(acc, axis=1)
    if not FP32:
        lg = lg.to(X.dtype.element_ty).to(tl.float32)
    tl.store(L + t * E + e, lg, mask=em)


@triton.jit
def _select(L, B, WTS, IDS, E, scale, eps, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
            RENORM: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    em = e < E
    lg = tl.load(L + t * E + e, mask=em, other=-float("inf"))
    if SOFTMAX:
        p = tl.exp(lg - tl.max(lg, axis=0))
        s = p / tl.sum(p, axis=0)
        choice = tl.where(em, s, -float("inf"))
    else:
        s = tl.sigmoid(lg)
        choice = s
        if HAS_BIAS:
            choice = s + tl.load(B + e, mask=em, other=0.0)
        choice = tl.where(em, choice, -float("inf"))
    j = tl.arange(0, KP)
    top = tl.zeros([KP], dtype=tl.float32)
    idx = tl.zeros([KP], dtype=tl.int64)
    for r in tl.static_range(K):
        best = tl.min(tl.where(choice == tl.max(choice, axis=0), e, BE), axis=0)
        top = tl.where(j == r, tl.sum(tl.where(e == best, s, 0.0), axis=0), top)
        idx = tl.where(j == r, best.to(tl.int64), idx)
        choice = tl.where(e == best, -float("inf"), choice)
    if RENORM:
        top = top / (tl.sum(top, axis=0) + eps)
    top = top * scale
    tl.store(WTS + t * K + j, top.to(WTS.dtype.element_ty), mask=j < K)
    tl.store(IDS + t * K + j, idx, mask=j < K)


_LOGITS = Launcher(_logits)
_SELECT = Launcher(_select)


def route_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    top_k: int,
    renormalize: bool,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
    fp32_logits: bool = False,
    renorm_eps: float = 0.0,
    tuning: RouterTuning = RouterTuning(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.ref.router.route_topk`` for ``n_group == 1``; ids in descending
    order of choice. ``x`` and ``weight`` contiguous."""
    t, h = x.shape
    e = weight.shape[0]
    if kind not in ("softmax", "sigmoid"):
        raise ValueError(f"route_topk: kind {kind!r}: 'softmax' or 'sigmoid'")
    if n_group != 1:
        raise ValueError(f"route_topk: group-limited selection (n_group={n_group}) runs the reference router")
    if weight.shape != (e, h) or not x.is_contiguous() or not weight.is_contiguous() or not 1 <= top_k <= e:
        raise ValueError(
            f"route_topk: x [T, H] and weight [E, H] contiguous, 1 <= top_k <= E; got x {list(x.shape)}, "
            f"weight {list(weight.shape)}, top_k {top_k}"
        )
    wdt = x.dtype if kind == "softmax" else torch.float32
    wts = torch.empty(t, top_k, dtype=wdt, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return wts, ids
    tu = tuning
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    _LOGITS((t, triton.cdiv(e, tu.be)), x, weight, logits, h, e, FP32=fp32_logits, BE=tu.be, BK=tu.bk,
            num_warps=tu.num_warps)  # fmt: skip
    b = logits if bias is None else bias.float().contiguous()
    _SELECT((t,), logits, b, wts, ids, e, float(scale), float(renorm_eps), SOFTMAX=kind == "softmax",
            HAS_BIAS=bias is not None and kind == "sigmoid", RENORM=renormalize, K=top_k,
            KP=triton.next_power_of_2(top_k), BE=triton.next_power_of_2(e), num_warps=tu.num_warps)  # fmt: skip
    return wts, ids
