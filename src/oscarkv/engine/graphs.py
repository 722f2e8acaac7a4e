"""CUDA-graph decode (engine.md §5.5): one graph per (padded batch, list-length buckets).

On CUDA every decode step is padded to a batch bucket and planned for bucketed list lengths,
captured or not, so a graph replay and an eager step launch the same kernels with the same plans
and give the same tokens. Padding rows write nothing: their new K/V rows go to ``-1`` (skipped),
their demotions move the dummy 16-bit row 0 to the dummy INT2 row 0, and their lists are empty.

A graph is captured the first time its key is seen: one eager run on the static buffers (all
lists empty, no writes outside the dummy pages) compiles and warms every kernel, then the capture.
A replay copies the step's tensors into the graph's static buffers (the lists into the front of
buffers sized for the bucket) and replays; the final hidden states are a view of the graph's output (the LM head runs eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .csr import Csr
from .planner import DecodeTensors

__all__ = ["DecodeGraphs", "batch_bucket", "len_bucket"]

#: the shortest list-length bucket; above it, powers of two
MIN_LEN_BUCKET = 256


def batch_bucket(n: int, max_batch: int) -> int:
    """The padded batch of ``n`` rows: a power of two up to 8, then multiples of 8 up to 64, then
    of 16; at most ``max_batch`` (``1 <= n <= max_batch``)."""
    if n <= 8:
        b = 1 << (n - 1).bit_length()
    else:
        step = 8 if n <= 64 else 16
        b = -(-n // step) * step
    return min(b, max_batch)


def len_bucket(n: int) -> int:
    """The planned length of lists of at most ``n`` tokens: 0 for none (the kernel's plan for
    16-bit lists only differs), else ``MIN_LEN_BUCKET`` and then powers of two."""
    return 0 if n <= 0 else max(MIN_LEN_BUCKET, 1 << (n - 1).bit_length())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # long [B]
    t: DecodeTensors  # static tensors; q/hp indices sized B × bucket
    out: torch.Tensor  # final hidden states [B, hidden]


Forward = Callable[[torch.Tensor, DecodeTensors], torch.Tensor]  # (ids [B], tensors) -> [B, hidden]


class DecodeGraphs:
    """Lazily captured decode graphs over ``forward(ids [B], tensors) -> hidden [B, hidden]``."""

    def __init__(self, forward: Forward, device: torch.device, demote_block: int, int2: bool):
        self.forward, self.device = forward, device
        self.demote_rows = demote_block if int2 else 0
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _static(self, b: int, lens: tuple[int, int]) -> tuple[torch.Tensor, DecodeTensors]:
        dev, nd = self.device, b * self.demote_rows

        def z(n: int, dt: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(n, dtype=dt, device=dev)

        def csr(bucket: int) -> Csr:
            return Csr(z(b + 1, torch.int32), z(max(b * bucket, 1), torch.int32), (0,) * (b + 1))

        t = DecodeTensors(
            positions=z(b),
            decode_dst=torch.full((b,), -1, dtype=torch.long, device=dev),
            demote_src=z(nd),
            demote_dst=z(nd),
            q=csr(lens[0]),
            hp=csr(lens[1]),
            lens_hint=lens,
        )
        return z(b), t

    def capture(self, b: int, lens: tuple[int, int]) -> _Graph:
        ids, t = self._static(b, lens)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            self.forward(ids, t)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(ids, t)
        g = _Graph(graph, ids, t, out)
        self.graphs[(b, *lens)] = g
        return g

    def run(self, ids: torch.Tensor, p: DecodeTensors) -> torch.Tensor:
        """Replay the graph of ``p``'s padded batch and ``p.lens_hint`` (bucketed), capturing it
        first if new; ``ids``/``p`` are the step's padded tensors. Returns the graph's output (a view
        valid until the next replay)."""
        b = ids.shape[0]
        g = self.graphs.get((b, *p.lens_hint)) or self.capture(b, p.lens_hint)
        s = g.t
        g.ids.copy_(ids)
        s.positions.copy_(p.positions)
        s.decode_dst.copy_(p.decode_dst)
        s.demote_src.copy_(p.demote_src)
        s.demote_dst.copy_(p.demote_dst)
        for mine, step in ((s.q, p.q), (s.hp, p.hp)):
            mine.indptr.copy_(step.indptr)
            mine.indices[: step.indices.numel()].copy_(step.indices)
        g.graph.replay()
        return g.out
