"""Mixed key precision under a bit budget (``CalibrationConfig.bits_per_element``) or a quality
target (``CalibrationConfig.max_ppl_increase``), ours.

OSCAR stores every key in 2 bits. On models whose keys quantize badly (SmolLM2: nearly all of the
2-bit loss is in the keys) a few layers carry most of it. The recipe: rank the layers by the
held-out NLL of the model with only that layer's K and V fake-quantized (others exact), raise the
keys of the worst ones to ``high_bits`` — as many as the budget allows at ``context`` tokens,
windows and metadata counted — and keep those layers' keys unclipped where that lowers the
held-out NLL of the whole fake-quantized model (at 3-4 bits clipping removes more signal than it
buys resolution). With a quality target the count is not given: it is the smallest (in that
ranking, by bisection) whose whole fake-quantized model is within the target of the unquantized
model's held-out perplexity, at most what the ceiling's budget allows.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

from ..config import QuantSpec, SpecError
from ..rotation import LayerRotation
from .held_out import HeldOut

__all__ = ["high_layer_count", "select_key_bits", "select_key_bits_for_target"]


def high_layer_count(
    spec: QuantSpec, head_dim: int, layers: int, budget: float, context: int, high: int
) -> int:
    """How many of ``layers`` can store keys in ``high`` bits within ``budget`` bits per element at
    ``context`` tokens. Raises :class:`SpecError` when even the spec's widths exceed the budget."""
    lo = spec.bits_per_element(context, head_dim)
    hi = dataclasses.replace(spec, key_bits=high).bits_per_element(context, head_dim)
    if budget < lo - 1e-9:
        raise SpecError(
            f"bits_per_element {budget} is below the {lo:.3f} bits per element that {spec.key_bits}-bit keys "
            f"and {spec.value_bits}-bit values take at {context} tokens (windows and metadata counted)",
            "raise --bits-per-element, or lower the bits or the windows of the spec",
        )
    return min(layers, math.floor((budget - lo) / (hi - lo) * layers + 1e-9)) if hi > lo else 0


def select_key_bits(
    held: HeldOut,
    rotations: dict[int, LayerRotation],
    budget: float,
    context: int,
    high: int,
    known_nll: float | None = None,
) -> tuple[dict[int, LayerRotation], dict[str, Any]]:
    """The rotations with ``key_bits = high`` on the chosen layers (and their key clips), and a
    JSON-ready record of the ranking and the held-out NLLs. ``known_nll``: the held-out NLL of
    ``rotations`` where the caller has measured it (one pass fewer)."""
    n = high_layer_count(held.spec, held.head_dim, len(rotations), budget, context, high)
    record: dict[str, Any] = {"budget": budget, "context": context, "high_bits": high, "layers": []}
    if n == 0:
        return rotations, record
    order, alone = _ranking(held, rotations)
    chosen = sorted(order[:n])
    rots, nlls, clip = _raise(held, rotations, chosen, high, known_nll)
    record.update(layers=chosen, nll_alone={str(i): alone[i] for i in order}, nll=nlls, high_key_clip=clip)
    return rots, record


def select_key_bits_for_target(
    held: HeldOut,
    rotations: dict[int, LayerRotation],
    max_ppl_increase: float,
    ceiling: float,
    context: int,
    high: int,
    known_nll: float | None = None,
) -> tuple[dict[int, LayerRotation], dict[str, Any]]:
    """The fewest layers (in the held-out ranking) whose keys in ``high`` bits bring the whole
    fake-quantized model's held-out perplexity within ``1 + max_ppl_increase`` of the unquantized
    model's, at most as many as ``ceiling`` bits per element at ``context`` allow; the rotations
    and a JSON-ready record (perplexity ratios before and after, the layers, each count tried).
    Warns in one line where the ceiling cannot meet the target (the ceiling's layers are kept).
    Whether the raised keys keep their clips is decided once, at the first count tried.
    ``known_nll``: the held-out NLL of ``rotations`` where the caller has measured it."""
    bound = 1.0 + max_ppl_increase
    base, spec_nll = held.base, held.nll(rotations) if known_nll is None else known_nll
    ratio = {0: math.exp(spec_nll - base)}
    record: dict[str, Any] = {"target": bound, "ceiling": ceiling, "context": context, "high_bits": high,
                              "nll_unquantized": base, "layers": [], "ppl_ratio_before": ratio[0]}  # fmt: skip
    n_max = high_layer_count(held.spec, held.head_dim, len(rotations), ceiling, context, high)
    if ratio[0] <= bound or n_max == 0:
        record.update(ppl_ratio=ratio[0], met=ratio[0] <= bound, tried={"0": ratio[0]})
        if ratio[0] > bound:
            _warn_unmet(ratio[0], bound, ceiling, context)
        return rotations, record
    order, alone = _ranking(held, rotations)
    best: tuple[dict[int, LayerRotation], dict[str, float], str] | None = None
    lo, hi = 0, n_max  # ratio(lo) misses the target; find the least n <= hi that meets it
    while hi - lo > 1 or best is None:
        n = hi if best is None else (lo + hi) // 2
        clip = None if best is None else best[2]
        rots, nll, clip = _raise(held, rotations, sorted(order[:n]), high, spec_nll, clip)
        ratio[n] = math.exp(min(v for k, v in nll.items() if k != "spec_bits") - base)
        if ratio[n] <= bound or best is None:
            best, hi = (rots, nll, clip), n
        else:
            lo = n
        if best is not None and hi == n_max and ratio[n_max] > bound:
            break  # the ceiling misses it: keep the ceiling's layers
    rots, nll, clip = best
    n = hi
    record.update(layers=sorted(order[:n]), nll_alone={str(i): alone[i] for i in order}, nll=nll,
                  high_key_clip=clip, ppl_ratio=ratio[n], met=ratio[n] <= bound,
                  tried={str(k): v for k, v in sorted(ratio.items())})  # fmt: skip
    if ratio[n] > bound:
        _warn_unmet(ratio[n], bound, ceiling, context)
    return rots, record


def _warn_unmet(ratio: float, bound: float, ceiling: float, context: int) -> None:
    warnings.warn(
        f"calibration: held-out perplexity {ratio:.4f}x the unquantized model's misses the target "
        f"{bound:.4f}x under the ceiling of {ceiling} bits per element at {context} tokens; the best "
        "artifact under the ceiling is written (raise --max-bits-per-element to spend more)",
        stacklevel=3,
    )


def _ranking(held: HeldOut, rotations: dict[int, LayerRotation]) -> tuple[list[int], dict[int, float]]:
    """Layers by the held-out NLL with only that layer fake-quantized, worst first."""
    alone = {i: held.nll({i: lr}) for i, lr in sorted(rotations.items())}
    return sorted(alone, key=lambda i: -alone[i]), alone


def _raise(
    held: HeldOut,
    rotations: dict[int, LayerRotation],
    chosen: list[int],
    high: int,
    spec_nll: float | None = None,
    clip: str | None = None,
):
    """``rotations`` with ``high``-bit keys on ``chosen``, their key clips kept or off (``clip``
    "kept" | "off"; ``None``: whichever gives the lower held-out NLL of the whole fake-quantized
    model), the NLLs and the choice. ``spec_nll``: the NLL at the spec's widths, where the caller
    has it (one pass fewer)."""

    def with_high(k_clip: float | None) -> dict[int, LayerRotation]:
        out = dict(rotations)
        for i in chosen:
            kc = rotations[i].k_clip if k_clip is None else k_clip
            out[i] = dataclasses.replace(rotations[i], key_bits=high, k_clip=kc)
        return out

    variants = {"clipped": with_high(None), "unclipped": with_high(0.0)}
    if clip is not None:
        variants = {k: v for k, v in variants.items() if (k == "unclipped") == (clip == "off")}
    nll = {"spec_bits": held.nll(rotations) if spec_nll is None else spec_nll}
    nll.update({k: held.nll(r) for k, r in variants.items()})
    best = min(variants, key=lambda k: (nll[k], k != "clipped"))  # a tie keeps the clips
    return variants[best], nll, "off" if best == "unclipped" else "kept"
