"""Page ownership for one KV tier: refcounts, an LRU free list and a hash index (engine.md §3.3).

A page's only owners are live sequences: ``ref[p]`` is the number of sequences whose page list
holds ``p``. Every page with ``ref == 0`` sits in ``free`` (LRU first), published ("cached")
pages included, so "available" is simply ``n_free``. :meth:`PagePool.alloc` pops the LRU page
and drops its hash: that is the only eviction. Page ids ``0 .. reserved-1`` are dummy pages
(targets of no-op writes) and are never handed out.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["OutOfPages", "PagePool"]


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation (the scheduler preempts; not a user error)."""


class PagePool:
    """Refcounted pages ``reserved .. n_pages-1`` of one tier, with an LRU free list."""

    def __init__(self, n_pages: int, reserved: int = 1) -> None:
        if not 0 <= reserved <= n_pages:
            raise ValueError(f"PagePool needs 0 <= reserved <= n_pages; got {reserved}, {n_pages}")
        self.total = n_pages
        self.reserved = reserved
        self.ref = [0] * n_pages
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(reserved, n_pages))
        self.hash_of: dict[int, bytes] = {}
        self.index: dict[bytes, int] = {}
        self._n_cached = 0  # free pages that are published

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (``total - reserved``)."""
        return self.total - self.reserved

    @property
    def n_free(self) -> int:
        """Pages with no owner, cached ones included (all of them can be allocated)."""
        return len(self.free)

    @property
    def n_cached(self) -> int:
        """Free pages that still carry a published hash (revivable by a prefix match)."""
        return self._n_cached

    def _check(self, p: int) -> None:
        if not self.reserved <= p < self.total:
            raise AssertionError(
                f"page {p} is not a real page of this pool ({self.reserved}..{self.total - 1})"
            )

    def alloc(self, n: int) -> list[int]:
        """``n`` pages with one ref each, LRU first; raises :class:`OutOfPages` (allocating
        nothing) when fewer than ``n`` are free."""
        if n > len(self.free):
            raise OutOfPages(f"need {n} pages, {len(self.free)} free")
        out = []
        for _ in range(n):
            p, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(p, None)
            if h is not None:  # eviction of a cached page: its content is about to be overwritten
                del self.index[h]
                self._n_cached -= 1
            self.ref[p] = 1
            out.append(p)
        return out

    def incref(self, p: int) -> None:
        """One more owner of ``p``; revives ``p`` if it was free (a cached page)."""
        self._check(p)
        if self.ref[p] == 0:
            del self.free[p]
            if p in self.hash_of:
                self._n_cached -= 1
        self.ref[p] += 1

    def decref(self, p: int) -> None:
        """One owner less; at 0 the page goes to the MRU end of the free list, keeping its hash."""
        self._check(p)
        if self.ref[p] <= 0:
            raise AssertionError(f"decref of page {p}, which has no owner (double free)")
        self.ref[p] -= 1
        if self.ref[p] == 0:
            self.free[p] = None
            if p in self.hash_of:
                self._n_cached += 1

    def lookup(self, h: bytes) -> int | None:
        """The page published under ``h``, if any (free or held)."""
        return self.index.get(h)

    def publish(self, p: int, h: bytes) -> bool:
        """Index held page ``p`` under ``h``. False (``p`` stays private) when ``h`` is already
        indexed by another page: nothing is remapped or freed."""
        self._check(p)
        if self.ref[p] <= 0:
            raise AssertionError(f"publish of page {p}, which has no owner")
        old = self.hash_of.get(p)
        if old is not None:
            if old != h:
                raise AssertionError(f"page {p} is already published under another hash")
            return True
        if h in self.index:
            return False
        self.index[h] = p
        self.hash_of[p] = h
        return True
