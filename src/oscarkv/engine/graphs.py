"""CUDA-graph decode (engine.md §5.5): one graph per (padded batch, list-length buckets).

On CUDA every decode step is padded to a batch bucket and planned for bucketed list lengths,
captured or not, so a graph replay and an eager step launch the same kernels with the same plans
and give the same tokens. Padding rows write nothing: their new K/V rows go to ``-1`` (skipped),
their demotions move the dummy 16-bit row 0 to the dummy INT2 row 0, and their lists are empty.

A graph is captured the first time its key is seen, or every graph at start-up
(:meth:`DecodeGraphs.capture_all`): one eager run on the static buffers (all lists empty, no
writes outside the dummy pages) compiles and warms every kernel, then the capture.
The static inputs are views of two flat device buffers (int64, int32) laid out like the host
step (:class:`~oscarkv.engine.decode_buffers.DecodeLayout`: per-row fields, then lists sized for
the bucket, which the graph fills from the device page tables), so a replay is one copy per dtype
from the pinned staging buffers (plus the page-table changes, when any), then the replay; the
final hidden states are a view of the graph's output (the LM head runs eagerly).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..store import DecodeTensors
from .decode_buffers import DecodeLayout, HostDecode

__all__ = ["DecodeGraphs", "batch_bucket", "len_bucket", "len_buckets"]

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


def len_buckets(n: int) -> list[int]:
    """Every :func:`len_bucket` value of lists of 0 to ``n`` tokens, ascending."""
    out = [0]
    while out[-1] < len_bucket(n):
        out.append(max(MIN_LEN_BUCKET, 2 * out[-1]))
    return out


def len_bucket(n: int) -> int:
    """The planned length of lists of at most ``n`` tokens: 0 for none (the kernel's plan for
    16-bit lists only differs), else ``MIN_LEN_BUCKET`` and then powers of two."""
    return 0 if n <= 0 else max(MIN_LEN_BUCKET, 1 << (n - 1).bit_length())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    layout: DecodeLayout
    d64: torch.Tensor  # long [layout.n64]: ids, positions, decode_dst, demote lists
    d32: torch.Tensor  # int32 [layout.n32]: indptrs, then lists sized B × bucket
    out: torch.Tensor  # final hidden states [B, hidden]


Forward = Callable[[DecodeTensors], torch.Tensor]  # tensors -> hidden [B, hidden]


class DecodeGraphs:
    """Lazily captured decode graphs over ``forward(tensors) -> hidden [B, hidden]``; a step
    copies its host buffers into :meth:`graph_for`'s static inputs and replays it."""

    def __init__(self, forward: Forward, device: torch.device, demote_block: int, window: int):
        """``window``: the most 16-bit rows an INT2 sequence keeps (its sink and ring slab); 0
        for 16-bit pools."""
        self.forward, self.device = forward, device
        self.demote_rows, self.window = (demote_block if window else 0), window
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_s = 0.0  # wall time spent capturing (kernel compiles included)

    def capture(self, b: int, lens: tuple[int, int]) -> _Graph:
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        g = self._capture(b, lens)
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0
        return g

    def capture_all(self, max_batch: int, max_len: int) -> int:
        """Capture the graph of every key that steps of at most ``max_batch`` rows over sequences
        of at most ``max_len`` tokens can use; returns how many were new. Raises
        :class:`InputError` before capturing when their static inputs would take more than half
        of the free device memory."""
        before = len(self.graphs)
        if self.window:  # INT2: the 16-bit lists hold the sink and the ring
            q_max, hp_max = max_len, self.window
        else:
            q_max, hp_max = 0, max_len
        batches = sorted({batch_bucket(n, max_batch) for n in range(1, max_batch + 1)})
        # a step always stores one 16-bit row, so its 16-bit bucket is never 0
        keys = [(b, q, h) for b in batches for q in len_buckets(q_max) for h in len_buckets(hp_max)[1:]]
        keys = [k for k in keys if k not in self.graphs]
        need = sum(self._layout(b, (q, h)).nbytes for b, q, h in keys)
        free = torch.cuda.mem_get_info(self.device)[0]
        if need > free // 2:
            raise InputError(
                f"graph_capture startup: the static inputs of {len(keys)} decode graphs (batch up to "
                f"{max_batch}, sequences up to {max_len} tokens) take {need / 2**30:.1f} GiB, more than "
                f"half of the {free / 2**30:.1f} GiB free",
                "lower max_running or max_model_len, or use graph_capture lazy",
            )
        for b, q, h in keys:
            self.capture(b, (q, h))
        return len(self.graphs) - before

    def _layout(self, b: int, lens: tuple[int, int]) -> DecodeLayout:
        return DecodeLayout.bucketed(b, b * self.demote_rows, lens)

    def _capture(self, b: int, lens: tuple[int, int]) -> _Graph:
        layout = self._layout(b, lens)
        d64 = torch.zeros(layout.n64, dtype=torch.long, device=self.device)
        d64[layout.s64("decode_dst")] = -1
        d32 = torch.zeros(layout.n32, dtype=torch.int32, device=self.device)
        t = layout.views(d64, d32, lens=lens)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            self.forward(t)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(t)
        g = _Graph(graph, layout, d64, d32, out)
        self.graphs[(b, *lens)] = g
        return g

    def graph_for(self, h: HostDecode) -> _Graph:
        """The graph of step ``h``'s padded batch and (bucketed) ``lens_hint``, captured first if
        new. Its ``out`` is a view valid until the next replay."""
        b = h.layout.b
        g = self.graphs.get((b, *h.lens_hint)) or self.capture(b, h.lens_hint)
        if h.layout != g.layout:
            raise RuntimeError(f"decode step laid out as {h.layout}, its graph as {g.layout}")
        return g
