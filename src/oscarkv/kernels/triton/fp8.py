"""FP8 block-scaled weights times model-dtype activations: the twins of ``kernels.ref.fp8``.

Checkpoints such as GLM-4.7-FP8 and MiniMax-M2 store every projection as float8_e4m3fn with one
fp32 scale per 128×128 block. One kernel, ``_fp8_mm``, runs both the dense projections and the
routed experts: program ``(m, n)`` loads a ``[BN, BK]`` FP8 tile of its weight, widens it to the
activations' dtype (exact: e4m3 values are bf16 and fp16 values), multiplies it with ``BM`` rows of
activations on the tensor cores in fp32, and scales each 128-column step's product by its block
scale. Weights are read once per row tile, as FP8, so a decode step moves half the bytes of bf16.
Activations are not quantized (weight-only FP8: no per-token activation error).

Routed experts (``GATHER``): the ``T·k`` (token, expert) pairs are sorted by expert and padded to
``BM``-row blocks, one expert per block (``align_pairs``, torch ops with fixed shapes, so CUDA
graphs capture it); a block's program reads its expert's tiles and its pairs' token rows in place.
Gate/up, then ``silu(g)·u``, then down, then the routing weights and the sum over ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launcher

__all__ = ["Fp8Tuning", "align_pairs", "fp8_linear", "fp8_moe_experts"]

SCALE_BLOCK = 128


@dataclass(frozen=True)
class Fp8Tuning:
    """Tiles: ``BM`` activation rows (``bm_small`` up to ``small_rows`` rows or pairs, else
    ``bm_large``), ``BN`` weight rows (divides 128: one block scale per tile and step), ``BK``
    reduction columns (divides 128)."""

    bm_small: int = 16
    bm_large: int = 64
    small_rows: int = 64
    bn: int = 64
    bk: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        if SCALE_BLOCK % self.bn or SCALE_BLOCK % self.bk:
            raise ValueError(f"Fp8Tuning: bn {self.bn} and bk {self.bk} must divide {SCALE_BLOCK}")

    def bm(self, rows: int) -> int:
        return self.bm_small if rows <= self.small_rows else self.bm_large


@triton.jit
def _fp8_mm(X, W, S, Y, ROWS, BLOCK_E, M, N, K, s_xm, s_we, s_wn, s_se, s_sn, s_ym,
            ROW_DIV: tl.constexpr, GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr):  # fmt: skip
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    r = tl.arange(0, BM)
    if GATHER:
        e = tl.load(BLOCK_E + pm).to(tl.int64)
        if e < 0:  # a block past the last expert's pairs
            return
        rows = tl.load(ROWS + pm * BM + r).to(tl.int64)
    else:
        e = tl.zeros([], dtype=tl.int64)
        rows = pm.to(tl.int64) * BM + r
    rm = rows < M
    xr = rows // ROW_DIV
    n = pn * BN + tl.arange(0, BN)
    nm = n < N
    w_rows = W + e * s_we + n[:, None].to(tl.int64) * s_wn
    s_row = S + e * s_se + ((pn * BN) // 128) * s_sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        x = tl.load(X + xr[:, None] * s_xm + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        sc = tl.load(s_row + k0 // 128)
        acc += tl.dot(x, tl.trans(w.to(x.dtype))) * sc
    tl.store(
        Y + rows[:, None] * s_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=rm[:, None] & nm[None, :]
    )


_MM = Launcher(_fp8_mm)


def _launch(x, w, s, y, rows, blocks, m: int, n: int, k: int, row_div: int, bm: int, tu: Fp8Tuning) -> None:
    gather = rows is not None
    grid_m = blocks.shape[0] if gather else triton.cdiv(m, bm)
    s_we, s_se = (w.stride(0), s.stride(0)) if w.dim() == 3 else (0, 0)
    dummy = y  # an unused pointer where the dense path has no pair lists
    _MM((grid_m, triton.cdiv(n, tu.bn)), x, w, s, y, rows if gather else dummy, blocks if gather else dummy,
        m, n, k, x.stride(0), s_we, w.stride(-2), s_se, s.stride(-2), y.stride(0),
        ROW_DIV=row_div, GATHER=gather, BM=bm, BN=tu.bn, BK=tu.bk, num_warps=tu.num_warps,
        num_stages=tu.num_stages)  # fmt: skip


def _check_scales(w: torch.Tensor, s: torch.Tensor, what: str) -> None:
    need = (triton.cdiv(w.shape[-2], SCALE_BLOCK), triton.cdiv(w.shape[-1], SCALE_BLOCK))
    if s.dtype != torch.float32 or s.shape[-2] < need[0] or s.shape[-1] < need[1] or s.stride(-1) != 1:
        raise ValueError(
            f"{what}: scales must be fp32 with unit last stride and at least {list(need)} blocks per "
            f"matrix; got {s.dtype} {list(s.shape)}"
        )
    if w.dtype != torch.float8_e4m3fn or w.stride(-1) != 1:
        raise ValueError(f"{what}: weights must be float8_e4m3fn with unit last stride; got {w.dtype}")


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, tuning: Fp8Tuning = Fp8Tuning()
) -> torch.Tensor:
    """Same contract as ``kernels.ref.fp8.fp8_linear``: ``x [M, K]`` with unit last stride."""
    m, k = x.shape
    if w.dim() != 2 or w.shape[1] != k or x.stride(-1) != 1:
        raise ValueError(
            f"fp8_linear: x [M, K] (unit last stride), w [N, K]; got x {list(x.shape)}, w {list(w.shape)}"
        )
    _check_scales(w, s, "fp8_linear")
    y = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    if m:
        _launch(x, w, s, y, None, None, m, w.shape[0], k, 1, tuning.bm(m), tuning)
    return y


def align_pairs(ids: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``P = T·k`` pairs of ``ids [T, k]`` grouped by expert into ``BM``-row blocks:
    ``rows`` int32 ``[blocks·BM]`` (pair indices, ``P`` for padding) and ``block_expert`` int32
    ``[blocks]`` (-1 past the last block used), ``blocks = ceil(P/BM) + min(E, P)`` (the most any
    routing needs). Fixed shapes and no host reads: capturable in CUDA graphs."""
    flat = ids.reshape(-1).long()
    p, dev = flat.numel(), ids.device
    counts = torch.zeros(experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
    chosen = flat[order]
    dest = ends[chosen] - padded[chosen] + torch.arange(p, device=dev) - first[chosen]
    blocks = triton.cdiv(p, bm) + min(experts, p)
    rows = torch.full((blocks * bm,), p, dtype=torch.int32, device=dev)
    rows[dest] = order.int()
    owner = torch.searchsorted(ends // bm, torch.arange(blocks, device=dev), right=True)
    return rows, torch.where(owner < experts, owner, -1).int()


def fp8_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tuning: Fp8Tuning = Fp8Tuning(),
) -> torch.Tensor:
    """Same contract as ``kernels.ref.fp8.fp8_moe_experts``; ``x`` contiguous."""
    t, h = x.shape
    e, two_i, h2 = w13.shape
    inter, k = two_i // 2, ids.shape[1]
    if h2 != h or w2.shape != (e, h, inter) or ids.shape != (t, k) or weights.shape != (t, k):
        raise ValueError(
            f"fp8_moe_experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k]; got x {list(x.shape)}, "
            f"w13 {list(w13.shape)}, w2 {list(w2.shape)}, weights {list(weights.shape)}, ids {list(ids.shape)}"
        )
    if not x.is_contiguous():
        raise ValueError("fp8_moe_experts: x must be contiguous")
    _check_scales(w13, s13, "fp8_moe_experts w13")
    _check_scales(w2, s2, "fp8_moe_experts w2")
    if t == 0:
        return torch.empty_like(x)
    p, dt = t * k, x.dtype
    bm = tuning.bm(p)
    rows, blocks = align_pairs(ids, e, bm)
    h13 = torch.empty(p, two_i, dtype=dt, device=x.device)
    _launch(x, w13, s13, h13, rows, blocks, p, two_i, h, k, bm, tuning)
    g, u = h13[:, :inter].float(), h13[:, inter:].float()
    a = (torch.nn.functional.silu(g).to(dt).float() * u).to(dt)
    y = torch.empty(p, h, dtype=dt, device=x.device)
    _launch(a, w2, s2, y, rows, blocks, p, h, inter, 1, bm, tuning)
    y = (y.float() * weights.reshape(p, 1).float()).to(dt)
    return y.view(t, k, h).float().sum(dim=1).to(dt)
