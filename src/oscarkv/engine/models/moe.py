"""Mixture-of-experts blocks: routers, stacked experts, optional shared experts.

Every routed token picks ``top_k`` of ``E`` experts; an expert is a SiLU-gated MLP. The experts
of a layer are stacked at load, ``w13 [E, 2I, H]`` (each expert's gate rows, then its up rows,
as transformers' ``gate_up_proj``) and ``w2 [E, H, I]``, so one grouped GEMM per projection runs
every routed token of a step (:func:`grouped_experts`). :func:`looped_experts` is the reference
twin: transformers' eager loop over the experts a step touches, in the same order and dtypes.

Tensor parallelism splits every expert along its intermediate dimension (``I/tp`` gate and up
rows, ``I/tp`` down columns per rank): the routers are replicated, each rank computes partial
outputs, and one all-reduce sums the routed and the shared experts' partial outputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...kernels.ref.router import route_topk
from .linear import ColumnLinear, ConcatColumns, Linear, LinearMethod, RowLinear, Target, blocks_of
from .parallel import Comm, Shard

__all__ = ["Experts", "Routing", "SparseMoe", "grouped_experts", "looped_experts", "route"]


@dataclass(frozen=True)
class Routing:
    """How a router turns logits into ``top_k`` experts and weights (transformers' three kinds; the
    fields are the keyword arguments of ``kernels.ref.router.route_topk``, which documents them):
    ``softmax`` (Qwen3-MoE) or ``sigmoid`` (GLM-4 MoE, MiniMax-M2) with a selection-only correction
    bias, group-limited top-k (``n_group``, ``topk_group``), renormalization and a scale."""

    kind: str
    top_k: int
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0
    fp32_logits: bool = False
    renorm_eps: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("softmax", "sigmoid"):
            raise ValueError(f"Routing.kind {self.kind!r}: 'softmax' or 'sigmoid'")


def route(
    routing: Routing, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` (model dtype), router ``weight [E, H]``, correction ``bias`` fp32 ``[E]`` or None
    -> ``(weights [T, k]`` (model dtype for softmax, fp32 for sigmoid), ``ids`` int64 ``[T, k])``:
    the reference router (``kernels.ref.router.route_topk``) with ``routing``'s fields."""
    return route_topk(x, weight, bias, **dataclasses.asdict(routing))


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def looped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Reference: ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``weights``/``ids [T, k]`` ->
    ``[T, H]`` in ``x``'s dtype; each touched expert in turn over its tokens, summed with
    ``index_add_`` (transformers' eager experts). Syncs with the host (not for CUDA graphs)."""
    out = torch.zeros_like(x)
    e = w13.shape[0]
    hit = torch.bincount(ids.flatten(), minlength=e).nonzero().flatten().tolist()
    for i in hit:
        tok, pos = torch.where(ids == i)
        h = nn.functional.linear(_silu_mul(nn.functional.linear(x[tok], w13[i])), w2[i])
        out.index_add_(0, tok, (h * weights[tok, pos, None]).to(out.dtype))
    return out


def grouped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """:func:`looped_experts` as two grouped GEMMs over the routed rows sorted by expert
    (``torch.nn.functional.grouped_mm``). No host sync, so it runs inside CUDA graphs; each
    token's ``k`` outputs are summed in a fixed order (deterministic, unlike atomics)."""
    t, k = ids.shape
    e = w13.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[order // k]
    h = nn.functional.grouped_mm(rows, w13.transpose(1, 2), offs=offs)
    y = nn.functional.grouped_mm(_silu_mul(h), w2.transpose(1, 2), offs=offs)
    y = (y * weights.flatten()[order, None]).to(x.dtype)
    out = torch.empty_like(y)
    out[order] = y
    return out.view(t, k, -1).sum(dim=1)


class Experts(nn.Module):
    """``E`` stacked experts of this rank (``I/tp`` of each expert's intermediate rows).

    ``names`` are the checkpoint names of one expert's gate, up and down projections
    (``gate_proj, up_proj, down_proj``; MiniMax: ``w1, w3, w2``).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        method: LinearMethod,
        *,
        names: tuple[str, str, str],
        comm: Comm | None = None,
        dtype: torch.dtype,
        device: Any,
    ):
        super().__init__()
        self.rank, self.world = (0, 1) if comm is None else (comm.rank, comm.world)
        self.inter = inter // self.world
        self.names = names
        kw: dict[str, Any] = {"dtype": dtype, "device": device, "lead": (num_experts,)}
        self.w13 = Linear(hidden, 2 * self.inter, False, method, **kw)
        self.w2 = Linear(self.inter, hidden, False, method, **kw)
        # set by the decoder: grouped GEMMs (CUDA, bf16) or the reference loop; and a fused kernel
        # (``KernelOps.moe_experts``) for steps of at most ``small_tokens`` tokens
        self.grouped = False
        self.small: Any = None
        self.small_tokens = 0
        # set by the decoder where the experts stay FP8 (CUDA): ``KernelOps.fp8_moe_experts``
        self.fp8: Any = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``weights``/``ids [T, k]`` -> this rank's partial ``[T, H]``."""
        if self.fp8 is not None:
            a, b = self.w13, self.w2
            return self.fp8(x, a.weight, a.weight_scale_inv, b.weight, b.weight_scale_inv, weights, ids)
        w13, w2 = self.w13.method.stacked(self.w13), self.w2.method.stacked(self.w2)
        if self.small is not None and x.shape[0] <= self.small_tokens:
            return self.small(x, w13, w2, weights, ids)
        fn = grouped_experts if self.grouped else looped_experts
        return fn(x, w13, w2, weights, ids)

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        """``{prefix}.{e}.{gate|up|down}.{weight|...}`` -> expert ``e``'s rows (gate and up) or
        columns (down) of this rank."""
        gate, up, down = self.names
        out = {}
        for kind, (t, unit, _) in self.w13.method.tensors(self.w13).items():
            n = blocks_of(self.inter, unit, f"{prefix} gate/up rows")
            shard = None if self.world == 1 else Shard(0, self.rank * n, n, n * self.world)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{gate}.{kind}"] = Target(t.detach()[e, :n], shard)
                out[f"{prefix}.{e}.{up}.{kind}"] = Target(t.detach()[e, n:], shard)
        for kind, (t, _, unit) in self.w2.method.tensors(self.w2).items():
            n = blocks_of(self.inter, unit, f"{prefix} down columns")
            shard = None if self.world == 1 else Shard(1, self.rank * n, n, n * self.world)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{down}.{kind}"] = Target(t.detach()[e], shard)
        return out


class DenseMLP(nn.Module):
    """``down(silu(gate(x)) · up(x))`` with ``gate|up`` fused (column-parallel) and ``down``
    row-parallel under tensor parallelism. ``names``: the checkpoint names of gate, up, down."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        bias: bool,
        method: LinearMethod,
        act: Any,
        *,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        comm: Comm | None = None,
        dtype: torch.dtype,
        device: Any,
    ):
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device, "comm": comm}
        part = inter // (1 if comm is None else comm.world)
        self.gate_up_proj: ColumnLinear | ConcatColumns
        if part % method.block[0]:  # gate's scale blocks would end inside up's: two GEMMs
            cols = [ColumnLinear(hidden, (part,), bias, method, names=(n,), **kw) for n in names[:2]]
            self.gate_up_proj = ConcatColumns(cols)
        else:
            self.gate_up_proj = ColumnLinear(hidden, (part, part), bias, method, names=names[:2], **kw)
        self.down_proj = RowLinear(part, hidden, bias, method, **kw)
        self.down_name = names[2]
        self.act = act

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)), reduce)

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        return {
            **self.gate_up_proj.checkpoint_targets(f"{prefix}.gate_up_proj"),
            **self.down_proj.checkpoint_targets(f"{prefix}.{self.down_name}"),
        }


class SparseMoe(nn.Module):
    """Router + routed experts (+ shared experts): ``[T, H] -> [T, H]``, replicated over ranks.

    ``gate_name`` is the router's checkpoint name (``gate``); ``bias_name`` where the correction
    bias lives (``gate.e_score_correction_bias`` for GLM, ``e_score_correction_bias`` for MiniMax).
    """

    def __init__(
        self,
        hidden: int,
        routing: Routing,
        experts: Experts,
        shared: DenseMLP | None,
        *,
        bias_name: str | None,
        comm: Comm | None = None,
        dtype: torch.dtype,
        device: Any,
    ):
        super().__init__()
        self.routing, self.comm, self.bias_name = routing, comm, bias_name
        e = experts.w13.lead[0]
        self.gate = nn.Parameter(torch.empty(e, hidden, dtype=dtype, device=device))
        self.correction = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32, device=device)) if bias_name else None
        )
        self.experts, self.shared = experts, shared
        self.route_kw = dataclasses.asdict(routing)
        # set by the decoder: the backend's fused router for steps of at most ``fast_route_tokens``
        self.fast_route: Any = None
        self.fast_route_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self.fast_route is not None and x.shape[0] <= self.fast_route_tokens
        weights, ids = (self.fast_route if fast else route_topk)(
            x, self.gate, self.correction, **self.route_kw
        )
        y = self.experts(x, weights, ids)
        if self.shared is not None:
            y = y + self.shared(x, reduce=False)
        return y if self.comm is None else self.comm.all_reduce(y)

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        out = {f"{prefix}.gate.weight": Target(self.gate.detach(), None)}
        if self.correction is not None:
            out[f"{prefix}.{self.bias_name}"] = Target(self.correction.detach(), None)
        out.update(self.experts.checkpoint_targets(f"{prefix}.experts"))
        if self.shared is not None:
            out.update(self.shared.checkpoint_targets(f"{prefix}.shared_experts"))
        return out
