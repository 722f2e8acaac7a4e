"""Linear layers with a weight method: how a projection's weights are stored, loaded and applied.

A method is a frozen object; every linear of a model takes the model's method, so a quantized
checkpoint adds no branch to the decoder or the loader. :class:`Unquantized` keeps one weight in
the model dtype. Checkpoint tensors land through :meth:`Linear.checkpoint_targets`: the names a
checkpoint holds for this layer (``q_proj.weight``, ``q_proj.weight_scale_inv``, ...), each with
the view it fills and the slice of the checkpoint tensor this rank reads (tensor parallelism).

Column-parallel layers (``q|k|v``, ``gate|up``) hold their rank's output rows and return split
outputs; row-parallel layers (``o_proj``, ``down_proj``) hold their rank's input columns and sum
their partial outputs over the ranks (``comm.all_reduce``), adding the bias once after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ...kernels import KernelOps
from .parallel import Comm, Shard

__all__ = [
    "ColumnLinear",
    "ConcatColumns",
    "Linear",
    "LinearMethod",
    "RowLinear",
    "Target",
    "Unquantized",
    "blocks_of",
]


class Target(NamedTuple):
    """Where one checkpoint tensor goes: ``dst`` (a view of a parameter) and the slice of the
    checkpoint tensor this rank reads (``None``: all of it)."""

    dst: torch.Tensor
    shard: Shard | None


@dataclass(frozen=True)
class LinearMethod:
    """How one linear's weights are stored and applied. Subclasses override every method."""

    name = "base"
    block = (1, 1)  # (rows, columns) one scale covers: a fused part must start on a whole block

    def create(self, layer: Linear, out_features: int, in_features: int, bias: bool) -> None:
        """Register ``layer``'s parameters for a ``[*layer.lead, out, in]`` weight (this rank's part;
        ``lead`` is ``(E,)`` for stacked experts, else ``()``)."""
        raise NotImplementedError

    def tensors(self, layer: Linear) -> dict[str, tuple[torch.Tensor, int, int]]:
        """The checkpoint suffixes of ``layer``'s tensors -> ``(tensor, rows per output row,
        columns per input column)``: a weight is ``(w, 1, 1)``, a 128×128-block scale ``(s, 128, 128)``."""
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` -> ``x Wᵀ [T, out]`` in the model dtype (bias not added)."""
        raise NotImplementedError

    def finish(self, layer: Linear, ops: KernelOps | None = None) -> None:
        """After loading: turn the loaded tensors into what :meth:`apply` reads (``ops``: the
        backend's kernels, which decide what a quantized weight runs on)."""

    def stacked(self, layer: Linear) -> torch.Tensor:
        """Stacked experts' weights ``[E, out, in]`` in the model dtype, as the grouped GEMMs read them."""
        raise NotImplementedError

    def dense_weight(self, layer: Linear, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Output rows ``[start, stop)`` (all: ``None``) of the weight as fp32 ``[rows, in]``."""
        raise NotImplementedError

    def set_dense_weight(self, layer: Linear, w: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Store fp32 ``w`` as output rows ``[start, stop)`` (rounded or quantized as stored)."""
        raise NotImplementedError

    def fill_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        """Random N(0, 0.02) weights drawn from ``generator``, stored as the method stores them
        (``load_format="dummy"``; the bias is the loader's)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Unquantized(LinearMethod):
    """One ``weight [out, in]`` in the model dtype, applied with ``F.linear``."""

    name = "unquantized"

    def create(self, layer: Linear, out_features: int, in_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(*layer.lead, out_features, in_features, **layer.factory))

    def tensors(self, layer: Linear) -> dict[str, tuple[torch.Tensor, int, int]]:
        return {"weight": (layer.weight, 1, 1)}

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, layer.weight)

    def stacked(self, layer: Linear) -> torch.Tensor:
        return layer.weight

    def dense_weight(self, layer: Linear, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return _rows(layer.weight.detach(), rows).float()

    def set_dense_weight(self, layer: Linear, w: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        _rows(layer.weight.detach(), rows).copy_(w)

    def fill_dummy(self, layer: Linear, generator: torch.Generator) -> None:
        layer.weight.detach().normal_(0.0, 0.02, generator=generator)


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0] : rows[1]]


class Linear(nn.Module):
    """A projection ``[T, in] -> [T, out]`` whose weights ``method`` owns (this rank's part)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        method: LinearMethod,
        *,
        dtype: torch.dtype,
        device: Any,
        lead: tuple[int, ...] = (),
    ):
        super().__init__()
        self.in_features, self.out_features, self.lead = in_features, out_features, lead
        self.method = method
        self.factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.kernel: Any = None  # what ``method`` runs the weights with on a GPU, chosen at finish
        method.create(self, out_features, in_features, bias)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.bias is None else y + self.bias

    def finish(self, ops: KernelOps | None = None) -> None:
        self.method.finish(self, ops)

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        """``{"{prefix}.weight": Target, ...}`` for a plain (unsplit, unsharded) projection."""
        out = {f"{prefix}.{k}": Target(t, None) for k, (t, _, _) in self.method.tensors(self).items()}
        if self.bias is not None:
            out[f"{prefix}.bias"] = Target(self.bias.detach(), None)
        return out


def blocks_of(n: int, unit: int, what: str) -> int:
    """``n // unit``; raises ``ValueError`` naming ``what`` unless ``unit`` divides ``n``."""
    if n % unit:
        raise ValueError(f"{what}: {n} (this rank's part) is not a multiple of the weight block {unit}")
    return n // unit


class ColumnLinear(Linear):
    """Several projections of one input side by side (``q|k|v``, ``gate|up``), each this rank's
    rows: ``sizes`` are the rank's output sizes and ``full`` the checkpoint's (``sizes`` when not
    sharded). ``names`` are the checkpoint names of the parts, in order."""

    def __init__(
        self,
        in_features: int,
        sizes: Sequence[int],
        bias: bool,
        method: LinearMethod,
        *,
        names: Sequence[str],
        comm: Comm | None = None,
        dtype: torch.dtype,
        device: Any,
    ):
        super().__init__(in_features, sum(sizes), bias, method, dtype=dtype, device=device)
        self.sizes, self.names = tuple(int(s) for s in sizes), tuple(names)
        self.rank, self.world = (0, 1) if comm is None else (comm.rank, comm.world)

    def part_rows(self, i: int) -> tuple[int, int]:
        """Output rows ``[start, stop)`` of part ``i``."""
        start = sum(self.sizes[:i])
        return start, start + self.sizes[i]

    def shard(self, t: torch.Tensor, i: int, unit: int = 1) -> torch.Tensor:
        """Part ``i``'s rows of ``t`` (a weight, bias or scale with ``unit`` output rows per row)."""
        what = f"{self.names[i]} rows"
        return t.narrow(0, blocks_of(sum(self.sizes[:i]), unit, what), self._units(i, unit))

    def _units(self, i: int, unit: int) -> int:
        """Rows of ``t`` that part ``i`` owns: whole blocks, but an unsharded last part may end in
        a partial block (its checkpoint has ``ceil(rows / unit)`` scale rows)."""
        if self.world == 1 and i == len(self.sizes) - 1:
            return -(-self.sizes[i] // unit)
        return blocks_of(self.sizes[i], unit, f"{self.names[i]} rows")

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[T, sum(sizes)]`` -> one ``[T, size]`` view per projection."""
        return y.split(self.sizes, dim=-1)

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        parent = prefix.rpartition(".")[0]
        tensors = dict(self.method.tensors(self))
        if self.bias is not None:
            tensors["bias"] = (self.bias, 1, 1)
        out = {}
        for i, name in enumerate(self.names):
            for kind, (t, unit, _) in tensors.items():
                n = self._units(i, unit)
                shard = None if self.world == 1 else Shard(0, self.rank * n, n, n * self.world)
                out[f"{parent}.{name}.{kind}"] = Target(self.shard(t.detach(), i, unit), shard)
        return out


class ConcatColumns(nn.Module):
    """Column-parallel projections of one input run one after another, outputs concatenated: the
    ``gate|up`` pair where the weight method cannot fuse them, because a part's rows end inside a
    scale block (GLM-4.5-Air's FP8 dense MLP: 10944 rows, 85.5 blocks of 128)."""

    def __init__(self, parts: Sequence[ColumnLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        return {k: v for p in self.parts for k, v in p.checkpoint_targets(prefix).items()}


class RowLinear(Linear):
    """This rank's input columns ``[out, in/tp]`` of a projection whose partial outputs are summed
    over the ranks (``comm``; none: a plain linear). The bias is whole, added after the sum."""

    def __init__(
        self,
        in_part: int,
        out_features: int,
        bias: bool,
        method: LinearMethod,
        *,
        comm: Comm | None = None,
        dtype: torch.dtype,
        device: Any,
    ):
        super().__init__(in_part, out_features, bias, method, dtype=dtype, device=device)
        self.comm = comm

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False`` returns this rank's partial sum (no bias; the caller reduces several
        partial sums at once and adds the biases)."""
        y = self.method.apply(self, x)
        if not reduce:
            return y
        if self.comm is not None:
            y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        out = {}
        for kind, (t, _, unit) in self.method.tensors(self).items():
            shard = None
            if self.comm is not None:
                n = blocks_of(self.in_features, unit, f"{prefix} input columns")
                shard = Shard(1, self.comm.rank * n, n, n * self.comm.world)
            out[f"{prefix}.{kind}"] = Target(t.detach(), shard)
        if self.bias is not None:
            out[f"{prefix}.bias"] = Target(self.bias.detach(), None)
        return out
