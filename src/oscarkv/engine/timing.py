"""Per-step timings of the engine (``EngineConfig.step_timing``): where a step's time goes.

Each step records, on the host, the time it spent working (``host_s``: everything in
:meth:`Engine.step` except blocking waits on the device) and, on CUDA, two events on the
compute stream around its device work. Once those events have completed they give the step's
device time (``gpu_s``: first launch to last) and the device's idle gap before it (``gap_s``:
from the previous step's end to this step's start), which is the host work on the critical
path: with overlapped scheduling the host prepares step N+1 while the device runs step N, and
only what the device waits for shows as a gap.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["StepTimer", "StepTiming"]


@dataclass(frozen=True)
class StepTiming:
    """One engine step. ``gpu_s``/``gap_s`` are None off CUDA (and ``gap_s`` for the first step)."""

    kind: str  # "prefill" | "decode"
    batch: int  # sequences in the step
    tokens: int  # tokens computed (decode: = batch)
    host_s: float  # host work of the step, blocking waits on the device excluded
    wait_s: float  # host time blocked on the device (reading sampled tokens)
    gpu_s: float | None  # device time from the step's first launch to its last
    gap_s: float | None  # device idle time between the previous step's end and this one's start


@dataclass
class _Open:
    kind: str
    batch: int
    tokens: int
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    host_s: float = 0.0
    wait_s: float = 0.0


class StepTimer:
    """Records steps when ``enabled``; :meth:`drain` returns the finished ones, oldest first."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self._pending: deque[_Open] = deque()
        self._done: list[StepTiming] = []
        self._last_end: torch.cuda.Event | None = None
        self._cur: _Open | None = None
        self._t0 = 0.0
        self._wait = 0.0

    def begin(self, kind: str, batch: int, tokens: int) -> None:
        """A step's host work starts (before its first launch)."""
        if not self.enabled:
            return
        ev = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if self.cuda
            else (None, None)
        )
        self._cur = _Open(kind, batch, tokens, *ev)
        self._t0, self._wait = time.perf_counter(), 0.0

    def launching(self) -> None:
        """The step's first device work is about to be queued (its copies or kernels)."""
        if self._cur is not None and self._cur.start is not None:
            self._cur.start.record()

    def launched(self) -> None:
        """The step's last launch is queued."""
        if self._cur is not None and self._cur.end is not None:
            self._cur.end.record()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """A blocking wait on the device (not counted as host work)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self._wait += time.perf_counter() - t

    def end(self) -> None:
        """The step's host work ends."""
        cur, self._cur = self._cur, None
        if cur is None:
            return
        cur.wait_s = self._wait
        cur.host_s = time.perf_counter() - self._t0 - self._wait
        self._pending.append(cur)

    def drain(self) -> list[StepTiming]:
        """The recorded steps whose device work has completed (all of them off CUDA)."""
        while self._pending:
            s = self._pending[0]
            if s.end is not None and not s.end.query():
                break
            self._pending.popleft()
            gpu = gap = None
            if s.start is not None and s.end is not None:
                gpu = s.start.elapsed_time(s.end) / 1e3
                if self._last_end is not None:
                    gap = max(self._last_end.elapsed_time(s.start) / 1e3, 0.0)
                self._last_end = s.end
            self._done.append(StepTiming(s.kind, s.batch, s.tokens, s.host_s, s.wait_s, gpu, gap))
        out, self._done = self._done, []
        return out
