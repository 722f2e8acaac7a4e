"""Page tables: each request slot's page ids, kept on the host and the device, updated incrementally.

A decode step's attention reads every stored row of every running request. Listing those rows on
the host costs time in proportion to the stored tokens; here the host keeps, per request slot,
the page ids of its INT2 tier (``q``) and of its 16-bit pages (``hp``: the sink in INT2 mode,
every page in BF16 mode), and sends only what changed since the last step (a new page, a newly
admitted request). The device keeps the same tables; :func:`expand_lists` turns them and a few
per-row counts into the row lists the decode kernels read, on the device, inside the step's CUDA
graph. So the host's work per decode step is proportional to the running requests, not to the
tokens they hold.

Row of INT2 list index ``i`` of slot ``s``: ``q[s, i // ps]·ps + i % ps``. Row of 16-bit list
index ``i``: ``hp[s, i // ps]·ps + i % ps`` for the sink (``i < n_sink``; BF16: every index), else
the ring row ``ring_base(s) + (head + i − n_sink) % ring`` (oldest first).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from .layout import PoolPlan

__all__ = ["PageTables", "PagedSeq", "expand_lists"]


class PagedSeq(Protocol):
    """What the tables read of a sequence (the engine's ``request.Sequence`` is one): its request
    slot, an ``epoch`` that changes on every admission, and its page lists (which only grow while
    it is admitted)."""

    rid: str
    slot: int | None
    epoch: int
    q_pages: list[int]
    hp_pages: list[int]


class PageTables:
    """Both tables of ``plan.max_running`` slots, ``q_width``/``hp_width`` pages wide, as one flat
    int32 array on the host (``host``) and one on ``device`` (``dev``); ``q``/``hp`` are 2-D views.
    """

    def __init__(self, plan: PoolPlan, q_width: int, hp_width: int, device: torch.device):
        s = plan.max_running
        self.q_width, self.hp_width = max(q_width, 1), max(hp_width, 1)
        n = s * (self.q_width + self.hp_width)
        self.host = np.zeros(n, np.int32)
        self.dev = torch.zeros(n, dtype=torch.int32, device=device) if device.type != "cpu" else None
        self._owner: list[int | None] = [None] * s  # the epoch of the sequence each slot mirrors
        self._synced = np.zeros((s, 2), np.int64)  # pages already written, per slot: (q, hp)

    @classmethod
    def for_plan(cls, plan: PoolPlan, max_len: int, device: torch.device) -> PageTables:
        """Tables wide enough for sequences of ``max_len`` tokens."""
        pages = -(-max_len // plan.page_tokens)
        return cls(plan, pages if plan.int2 else 0, plan.sink_pages if plan.int2 else pages, device)

    def _views(self, flat: np.ndarray | torch.Tensor) -> tuple:
        s = len(self._owner)
        nq = s * self.q_width
        return flat[:nq].reshape(s, self.q_width), flat[nq:].reshape(s, self.hp_width)

    def device_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device tables ``(q [S, Wq], hp [S, Wh])`` (on the CPU: views of the host array)."""
        flat = torch.from_numpy(self.host) if self.dev is None else self.dev
        return self._views(flat)

    def update(self, seqs: Iterable[PagedSeq]) -> np.ndarray:
        """Bring the host tables up to date with ``seqs``' page lists; returns the changes as
        int64 ``[2, U]`` (flat index, page id) for :meth:`apply`. A slot whose sequence changed
        (a new admission: ``seq.epoch``) is rewritten from its first page; otherwise only pages
        appended since the last update are written (page lists only grow while admitted)."""
        idx: list[int] = []
        val: list[int] = []
        q_host, hp_host = self._views(self.host)
        hp0 = q_host.size
        for seq in seqs:
            s = seq.slot
            assert s is not None, f"{seq.rid}: no request slot"
            if self._owner[s] != seq.epoch:
                self._owner[s] = seq.epoch
                self._synced[s] = 0
            for k, (pages, tab, base, width) in enumerate(
                ((seq.q_pages, q_host, 0, self.q_width), (seq.hp_pages, hp_host, hp0, self.hp_width))
            ):
                have = int(self._synced[s, k])
                if len(pages) > have:
                    if len(pages) > width:
                        raise ValueError(
                            f"{seq.rid}: {len(pages)} pages exceed the page table's {width} (max_model_len)"
                        )
                    new = pages[have:]
                    tab[s, have : len(pages)] = new
                    start = base + s * width + have
                    idx.extend(range(start, start + len(new)))
                    val.extend(new)
                    self._synced[s, k] = len(pages)
        return np.array([idx, val], dtype=np.int64).reshape(2, -1)

    def apply(self, changes: torch.Tensor) -> None:
        """Write ``changes`` (int64 ``[2, U]``, on the tables' device) into the device tables (on
        the CPU, where those are the host array, into that)."""
        if not changes.shape[1]:
            return
        if self.dev is None:  # idempotent on the process that made them (tensor-parallel ranks share them)
            self.host[changes[0].numpy()] = changes[1].numpy()
        else:
            self.dev.index_copy_(0, changes[0], changes[1].to(torch.int32))


def expand_lists(
    q_tab: torch.Tensor,
    hp_tab: torch.Tensor,
    slots: torch.Tensor,
    q_indptr: torch.Tensor,
    hp_indptr: torch.Tensor,
    n_sink: torch.Tensor,
    head: torch.Tensor,
    q_out: torch.Tensor,
    hp_out: torch.Tensor,
    plan: PoolPlan,
) -> None:
    """Fill a decode step's row lists from the page tables, on their device (graph-capturable: no
    host sync, fixed shapes). ``slots``, ``n_sink``, ``head``: int32 ``[B]`` per batch row (its
    request slot, sink rows and ring head; BF16: ``n_sink`` = the row's list length); indptrs
    int32 ``[B+1]``; ``q_out``/``hp_out``: int32 ``[cap]`` lists, entries past the last indptr
    set to row 0. ``q_tab [S, Wq]``, ``hp_tab [S, Wh]`` int32 (:meth:`PageTables.device_views`)."""
    ps = plan.page_tokens
    if q_out.numel():
        i, b, valid = _positions(q_indptr, q_out.numel())
        page = q_tab[slots[b].long(), (i // ps).clamp_(max=q_tab.shape[1] - 1)]
        q_out.copy_(torch.where(valid, page * ps + i % ps, 0))
    if hp_out.numel():
        i, b, valid = _positions(hp_indptr, hp_out.numel())
        slot, sink = slots[b].long(), n_sink[b]
        page = hp_tab[slot, (i // ps).clamp(max=hp_tab.shape[1] - 1)]
        row = page * ps + i % ps
        if plan.int2:
            ring = plan.ring_base(0) + slot * plan.ring_cap + (head[b] + i - sink) % max(plan.ring, 1)
            row = torch.where(i < sink, row, ring.to(torch.int32))
        hp_out.copy_(torch.where(valid, row, 0))


def _positions(indptr: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For list entries ``0 .. cap-1``: the index inside its row's list, the row, and whether the
    entry is inside the lists at all (int32, long, bool ``[cap]``)."""
    pos = torch.arange(cap, dtype=torch.int32, device=indptr.device)
    b = torch.searchsorted(indptr[1:], pos, right=True).clamp_(max=indptr.numel() - 2)
    return pos - indptr[b], b, pos < indptr[-1]
