"""Per-layer quality of rotation sets on held-out text, and the calibration summary rows."""

from __future__ import annotations

from typing import Any

import torch

from ..rotation import RotationSet
from .capture import capture_attention
from .error import WindowedError

__all__ = ["attention_errors", "summary_rows"]


def attention_errors(
    model: Any, sequences: torch.Tensor, rotsets: dict[str, RotationSet], n_queries: int = 256
) -> dict[str, dict[int, float]]:
    """Relative fake-quantized attention-output error per layer for each rotation set.

    Each set is evaluated with its own spec and per-layer clips, OSCAR windows included
    (see :mod:`oscarkv.calibration.error`). ``sequences`` is LongTensor ``[n, T]``.
    """
    err: dict[str, dict[int, float]] = {n: {} for n in rotsets}
    ref: dict[int, float] = {}
    device = next(model.parameters()).device

    def cb(layer: int, q, k, v, o) -> None:
        for name, rs in rotsets.items():
            kf, vf = rs.formats(layer)
            we = WindowedError(
                q, k, v, rs.layers[layer], rs.spec.sink_tokens, rs.spec.recent_tokens, n_queries
            )
            e = we.error(we.quantized_k(kf), we.quantized_v(vf))
            err[name][layer] = err[name].get(layer, 0.0) + e
            if name == next(iter(rotsets)):
                ref[layer] = ref.get(layer, 0.0) + we.ref_sq

    model.eval()
    with capture_attention(model, cb), torch.inference_mode():
        for s in sequences:
            model(input_ids=s[None].to(device), use_cache=False)
    return {n: {i: e / max(ref[i], 1e-30) for i, e in sorted(d.items())} for n, d in err.items()}


def summary_rows(rs: RotationSet) -> list[dict[str, Any]]:
    """One row per layer: eigenvalue spread, clips, orthogonality and clip-search gains."""
    ortho = rs.orthogonality_errors()
    search = rs.provenance.recipe.get("clip_search")
    rows = []
    for i in rs.layer_ids:
        lr = rs.layers[i]
        kc, vc = rs.clips(i)

        def spread(lam: torch.Tensor) -> float:
            lam = lam.double().clamp_min(1e-12)
            return float((lam.amax(-1) / lam.mean(-1)).max())

        row = {
            "layer": i,
            "k_spread": spread(lr.k_eigenvalues),
            "v_spread": spread(lr.v_eigenvalues),
            "k_clip": kc,
            "v_clip": vc,
            "ortho": ortho[i],
        }
        if isinstance(search, dict) and "k_err_global" in search.get(str(i), {}):  # attn objective
            s = search[str(i)]
            row["err_global"] = g = s["k_err_global"]
            row["k_gain"] = 1 - s["k_err_best"] / g if g > 0 else 0.0
            row["v_gain"] = 1 - s["v_err_best"] / g if g > 0 else 0.0
        rows.append(row)
    return rows
