"""What the engine holds right now, for readers outside it (the server's ``/metrics``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .pages import PagePool

__all__ = ["EngineLoad", "PoolLoad"]


@dataclass(frozen=True)
class PoolLoad:
    """One page pool: free pages (cached ones included), cached pages (free but still holding a
    prefix-cache hash) and usable pages (the dummy page 0 excluded)."""

    free: int
    cached: int
    capacity: int

    @classmethod
    def of(cls, pool: PagePool) -> PoolLoad:
        return cls(pool.n_free, pool.n_cached, pool.capacity)


@dataclass(frozen=True)
class EngineLoad:
    """Requests running and waiting, and each page pool by tier: ``"hp"`` (16-bit) and ``"int2"``
    (absent in BF16 mode)."""

    running: int
    waiting: int
    pools: Mapping[str, PoolLoad]
