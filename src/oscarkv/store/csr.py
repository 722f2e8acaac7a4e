"""Row lists from segment tables: paged and ring segments expanded with a few vectorised ops.

A *segment* is ``n`` consecutive list indices of one sequence in one storage kind:

* paged: list index ``x = lo + j`` lives in page ``pages[page_off + x // ps]`` at offset
  ``x % ps``, i.e. row ``page·ps + x % ps`` (INT2 lists, sink pages, BF16 pages);
* ring: row ``base + (start + j) % mod`` (a sequence's ring slab; a wrapping range is stored as
  two segments, so each is consecutive rows).

A planner builds a small segment table (a few entries per sequence) and one flat page-id list.
A decode step expands them on the host with numpy (:meth:`Segments.rows_np`, into the step's
staging buffer: one copy per dtype instead of ~100 small device launches); a prefill expands them
on the device without a sync (:meth:`Segments.expand`: ``repeat_interleave`` with a host-known
``output_size``). Both give the same rows. Each segment also carries ``tok0``: entry ``j`` belongs
to flat token ``tok0 + j`` (the destinations of a step's new tokens).
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Csr", "PageList", "Segments"]


@dataclass(frozen=True)
class Csr:
    """Compact per-sequence lists: ``indptr`` int32 ``[B+1]`` and ``indices`` int32 ``[total]``
    on the device, with the host copy of ``indptr`` (slicing without a sync)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    indptr_host: tuple[int, ...]

    @property
    def max_len(self) -> int:
        p = self.indptr_host
        return max((b - a for a, b in itertools.pairwise(p)), default=0)

    def row(self, b: int) -> torch.Tensor:
        """Sequence ``b``'s ids (an int32 view)."""
        return self.indices[self.indptr_host[b] : self.indptr_host[b + 1]]


class PageList:
    """Every page id a step refers to, flat, behind a leading dummy 0 (so that index 0 is valid)."""

    def __init__(self) -> None:
        self.ids: list[int] = [0]

    def add(self, pages: list[int]) -> int:
        """Append one sequence's page list; returns its offset in the flat list."""
        off = len(self.ids)
        self.ids.extend(pages)
        return off

    def array(self) -> np.ndarray:
        """The ids, int64 ``[P]``."""
        return np.fromiter(self.ids, np.int64, len(self.ids))

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.array()).to(device, non_blocking=True)


class Segments:
    """A host-side segment table; :meth:`expand` turns it into device rows, :meth:`rows_np` and
    :meth:`tok_np` into host rows (the same values)."""

    def __init__(self, page_tokens: int):
        self.ps = page_tokens
        self.flat = array("q")  # per segment: kind, a, lo, mod, n, tok0
        self.counts: list[int] = []  # entries per sequence (closed by :meth:`end_seq`)
        self.total = 0
        self._open = 0

    def _add(self, kind: int, a: int, lo: int, mod: int, n: int, tok0: int) -> None:
        if n > 0:
            self.flat.extend((kind, a, lo, mod, n, tok0))
            self._open += n
            self.total += n

    @classmethod
    def joined(cls, *tabs: Segments) -> Segments:
        """One table holding ``tabs``' segments in order (to expand them in one go)."""
        out = cls(tabs[0].ps)
        for t in tabs:
            out.flat.extend(t.flat)
            out.total += t.total
        return out

    def paged(self, pages: PageList, off: int, n_pages: int, lo: int, n: int, tok0: int = 0) -> None:
        """List indices ``lo .. lo+n-1`` over the ``n_pages`` pages at flat offset ``off``."""
        if n > 0 and (lo + n - 1) // self.ps >= n_pages:
            raise ValueError(
                f"list index {lo + n - 1} needs page {(lo + n - 1) // self.ps} of a sequence holding "
                f"only {n_pages} pages (the scheduler allocated too few)"
            )
        self._add(0, off, lo, 1, n, tok0)

    def ring(self, base: int, start: int, n: int, mod: int, tok0: int = 0) -> None:
        """Rows ``base + (start + j) % mod`` for ``j < n``: up to two segments of consecutive rows
        (before and after the wrap), so that ``lo + n <= mod`` in every ring segment."""
        if n > mod:
            raise ValueError(f"{n} ring entries do not fit a ring of {mod}")
        if n > 0:
            start %= mod
            n1 = min(n, mod - start)
            self._add(1, base, start, mod, n1, tok0)
            self._add(1, base, 0, mod, n - n1, tok0 + n1)

    def end_seq(self) -> None:
        """Close the current sequence's list (for :meth:`csr`)."""
        self.counts.append(self._open)
        self._open = 0

    def table(self) -> np.ndarray:
        """The segment table, int64 ``[6, n_segments]``: kind (0 paged, 1 ring), a, lo, mod, n, tok0."""
        return np.array(self.flat, dtype=np.int64).reshape(-1, 6).T

    def expand(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, tok)``, long ``[total]`` each, on ``pages.device`` (``pages``: :meth:`PageList.tensor`)."""
        dev, total = pages.device, self.total
        if total == 0:
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return empty, empty.clone()
        kind, a, lo, mod, n, tok0 = torch.from_numpy(self.table()).to(dev, non_blocking=True)
        first = n.cumsum(0) - n
        seg = torch.repeat_interleave(torch.arange(len(n), device=dev), n, output_size=total)
        j = torch.arange(total, device=dev) - first[seg]
        x = lo[seg] + j
        is_paged = kind[seg] == 0
        page = pages[torch.where(is_paged, a[seg] + x // self.ps, 0)]
        rows = torch.where(is_paged, page * self.ps + x % self.ps, a[seg] + x % mod[seg])
        return rows, tok0[seg] + j

    def expand_np(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`expand` on the host: ``(rows, tok)``, int64 ``[total]`` each (``pages``:
        :meth:`PageList.array`)."""
        return self.rows_np(pages), self.tok_np()

    def rows_np(self, pages: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """:meth:`expand`'s rows on the host, written into ``out`` (``[total]``, a signed integer
        dtype; rows must fit it) when given, else into a new int64 array."""
        if out is None:
            out = np.empty(self.total, np.int64)
        elif out.shape != (self.total,):
            raise ValueError(f"rows_np: out has shape {out.shape}, the table holds {self.total} rows")
        if self.total:
            row0, cnt = self._runs(pages)
            # run r fills out[o_r : o_r + cnt_r] with row0_r, row0_r + 1, ...: out[i] = row0_r - o_r + i
            first = np.cumsum(cnt) - cnt
            np.add(
                np.repeat((row0 - first).astype(out.dtype), cnt),
                np.arange(self.total, dtype=out.dtype),
                out=out,
            )
        return out

    def tok_np(self) -> np.ndarray:
        """:meth:`expand`'s ``tok`` on the host, int64 ``[total]``."""
        _, _, _, _, n, tok0 = self.table()
        first = np.cumsum(n) - n
        return np.repeat(tok0 - first, n) + np.arange(self.total)

    def _runs(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows as runs of consecutive ids, in list order: first row and length, int64 ``[R]``.
        A paged segment is one run per page it touches, a ring segment one run (it does not wrap).
        The work is per run, not per row."""
        kind, a, lo, _, n, _ = self.table()
        ps, ring = self.ps, kind == 1
        p0 = lo // ps
        k = np.where(ring, 1, (lo + n - 1) // ps - p0 + 1)  # runs per segment
        seg = np.repeat(np.arange(len(k)), k)
        g = np.arange(len(seg)) + (p0 - (np.cumsum(k) - k))[seg]  # paged: page number in the list
        gx, lo_r, hi_r, ring_r = g * ps, lo[seg], (lo + n)[seg], ring[seg]
        x0 = np.maximum(lo_r, gx)  # a paged run holds list indices x0 .. x1-1
        x1 = np.minimum(hi_r, gx + ps)
        page = pages[np.where(ring_r, 0, a[seg] + g)]
        row0 = np.where(ring_r, a[seg] + lo_r, page * ps + (x0 - gx))
        return row0, np.where(ring_r, hi_r - lo_r, x1 - x0)

    def indptr(self) -> tuple[int, ...]:
        """The CSR offsets of the closed per-sequence lists, ``[B+1]``."""
        if self._open:
            raise RuntimeError("Segments: the last sequence was not closed with end_seq()")
        return tuple(itertools.accumulate(self.counts, initial=0))

    def csr(self, pages: torch.Tensor) -> Csr:
        """The per-sequence lists (in :meth:`end_seq` order) as compact int32 CSR."""
        ptr = self.indptr()
        rows, _ = self.expand(pages)
        indptr = torch.tensor(ptr, dtype=torch.int32).to(pages.device, non_blocking=True)
        return Csr(indptr, rows.to(torch.int32), ptr)
