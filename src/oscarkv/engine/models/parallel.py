"""Tensor-parallel pieces of the decoder (engine.md §5.9): the rank's shard sizes, row-parallel
linears, the vocab-parallel embedding and LM head, and where each checkpoint tensor is cut.

Column-parallel layers need no class: ``qkv_proj`` and ``gate_up_proj`` are plain
:class:`~.layers.MergedLinear` with the rank's sizes (``Hq/tp`` query heads, ``Hkv/tp`` KV heads,
``I/tp`` MLP columns), filled with the rank's rows. Their outputs stay split; ``o_proj`` and
``down_proj`` take the split inputs and all-reduce their partial sums, so the residual stream is
replicated on every rank. The communicator is an argument (:class:`Comm`), never a global.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ...errors import ModelError

__all__ = [
    "Comm",
    "RowParallelLinear",
    "Shard",
    "VocabParallelEmbedding",
    "check_tensor_parallel",
    "checkpoint_shard",
    "vocab_shard",
]


class Comm(Protocol):
    """One rank's view of its tensor-parallel group (``engine.distributed.TPComm``)."""

    rank: int
    world: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place; returns ``x``."""
        ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on all ranks), in rank order."""
        ...


def check_tensor_parallel(heads: int, kv_heads: int, inter: int, tp: int, where: str = "model") -> None:
    """Raise :class:`ModelError` unless ``tp`` ranks can split the heads and the MLP evenly."""
    if tp == 1:
        return
    for name, n in (("num_key_value_heads", kv_heads), ("num_attention_heads", heads),
                    ("intermediate_size", inter)):  # fmt: skip
        if n % tp:
            ok = [t for t in range(1, n + 1) if n % t == 0 and heads % t == 0 and kv_heads % t == 0
                  and inter % t == 0]  # fmt: skip
            raise ModelError(
                f"{where}: tensor_parallel={tp} splits {name} ({n}) across ranks, and {n} % {tp} != 0",
                f"use a tensor_parallel that divides it: {', '.join(map(str, ok))}",
            )


def vocab_shard(vocab: int, tp: int, rank: int) -> tuple[int, int, int]:
    """``(start, rows held, rows allocated)`` of ``rank``'s vocabulary slice: ``ceil(V/tp)`` rows
    each, the last rank's padded with zero rows past ``V``."""
    per = -(-vocab // tp)
    start = min(rank * per, vocab)
    return start, min(per, vocab - start), per


class Shard(NamedTuple):
    """This rank's part of a checkpoint tensor: ``length`` entries from ``start`` along ``dim``,
    of ``full`` in the checkpoint."""

    dim: int
    start: int
    length: int
    full: int


def checkpoint_shard(
    key: str, *, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int, tp: int, rank: int
) -> Shard | None:
    """Where ``rank`` cuts the HF checkpoint tensor ``key`` (``None``: it holds all of it).

    q/k/v and gate/up are cut by output rows, o_proj and down_proj weights by input columns
    (their biases are whole: added once after the all-reduce), the embedding and LM head by vocab rows.
    """
    if tp == 1:
        return None
    parts = key.split(".")
    name, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    cols = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim,
            "gate_proj": inter, "up_proj": inter}  # fmt: skip
    if name in cols:
        n = cols[name] // tp
        return Shard(0, rank * n, n, cols[name])
    if kind == "weight" and name in ("o_proj", "down_proj"):
        full = heads * head_dim if name == "o_proj" else inter
        return Shard(1, rank * (full // tp), full // tp, full)
    if kind == "weight" and name in ("embed_tokens", "lm_head"):
        start, n, _ = vocab_shard(vocab, tp, rank)
        return Shard(0, start, n, vocab)
    return None


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r W_rᵀ) + b``: ``x_r [T, in/tp]`` is this rank's input columns,
    ``weight [out, in/tp]``, ``bias [out]`` whole; ``y [T, out]`` is replicated."""

    def __init__(self, in_part: int, out: int, bias: bool, comm: Comm, *, dtype: torch.dtype, device: Any):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out, in_part, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(nn.functional.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The rank's vocabulary rows ``weight [ceil(V/tp), hidden]`` (rows past ``V`` are zero).

    ``forward(ids [T]) -> [T, hidden]``: each rank looks up its own ids and zeros the rest, and
    the all-reduce adds one non-zero row per token (exact). :meth:`logits` is the LM head over
    the same kind of slice (the embedding itself when tied).
    """

    def __init__(self, vocab: int, hidden: int, comm: Comm, *, dtype: torch.dtype, device: Any):
        super().__init__()
        self.comm, self.vocab = comm, vocab
        self.start, self.held, rows = vocab_shard(vocab, comm.world, comm.rank)
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        out = (local < 0) | (local >= self.held)
        x = nn.functional.embedding(local.masked_fill(out, 0), self.weight)
        return self.comm.all_reduce(x.masked_fill_(out[:, None], 0))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> fp32 logits ``[n, V]`` (every rank's slice, gathered on every rank)."""
        part = nn.functional.linear(h, self.weight).float().contiguous()
        if part.shape[0] == 0:  # every rank sees the same row count, so all skip the gather
            return part.new_zeros(0, self.vocab)
        return torch.cat(self.comm.all_gather(part), dim=-1)[:, : self.vocab]
