"""``granularity="auto"``: one rotation per layer or one per KV head, whichever the held-out NLL
prefers (ours).

Both sets come from the same statistics (the per-layer target is the heads' average). They are
compared as the later steps receive them and the artifact stores them: the spec's clips and widths,
and, unless offsets are off, each set with the calibrated channel offsets in its own basis (the
caller attaches them; the recorded NLLs include them). Per KV head is
kept only where it beats per layer by more than a margin (``GRANULARITY_MARGIN``): it stores
``H_kv`` times the matrices (artifact bytes, ``R_K`` on the device) for a gain the held-out text
must show clearly.
"""

from __future__ import annotations

from typing import Any

from ..rotation import LayerRotation
from .held_out import HeldOut

__all__ = ["choose_granularity", "fixed_choice"]


def choose_granularity(
    held: HeldOut,
    by_layer: dict[int, LayerRotation],
    by_head: dict[int, LayerRotation],
    margin: float,
) -> tuple[dict[int, LayerRotation], str, dict[str, Any]]:
    """The kept rotations, their granularity and a JSON-ready record (both held-out NLLs, the
    unquantized model's, the margin and the choice)."""
    nll = {"layer": held.nll(by_layer), "kv_head": held.nll(by_head)}
    chosen = "kv_head" if nll["layer"] - nll["kv_head"] > margin else "layer"
    record = {
        "mode": "auto",
        "chosen": chosen,
        "nll_layer": nll["layer"],
        "nll_kv_head": nll["kv_head"],
        "nll_unquantized": held.base,
        "margin": margin,
    }
    return (by_head if chosen == "kv_head" else by_layer), chosen, record


def fixed_choice(reason: str) -> dict[str, Any]:
    """The record of an ``auto`` granularity that took ``layer`` without a comparison."""
    return {"mode": "auto", "chosen": "layer", "reason": reason}
