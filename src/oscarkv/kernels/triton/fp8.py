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

from .launch import Launcher, device_facts

__all__ = ["Fp8Tuning", "align_pairs", "fp8_linear", "fp8_moe_experts"]

SCALE_BLOCK = 128


@dataclass(frozen=True)
class Fp8Tuning:
    """Tiles and launch shape. Up to ``small_rows`` activation rows a launch uses ``bm_small`` x
    ``bn_small`` tiles (memory-bound GEMV shapes), above it ``bm_large`` x ``bn_large``
    (compute-bound). Routed experts use the small tiles up to ``small_rows`` pairs or
    ``small_pairs_per_expert`` pairs per expert on average: a decode batch spreads its pairs
    thinly (43 tokens x top-8 over 128 experts: 2.7 per expert), and a 128-row block per touched
    expert would be almost all padding, computed at full cost. ``BN`` and ``BK`` divide 128, so a tile's step has one block
    scale. Small launches split the reduction over ``K`` into up to ``max_split`` parts (fp32
    partials, summed after) until they have ``programs_per_sm`` programs per SM, each part keeping
    at least ``min_split_steps`` steps of ``BK`` columns."""

    small_rows: int = 64
    small_pairs_per_expert: int = 16
    bm_small: int = 16
    bn_small: int = 64
    bm_large: int = 128
    bn_large: int = 128
    bk: int = 128
    warps_small: int = 4
    warps_large: int = 8
    stages_small: int = 4
    stages_large: int = 3
    programs_per_sm: int = 2
    max_split: int = 8
    min_split_steps: int = 4

    def __post_init__(self) -> None:
        if SCALE_BLOCK % self.bn_small or SCALE_BLOCK % self.bn_large or SCALE_BLOCK % self.bk:
            raise ValueError(
                f"Fp8Tuning: bn_small {self.bn_small}, bn_large {self.bn_large} and bk {self.bk} must divide {SCALE_BLOCK}"
            )

    def small(self, rows: int, experts: int = 0) -> bool:
        """Whether a launch over ``rows`` activation rows (pairs over ``experts`` routed experts)
        takes the small tiles."""
        return rows <= max(self.small_rows, self.small_pairs_per_expert * experts)

    def launch(self, small: bool, tiles: int, k: int, sms: int) -> tuple[int, int, int, int, int]:
        """``(BM, BN, split, num_warps, num_stages)`` with the small or the large tiles; ``tiles``
        is the number of output tiles of the launch with the small ones; ``k`` the reduction length."""
        if not small:
            return self.bm_large, self.bn_large, 1, self.warps_large, self.stages_large
        split, steps = 1, triton.cdiv(k, self.bk)
        while (
            split < self.max_split
            and tiles * split < self.programs_per_sm * sms
            and steps // (2 * split) >= self.min_split_steps
        ):
            split *= 2
        return self.bm_small, self.bn_small, split, self.warps_small, self.stages_small


@triton.jit
def _fp8_mm(X, W, S, Y, ROWS, BLOCK_E, M, N, K, K_PART, s_xm, s_we, s_wn, s_se, s_sn, s_ys, s_ym,
            ROW_DIV: tl.constexpr, GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr):  # fmt: skip
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)  # this program's part of the reduction: [ps * K_PART, (ps + 1) * K_PART)
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
    k_end = tl.minimum(K, (ps + 1) * K_PART)
    for k0 in range(ps * K_PART, k_end, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < k_end
        x = tl.load(X + xr[:, None] * s_xm + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        sc = tl.load(s_row + k0 // 128)
        acc += tl.dot(x, tl.trans(w.to(x.dtype))) * sc
    out = Y + ps * s_ys + rows[:, None] * s_ym + n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=rm[:, None] & nm[None, :])


_MM = Launcher(_fp8_mm)


def _mm(
    x, w, s, rows, blocks, m: int, n: int, k: int, row_div: int, tu: Fp8Tuning, small: bool
) -> torch.Tensor:
    """``[m, n]`` in ``x``'s dtype: the products of ``m`` rows (pairs, when ``rows`` lists them by
    expert block) with ``w``'s rows, with the small or the large tiles."""
    gather = rows is not None
    sms = device_facts(x.device)[0] or 1

    def tiles(bm: int, bn: int) -> int:
        return (blocks.shape[0] if gather else triton.cdiv(m, bm)) * triton.cdiv(n, bn)

    bm, bn, split, warps, stages = tu.launch(small, tiles(tu.bm_small, tu.bn_small), k, sms)
    if gather and bm != rows.shape[0] // blocks.shape[0]:
        raise ValueError("fp8 experts: the pair blocks were aligned for another tile height")
    k_part = triton.cdiv(triton.cdiv(k, tu.bk), split) * tu.bk
    y = torch.empty((split, m, n) if split > 1 else (1, m, n), dtype=torch.float32 if split > 1 else x.dtype,
                    device=x.device)  # fmt: skip
    s_we, s_se = (w.stride(0), s.stride(0)) if w.dim() == 3 else (0, 0)
    dummy = y  # an unused pointer where the dense path has no pair lists
    grid_m = blocks.shape[0] if gather else triton.cdiv(m, bm)
    _MM((grid_m, triton.cdiv(n, bn), split), x, w, s, y, rows if gather else dummy, blocks if gather else dummy,
        m, n, k, k_part, x.stride(0), s_we, w.stride(-2), s_se, s.stride(-2), y.stride(0), y.stride(1),
        ROW_DIV=row_div, GATHER=gather, BM=bm, BN=bn, BK=tu.bk, num_warps=warps, num_stages=stages)  # fmt: skip
    return y[0] if split == 1 else y.sum(dim=0).to(x.dtype)


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
    if not m:
        return x.new_empty(0, w.shape[0])
    return _mm(x, w, s, None, None, m, w.shape[0], k, 1, tuning, tuning.small(m))


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
    small = tuning.small(p, e)
    rows, blocks = align_pairs(ids, e, tuning.bm_small if small else tuning.bm_large)
    h13 = _mm(x, w13, s13, rows, blocks, p, two_i, h, k, tuning, small)
    g, u = h13[:, :inter].float(), h13[:, inter:].float()
    a = (torch.nn.functional.silu(g).to(dt).float() * u).to(dt)
    y = _mm(a, w2, s2, rows, blocks, p, h, inter, 1, tuning, small)
    y = (y.float() * weights.reshape(p, 1).float()).to(dt)
    return y.view(t, k, h).float().sum(dim=1).to(dt)
