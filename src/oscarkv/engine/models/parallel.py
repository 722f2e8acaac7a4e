"""Tensor-parallel pieces of the decoder (engine.md, tensor parallelism): the communicator
protocol, checkpoint slices (:class:`Shard`) and the vocab-parallel embedding and LM head.

Column- and row-parallel projections are :mod:`.linear`'s ``ColumnLinear`` and ``RowLinear``;
each module says which slice of each checkpoint tensor its rank reads. The residual stream is
replicated on every rank. The communicator is an argument (:class:`Comm`), never a global.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

__all__ = ["Comm", "Shard", "VocabParallelEmbedding", "vocab_shard"]


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
