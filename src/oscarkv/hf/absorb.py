"""Folding ``R_V`` into the value projection (spec §5.6), so values leave it already rotated."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..errors import ModelError
from ..rotation import RotationSet, absorb_value_weight

__all__ = ["ABSORBED_ATTR", "absorb_value_rotation", "v_fingerprint"]

#: model attribute holding the :func:`v_fingerprint` of the rotations whose R_V was absorbed
ABSORBED_ATTR = "_oscarkv_v_absorbed"


def v_fingerprint(rotations: RotationSet) -> str:
    """Short hash of the V rotations (layer ids and fp32 matrices) that absorption would fold in."""
    h = hashlib.sha256()
    for i in rotations.layer_ids:
        h.update(str(i).encode())
        h.update(rotations.layers[i].v.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def absorb_value_rotation(model: Any, rotations: RotationSet) -> None:
    """Replace each layer's ``v_proj`` by ``v ↦ v·R_V`` (per KV head), in fp32 math, in place.

    For ``y = x Wᵀ + b`` and a head's rows ``W_h [d, in]``: ``W_h ← R_Vᵀ W_h``, ``b_h ← b_h R_V``.
    Marks the model with the rotations' :func:`v_fingerprint`; a second call raises
    :class:`~oscarkv.errors.ModelError` (values would be rotated twice), as do attention modules
    without a plain ``v_proj`` linear layer.
    """
    done = getattr(model, ABSORBED_ATTR, None)
    if done is not None:
        raise ModelError(
            f"R_V is already absorbed into this model's value projections (rotations {done}); "
            "absorbing again would rotate values twice",
            "load the model again to absorb other rotations",
        )
    d = rotations.head_dim
    for i, module in _attention_modules(model):
        lin = getattr(module, "v_proj", None)
        if not isinstance(lin, torch.nn.Linear):
            raise ModelError(
                f"{type(module).__name__} (layer {i}) has no nn.Linear v_proj to absorb R_V into",
                "build the cache without absorb_v",
            )
        w, b = absorb_value_weight(lin.weight, lin.bias, rotations.layers[i].v, d)
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    setattr(model, ABSORBED_ATTR, v_fingerprint(rotations))


def _attention_modules(model: Any) -> list[tuple[int, Any]]:
    found = [
        (int(m.layer_idx), m) for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "v_proj")
    ]
    if not found:
        raise ModelError(f"{type(model).__name__}: no attention modules with v_proj found")
    return sorted(found, key=lambda x: x[0])
