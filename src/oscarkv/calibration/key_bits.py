"""Mixed key precision under a bit budget (``CalibrationConfig.bits_per_element``, ours).

OSCAR stores every key in 2 bits. On models whose keys quantize badly (SmolLM2: nearly all of the
2-bit loss is in the keys) a few layers carry most of it. The recipe: rank the layers by the
held-out NLL of the model with only that layer's K and V fake-quantized (others exact), raise the
keys of the worst ones to ``high_bits`` — as many as the budget allows at ``context`` tokens,
windows and metadata counted — and keep those layers' keys unclipped where that lowers the
held-out NLL of the whole fake-quantized model (at 3-4 bits clipping removes more signal than it
buys resolution).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..config import QuantSpec, SpecError
from ..rotation import LayerRotation
from .loss_search import held_out_nll

__all__ = ["high_layer_count", "select_key_bits"]


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
    model: Any,
    rotations: dict[int, LayerRotation],
    spec: QuantSpec,
    head_dim: int,
    batches: Sequence[torch.Tensor],
    budget: float,
    context: int,
    high: int,
) -> tuple[dict[int, LayerRotation], dict[str, Any]]:
    """The rotations with ``key_bits = high`` on the chosen layers (and their key clips), and a
    JSON-ready record of the ranking and the held-out NLLs."""
    n = high_layer_count(spec, head_dim, len(rotations), budget, context, high)
    record: dict[str, Any] = {"budget": budget, "context": context, "high_bits": high, "layers": []}
    if n == 0:
        return rotations, record
    alone = {i: held_out_nll(model, {i: lr}, spec, head_dim, batches) for i, lr in sorted(rotations.items())}
    order = sorted(alone, key=lambda i: -alone[i])
    chosen = sorted(order[:n])

    def with_high(k_clip: float | None) -> dict[int, LayerRotation]:
        out = dict(rotations)
        for i in chosen:
            kc = rotations[i].k_clip if k_clip is None else k_clip
            out[i] = dataclasses.replace(rotations[i], key_bits=high, k_clip=kc)
        return out

    clipped, unclipped = with_high(None), with_high(0.0)
    nll = {
        "spec_bits": held_out_nll(model, rotations, spec, head_dim, batches),
        "clipped": held_out_nll(model, clipped, spec, head_dim, batches),
        "unclipped": held_out_nll(model, unclipped, spec, head_dim, batches),
    }
    keep_unclipped = nll["unclipped"] < nll["clipped"]
    record.update(
        layers=chosen,
        nll_alone={str(i): alone[i] for i in order},
        nll=nll,
        high_key_clip="off" if keep_unclipped else "kept",
    )
    return (unclipped if keep_unclipped else clipped), record
