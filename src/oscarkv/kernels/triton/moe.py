"""Fused experts for a few tokens: the twin of ``kernels.ref.moe.moe_experts``.

At decode batches of a few tokens each expert is a GEMV, and the grouped GEMM (sort, pad to
tiles, two ``grouped_mm`` calls) costs more than reading the chosen experts' weights. Two
launches read each chosen expert's rows in place, with no gather and no sort:

- ``_gate_up``: program ``(pair, tile)`` multiplies token ``pair // k`` by ``BN`` gate rows and the
  matching ``BN`` up rows of expert ``ids[pair]``, and writes ``silu(g) · u``;
- ``_down``: program ``(token, tile)`` runs its ``k`` pairs through ``BN`` down rows each, all ``k``
  experts' rows loaded together, weights them and sums them (a fixed reduction tree:
  deterministic), and writes the token's output tile.

Products accumulate in fp32 over ``[BN, BK]`` tiles reduced once; values are rounded to the model
dtype where the twin rounds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launcher

__all__ = ["MoeTuning", "moe_experts"]


@dataclass(frozen=True)
class MoeTuning:
    """Tiles of the fused experts: ``BN`` output rows per program, ``BK`` reduction columns per step
    (the down kernel holds a ``[k, BN, BK]`` tile: every chosen expert's rows at once);
    ``small_tokens``: the largest step the engine sends here rather than to the grouped GEMMs."""

    small_tokens: int = 16
    up_bn: int = 16
    down_bn: int = 8
    bk: int = 256
    down_bk: int = 128
    num_warps: int = 2


@triton.jit
def _gate_up(X, W13, IDS, A, H, I, s_we, s_wn, K_TOP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    t = p // K_TOP
    e = tl.load(IDS + p).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < I
    acc_g = tl.zeros([BN, BK], dtype=tl.float32)
    acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    base = W13 + e * s_we
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < H
        xv = tl.load(X + t * H + kk, mask=km, other=0.0).to(tl.float32)[None, :]
        m = nm[:, None] & km[None, :]
        wg = tl.load(base + n[:, None].to(tl.int64) * s_wn + kk[None, :], mask=m, other=0.0)
        wu = tl.load(base + (n + I)[:, None].to(tl.int64) * s_wn + kk[None, :], mask=m, other=0.0)
        acc_g += wg.to(tl.float32) * xv
        acc_u += wu.to(tl.float32) * xv
    dt = A.dtype.element_ty
    g = tl.sum(acc_g, axis=1).to(dt).to(tl.float32)
    u = tl.sum(acc_u, axis=1).to(dt).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(dt).to(tl.float32) * u
    tl.store(A + p * I + n, a.to(dt), mask=nm)


@triton.jit
def _down(A, W2, IDS, WTS, OUT, H, I, s_we, s_wn, K_TOP: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BN + tl.arange(0, BN)
    hm = h < H
    j = tl.arange(0, KP)
    jm = j < K_TOP
    p = t * K_TOP + j
    e = tl.load(IDS + p, mask=jm, other=0).to(tl.int64)
    rows = W2 + e[:, None, None] * s_we + h[None, :, None].to(tl.int64) * s_wn
    acc = tl.zeros([KP, BN, BK], dtype=tl.float32)
    for k0 in range(0, I, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < I
        av = tl.load(A + p[:, None] * I + kk[None, :], mask=jm[:, None] & km[None, :], other=0.0)
        m = (jm[:, None] & hm[None, :])[:, :, None] & km[None, None, :]
        w = tl.load(rows + kk[None, None, :], mask=m, other=0.0)
        acc += w.to(tl.float32) * av.to(tl.float32)[:, None, :]
    dt = OUT.dtype.element_ty
    y = tl.sum(acc, axis=2).to(dt).to(tl.float32)
    wt = tl.load(WTS + p, mask=jm, other=0.0).to(tl.float32)
    out = tl.sum((y * wt[:, None]).to(dt).to(tl.float32), axis=0)
    tl.store(OUT + t * H + h, out.to(dt), mask=hm)


_GATE_UP = Launcher(_gate_up)
_DOWN = Launcher(_down)


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tuning: MoeTuning = MoeTuning(),
) -> torch.Tensor:
    """Same contract as ``kernels.ref.moe.moe_experts``; ``x`` contiguous, each expert's rows
    contiguous (``w13``/``w2`` with unit stride in their last dim)."""
    t, h = x.shape
    e, two_i, h2 = w13.shape
    inter = two_i // 2
    k = ids.shape[1]
    if h2 != h or w2.shape != (e, h, inter) or ids.shape != (t, k) or weights.shape != (t, k):
        raise ValueError(
            f"moe_experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k]; got x {list(x.shape)}, "
            f"w13 {list(w13.shape)}, w2 {list(w2.shape)}, weights {list(weights.shape)}, ids {list(ids.shape)}"
        )
    if not x.is_contiguous() or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("moe_experts: x contiguous and unit stride in the weights' last dim")
    out = torch.empty_like(x)
    if t == 0:
        return out
    ids_c, wts = ids.contiguous(), weights.contiguous()
    a = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    tu = tuning
    _GATE_UP((t * k, triton.cdiv(inter, tu.up_bn)), x, w13, ids_c, a, h, inter, w13.stride(0), w13.stride(1),
             K_TOP=k, BN=tu.up_bn, BK=tu.bk, num_warps=tu.num_warps)  # fmt: skip
    _DOWN((t, triton.cdiv(h, tu.down_bn)), a, w2, ids_c, wts, out, h, inter, w2.stride(0), w2.stride(1),
          K_TOP=k, KP=triton.next_power_of_2(k), BN=tu.down_bn, BK=tu.down_bk, num_warps=tu.num_warps)  # fmt: skip
    return out
