"""Row lists built on the device: paged and ring segments expanded with a few vectorised ops.

A *segment* is ``n`` consecutive list indices of one sequence in one storage kind:

* paged: list index ``x = lo + j`` lives in page ``pages[page_off + x // ps]`` at offset
  ``x % ps``, i.e. row ``page·ps + x % ps`` (INT2 lists, sink pages, BF16 pages);
* ring: row ``base + (start + j) % mod`` (a sequence's ring slab; wraps).

The host only builds a small segment table (a few entries per sequence) and one flat page-id
list; the rows (possibly batch × context ids) are expanded on the device without a sync
(``repeat_interleave`` with a host-known ``output_size``). Each segment also carries ``tok0``:
entry ``j`` belongs to flat token ``tok0 + j`` (the destinations of a step's new tokens).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.ids, dtype=torch.long).to(device, non_blocking=True)


class Segments:
    """A host-side segment table; :meth:`expand` turns it into device rows."""

    def __init__(self, page_tokens: int):
        self.ps = page_tokens
        self.cols: list[list[int]] = [[] for _ in range(6)]  # kind, a, lo, mod, n, tok0
        self.counts: list[int] = []  # entries per sequence (closed by :meth:`end_seq`)
        self._open = 0

    def _add(self, kind: int, a: int, lo: int, mod: int, n: int, tok0: int) -> None:
        if n > 0:
            for col, v in zip(self.cols, (kind, a, lo, mod, n, tok0), strict=True):
                col.append(v)
            self._open += n

    def paged(self, pages: PageList, off: int, n_pages: int, lo: int, n: int, tok0: int = 0) -> None:
        """List indices ``lo .. lo+n-1`` over the ``n_pages`` pages at flat offset ``off``."""
        if n > 0 and (lo + n - 1) // self.ps >= n_pages:
            raise ValueError(
                f"list index {lo + n - 1} needs page {(lo + n - 1) // self.ps} of a sequence holding "
                f"only {n_pages} pages (the scheduler allocated too few)"
            )
        self._add(0, off, lo, 1, n, tok0)

    def ring(self, base: int, start: int, n: int, mod: int, tok0: int = 0) -> None:
        """Rows ``base + (start + j) % mod`` for ``j < n``."""
        if n > mod:
            raise ValueError(f"{n} ring entries do not fit a ring of {mod}")
        self._add(1, base, start, mod, n, tok0)

    def end_seq(self) -> None:
        """Close the current sequence's list (for :meth:`csr`)."""
        self.counts.append(self._open)
        self._open = 0

    @property
    def total(self) -> int:
        return sum(self.cols[4])

    def expand(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, tok)``, long ``[total]`` each, on ``pages.device`` (``pages``: :meth:`PageList.tensor`)."""
        dev, total = pages.device, self.total
        if total == 0:
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return empty, empty.clone()
        kind, a, lo, mod, n, tok0 = torch.tensor(self.cols, dtype=torch.long).to(dev, non_blocking=True)
        first = n.cumsum(0) - n
        seg = torch.repeat_interleave(torch.arange(len(n), device=dev), n, output_size=total)
        j = torch.arange(total, device=dev) - first[seg]
        x = lo[seg] + j
        is_paged = kind[seg] == 0
        page = pages[torch.where(is_paged, a[seg] + x // self.ps, 0)]
        rows = torch.where(is_paged, page * self.ps + x % self.ps, a[seg] + x % mod[seg])
        return rows, tok0[seg] + j

    def csr(self, pages: torch.Tensor) -> Csr:
        """The per-sequence lists (in :meth:`end_seq` order) as compact int32 CSR."""
        if self._open:
            raise RuntimeError("Segments.csr: the last sequence was not closed with end_seq()")
        ptr = [0]
        for c in self.counts:
            ptr.append(ptr[-1] + c)
        rows, _ = self.expand(pages)
        indptr = torch.tensor(ptr, dtype=torch.int32).to(pages.device, non_blocking=True)
        return Csr(indptr, rows.to(torch.int32), tuple(ptr))
