"""The KV budget: the bytes the engine's pools may take (engine.md, "Tiers on pages").

Set by ``kv_budget_gb``; unset, it comes from the memory the machine has: on CUDA a fraction of
the device's free memory (after the profiled prefill peak), on CPU a share of the host's
available memory with a cap. An explicit CPU budget larger than the available memory is refused
before anything is allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..config.engine import CPU_BUDGET_CAP_GB, CPU_BUDGET_FRACTION, CPU_FALLBACK_BUDGET_GB
from ..errors import InputError

__all__ = ["GIB", "KVBudget", "available_memory", "cpu_default_budget", "kv_budget"]

GIB = 1 << 30


@dataclass(frozen=True)
class KVBudget:
    """A rank's budget in bytes, and where it came from (for the start-up line)."""

    bytes: int
    source: str


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of host memory available to a new allocation without swapping: Linux's
    ``MemAvailable``, else the free physical pages (``os.sysconf``), else None."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        n = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return n if n > 0 else None


def cpu_default_budget(available: int | None, ranks: int = 1) -> KVBudget:
    """The CPU budget of one of ``ranks`` ranks when ``kv_budget_gb`` is unset:
    ``CPU_BUDGET_FRACTION`` of ``available`` bytes, at most ``CPU_BUDGET_CAP_GB`` GiB, split over
    the ranks (they share the host's memory); ``CPU_FALLBACK_BUDGET_GB`` per rank where the
    available memory is unknown."""
    if available is None:
        return KVBudget(int(CPU_FALLBACK_BUDGET_GB * GIB), "the available memory could not be read")
    total = min(int(CPU_BUDGET_FRACTION * available), int(CPU_BUDGET_CAP_GB * GIB))
    split = f", split over {ranks} ranks" if ranks > 1 else ""
    return KVBudget(
        total // ranks,
        f"{CPU_BUDGET_FRACTION:.0%} of {available / GIB:.1f} GiB available, at most "
        f"{CPU_BUDGET_CAP_GB:g} GiB{split}",
    )


def kv_budget(cfg: EngineConfig, device: torch.device | str, reserve: int = 0, ranks: int = 1) -> KVBudget:
    """One rank's KV budget: ``kv_budget_gb`` GiB if set (on CPU refused when the ``ranks``
    budgets together exceed the available memory); else on CUDA ``memory_fraction`` × (the
    device's free memory − ``reserve``, the peak a step allocates; call it after the weights are
    loaded), elsewhere :func:`cpu_default_budget`."""
    device = torch.device(device)
    if cfg.kv_budget_gb is not None:
        n = int(cfg.kv_budget_gb * GIB)
        avail = available_memory() if device.type == "cpu" else None
        if avail is not None and n * ranks > avail:
            each = f" on each of {ranks} ranks" if ranks > 1 else ""
            raise InputError(
                f"kv_budget_gb={cfg.kv_budget_gb:g}{each} is more than the {avail / GIB:.1f} GiB of "
                "memory available",
                f"lower --kv-budget-gb, or leave it unset ({CPU_BUDGET_FRACTION:.0%} of the available "
                f"memory, at most {CPU_BUDGET_CAP_GB:g} GiB)",
            )
        return KVBudget(n, "kv_budget_gb")
    if device.type != "cuda":
        return cpu_default_budget(available_memory(), ranks)
    free, _ = torch.cuda.mem_get_info(device)
    return KVBudget(
        int(cfg.memory_fraction * max(free - reserve, 0)),
        f"memory_fraction {cfg.memory_fraction:g} of free device memory",
    )
