"""A decode step's index data as two flat buffers, one per dtype (engine.md §5.5, §5.8).

The planner fills host buffers with numpy (:func:`~oscarkv.engine.planner.plan_decode_host`);
the device gets one copy of each, and the step's :class:`~oscarkv.store.DecodeTensors` are views
of the device buffers (:class:`DecodeLayout` says where each field lives). A CUDA graph's static
inputs are views of its own device buffers in the same layout, so a replay costs two
host-to-device copies.

On CUDA the host buffers are pinned and reused (:class:`DecodeStaging`); on the CPU they are
fresh tensors and the step's tensors are views of them, with no copy at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..store import Csr, DecodeTensors

__all__ = ["Alloc", "DecodeLayout", "DecodeStaging", "HostDecode", "fresh_buffers"]


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


_F64 = ("ids", "positions", "decode_dst", "demote_src", "demote_dst")
_F32 = ("q_indptr", "hp_indptr", "slots", "n_sink", "head", "hp_ids", "q_ids")
_META32 = 5  # the int32 fields the host writes; the lists after them are filled on the device


@dataclass(frozen=True)
class DecodeLayout:
    """Where a decode step's fields live in its two flat buffers, each region starting on 256
    bytes (the kernels' loads stay aligned):

    * int64 ``[n64]``: ``ids``, ``positions``, ``decode_dst`` (``b`` each), ``demote_src``,
      ``demote_dst`` (``nd`` each);
    * int32 ``[n32]``: ``q_indptr``, ``hp_indptr`` (``b+1`` each), ``slots``, ``n_sink``, ``head``
      (``b`` each), then ``hp_ids`` (``cap_h``) and ``q_ids`` (``cap_q``), which only the device
      writes: a step copies the prefix up to ``meta32``.
    """

    b: int
    nd: int
    cap_h: int
    cap_q: int

    @classmethod
    def bucketed(cls, b: int, nd: int, lens: tuple[int, int]) -> DecodeLayout:
        """A graph's layout: lists of at most ``lens`` = (INT2, 16-bit) buckets each, ≥ 1 id."""
        return cls(b, nd, max(b * lens[1], 1), max(b * lens[0], 1))

    def s64(self, name: str) -> slice:
        i, a, d = _F64.index(name), _up(self.b, 32), _up(self.nd, 32)
        o = min(i, 3) * a + max(i - 3, 0) * d
        return slice(o, o + (self.b if i < 3 else self.nd))

    def s32(self, name: str) -> slice:
        i = _F32.index(name)
        sizes = (self.b + 1, self.b + 1, self.b, self.b, self.b, self.cap_h, self.cap_q)
        o = sum(_up(n, 64) for n in sizes[:i])
        return slice(o, o + sizes[i])

    @property
    def n64(self) -> int:
        return self.s64("demote_dst").stop

    @property
    def n32(self) -> int:
        return self.s32("q_ids").stop

    @property
    def meta32(self) -> int:
        """The int32 prefix the host writes (everything before the lists)."""
        return self.s32(_F32[_META32]).start

    @property
    def nbytes(self) -> int:
        """Bytes of the two flat buffers (int64, int32) of a step in this layout."""
        return 8 * self.n64 + 4 * self.n32

    def views(
        self,
        d64: torch.Tensor,
        d32: torch.Tensor,
        q_ptr: tuple[int, ...] | None = None,
        hp_ptr: tuple[int, ...] | None = None,
        lens: tuple[int, int] = (0, 0),
    ) -> DecodeTensors:
        """:class:`DecodeTensors` (``lens_hint = lens``) as views of ``d64``/``d32``, the lists
        sized by a step's host indptrs ``q_ptr``/``hp_ptr``; without them, a graph's static
        tensors (indptrs of empty lists, lists at full capacity)."""
        if q_ptr is None or hp_ptr is None:
            q_ptr = hp_ptr = (0,) * (self.b + 1)
            nq, nh = self.cap_q, self.cap_h
        else:
            nq, nh = q_ptr[-1], hp_ptr[-1]
        qi, hi = self.s32("q_ids").start, self.s32("hp_ids").start
        return DecodeTensors(
            ids=d64[self.s64("ids")],
            positions=d64[self.s64("positions")],
            decode_dst=d64[self.s64("decode_dst")],
            demote_src=d64[self.s64("demote_src")],
            demote_dst=d64[self.s64("demote_dst")],
            slots=d32[self.s32("slots")],
            n_sink=d32[self.s32("n_sink")],
            head=d32[self.s32("head")],
            q=Csr(d32[self.s32("q_indptr")], d32[qi : qi + nq], q_ptr),
            hp=Csr(d32[self.s32("hp_indptr")], d32[hi : hi + nh], hp_ptr),
            lens_hint=lens,
        )


@dataclass(frozen=True)
class HostDecode:
    """A decode step built on the host: ``h64`` int64 and ``h32`` int32 (CPU tensors laid out by
    ``layout``; ``h64`` continues past ``layout.n64`` with the page-table ``changes``, int64
    ``[2, U]``), with the host indptrs and ``lens_hint`` of its lists."""

    layout: DecodeLayout
    h64: torch.Tensor
    h32: torch.Tensor
    q_ptr: tuple[int, ...]
    hp_ptr: tuple[int, ...]
    lens_hint: tuple[int, int]

    @property
    def used32(self) -> int:
        """The int32 prefix the host wrote (everything before the lists)."""
        return self.layout.meta32

    @property
    def changes(self) -> torch.Tensor:
        """The page-table changes of this step, int64 ``[2, U]`` (a view of ``h64``)."""
        return self.h64[self.layout.n64 :].view(2, -1)

    def views(self, d64: torch.Tensor, d32: torch.Tensor) -> DecodeTensors:
        """The step's tensors as views of buffers holding this step (lists not filled yet)."""
        return self.layout.views(d64, d32, self.q_ptr, self.hp_ptr, self.lens_hint)

    def wire(self) -> HostDecode:
        """A copy holding just this step (``h64``/``h32`` may view reused staging buffers)."""
        return dataclasses.replace(self, h64=self.h64.clone(), h32=self.h32[: self.used32].clone())


Alloc = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (n64, n32) -> host int64, int32


def fresh_buffers(n64: int, n32: int) -> tuple[torch.Tensor, torch.Tensor]:
    """New host buffers (nothing reuses them)."""
    return torch.empty(n64, dtype=torch.long), torch.empty(n32, dtype=torch.int32)


class DecodeStaging:
    """Host buffers for the decode steps of one engine, and their copies to ``device``.

    On CUDA: two pinned buffer pairs, used alternately. A non-blocking copy from pinned memory
    reads it later, when the stream gets there, so the host must not refill a pair before the
    copy that last read it has run: each pair records an event after its copies and the next
    :meth:`alloc` of that pair waits on it. With two pairs that copy is one step old (the step
    in between already synchronised on its sampled tokens), so the wait costs nothing today; one
    pair would do the same, but two keep the host free to plan step N+1 while step N's copy is
    still queued if steps ever overlap. Elsewhere: fresh buffers, and the step's own as views.
    ``pinned=False``: plain copies from the caller's host buffers (tensor-parallel workers, whose
    steps arrive from rank 0).
    """

    def __init__(self, device: torch.device, pinned: bool = True):
        self.device = device
        self.pinned = pinned and device.type == "cuda"
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._events: list[torch.cuda.Event] = []
        self._turn = 0

    def alloc(self, n64: int, n32: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers int64 ``[n64]``, int32 ``[n32]`` for the next step (:data:`Alloc`)."""
        if not self.pinned:
            return fresh_buffers(n64, n32)
        if not self._pairs:
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
            self._pairs = [fresh_buffers(0, 0)] * 2
        self._turn ^= 1
        self._events[self._turn].synchronize()  # the last copy out of this pair has run
        b64, b32 = self._pairs[self._turn]
        if b64.numel() < n64 or b32.numel() < n32:  # grow geometrically: pinning is slow
            grow = lambda have, need: max(need, 2 * have, 4096)  # noqa: E731
            b64 = torch.empty(grow(b64.numel(), n64), dtype=torch.long, pin_memory=True)
            b32 = torch.empty(grow(b32.numel(), n32), dtype=torch.int32, pin_memory=True)
            self._pairs[self._turn] = (b64, b32)
        return b64[:n64], b32[:n32]

    def copy(self, h: HostDecode, d64: torch.Tensor, d32: torch.Tensor) -> torch.Tensor:
        """Step ``h`` into device buffers laid out as ``h.layout``: one copy per dtype (the int32
        one up to the lists), then the event that guards ``h``'s host buffers. Returns the
        page-table changes on the device (int64 ``[2, U]``; copied only when there are any)."""
        n, n64 = h.used32, h.layout.n64
        d64.copy_(h.h64[:n64], non_blocking=True)
        d32[:n].copy_(h.h32[:n], non_blocking=True)
        changes = h.changes
        if changes.numel():
            changes = changes.to(self.device, non_blocking=True)
        if self.pinned:
            self._events[self._turn].record()
        return changes

    def tensors(self, h: HostDecode) -> tuple[DecodeTensors, torch.Tensor]:
        """The step's tensors on the device (views of ``h``'s buffers on the CPU) and its
        page-table changes there."""
        if self.device.type == "cpu":
            h32 = h.h32
            if h32.numel() < h.layout.n32:  # a wire copy (tensor parallelism): room for the lists
                h32 = torch.cat([h32, h32.new_zeros(h.layout.n32 - h32.numel())])
            return h.views(h.h64, h32), h.changes
        d64 = torch.empty(h.layout.n64, dtype=torch.long, device=self.device)
        d32 = torch.empty(h.layout.n32, dtype=torch.int32, device=self.device)
        changes = self.copy(h, d64, d32)
        return h.views(d64, d32), changes
