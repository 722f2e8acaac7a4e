"""Clip search by the model's own held-out loss (``--clip-search --clip-objective nll|kl``).

Each held-out sequence is prefilled exactly up to its last ``n_score`` tokens (the cache is kept);
the suffix is then run with every attention layer fake-quantized as OSCAR's cache stores it:
for the query at position ``i``, key/value ``j`` is exact if ``j < sink`` or ``i - j < recent``,
otherwise clipped, INT2-quantized and dequantized in the rotated basis. The objective is the
mean next-token NLL of the suffix (``nll``) or the mean KL from the exact model's distribution
(``kl``). Global (all-layer) K/V clip ratios are searched one coordinate at a time, optionally
followed by a per-layer pass; evaluations are memoised, ties keep the earlier (spec) choice.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..config import QuantSpec
from ..quant import RowFormat
from ..rotation import LayerRotation
from .capture import route_attention
from .windowed import windowed_fake_quant_attention

__all__ = ["LossClipSearch", "coordinate_search", "windowed_fake_quant_attention"]

LOSS_IMPL = "oscarkv_loss_search"
_HOOK = "_oscarkv_loss_search"
Clips = dict[int, tuple[float, float]]


def _loss_forward(module: Any, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    search = getattr(module, _HOOK, None)
    fmts = search.formats(int(module.layer_idx)) if search is not None else None
    if fmts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scale = kwargs.get("scaling") or 1.0 / math.sqrt(query.shape[-1])
    rot = search.rotations[int(module.layer_idx)]
    sp = search.spec
    t, n = query.shape[2], search.score_last
    if n is not None and t > n:  # an uncached pass: the prefix attends exactly, as when prefilled
        head, _ = sdpa_attention_forward(
            module, query[:, :, : t - n], key[:, :, : t - n], value[:, :, : t - n], None, **kwargs
        )
        tail = windowed_fake_quant_attention(
            query[:, :, t - n :],
            key,
            value,
            rot,
            *fmts,
            sp.sink_tokens,
            sp.recent_tokens,
            scale,
            sp.window_dtype,
        )
        return torch.cat([head, tail], 1), None
    out = windowed_fake_quant_attention(
        query, key, value, rot, *fmts, sp.sink_tokens, sp.recent_tokens, scale, sp.window_dtype
    )
    return out, None


@contextlib.contextmanager
def _patched(model: Any, search: LossClipSearch) -> Iterator[None]:
    """Route ``model``'s attention through :func:`_loss_forward` while the block runs."""
    modules = [m for m in model.modules() if hasattr(m, "layer_idx")]
    for m in modules:
        setattr(m, _HOOK, search)
    try:
        with route_attention(model, LOSS_IMPL, _loss_forward):
            yield
    finally:
        for m in modules:
            delattr(m, _HOOK)


def coordinate_search(
    objective: Callable[[tuple[float, ...]], float],
    start: tuple[float, ...],
    grids: Sequence[Sequence[float]],
    rounds: int = 2,
) -> tuple[tuple[float, ...], float]:
    """Minimise ``objective`` over the grids one coordinate at a time (strict improvements only)."""
    x, best = tuple(start), objective(tuple(start))
    for _ in range(rounds):
        changed = False
        for c, grid in enumerate(grids):
            for val in grid:
                y = (*x[:c], val, *x[c + 1 :])
                f = objective(y)
                if f < best:
                    x, best, changed = y, f, True
        if not changed:
            break
    return x, best


def _neighbours(grid: tuple[float, ...], value: float) -> tuple[float, ...]:
    """``value``'s neighbours in the sorted ``grid`` (the per-layer pass moves one step)."""
    i = grid.index(value)
    return grid[max(i - 1, 0) : i + 2]


class LossClipSearch:
    """Held-out loss of the fake-quantized model as a function of per-layer K/V clip ratios."""

    def __init__(
        self,
        model: Any,
        rotations: dict[int, LayerRotation],
        spec: QuantSpec,
        head_dim: int,
        k_grid: Sequence[float],
        v_grid: Sequence[float],
        objective: str = "nll",
        n_score: int = 1024,
    ):
        if objective not in ("nll", "kl"):
            raise ValueError(f"objective must be nll or kl; got {objective!r}")
        self.model, self.rotations, self.spec, self.objective = model, rotations, spec, objective
        self.n_score = n_score
        self.k_grid = tuple(sorted(set(k_grid) | {spec.k_clip}))
        self.v_grid = tuple(sorted(set(v_grid) | {spec.v_clip}))
        self.kf = RowFormat.from_spec(spec, head_dim, "k")
        self.vf = RowFormat.from_spec(spec, head_dim, "v")
        self.layers = sorted(rotations)
        self.clips: Clips | None = None  # None: exact attention
        self.score_last: int | None = None  # uncached passes: only the last positions fake-quantized
        self._batches: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        self._memo: dict[tuple, float] = {}

    def formats(self, layer: int) -> tuple[RowFormat, RowFormat] | None:
        if self.clips is None or layer not in self.clips:  # exact attention
            return None
        kc, vc = self.clips[layer]
        kb = self.rotations[layer].key_bits
        return replace(self.kf, clip=kc, bits=self.kf.bits if kb is None else kb), replace(self.vf, clip=vc)

    @torch.inference_mode()
    def add(self, ids: torch.Tensor) -> None:
        """Prefill ``ids [B, T]`` exactly up to the scored suffix; keep the cache and exact log-probs."""
        n = min(self.n_score, ids.shape[1] - 1)
        device = next(self.model.parameters()).device
        ids = ids.to(device)
        out = self.model(input_ids=ids[:, :-n], use_cache=True)
        self._batches.append((out.past_key_values, ids[:, -n:], torch.empty(0)))
        ref = self._suffix_logp(len(self._batches) - 1)
        cache, suffix, _ = self._batches[-1]
        self._batches[-1] = (cache, suffix, ref)

    def _suffix_logp(self, b: int) -> torch.Tensor:
        cache, suffix, _ = self._batches[b]
        start = cache.get_seq_length()
        with _patched(self.model, self):
            logits = self.model(input_ids=suffix, past_key_values=cache, use_cache=True).logits
        cache.crop(start - cache.get_seq_length())  # negative: tokens to drop (any transformers)
        return logits[:, :-1].float().log_softmax(-1)

    @torch.inference_mode()
    def loss(self, clips: Clips | None) -> float:
        """Mean held-out objective with ``clips`` per layer (``None``: exact attention)."""
        key = None if clips is None else tuple(clips[i] for i in self.layers)
        if key in self._memo:
            return self._memo[key]
        self.clips, total, count = clips, 0.0, 0
        try:
            for b, (_, suffix, ref) in enumerate(self._batches):
                lp = self._suffix_logp(b)
                if self.objective == "nll":
                    total -= float(lp.gather(-1, suffix[:, 1:, None]).sum())
                else:
                    total += float((ref.exp() * (ref - lp)).sum())
                count += suffix[:, 1:].numel()
        finally:
            self.clips = None
        self._memo[key] = total / max(count, 1)
        return self._memo[key]

    def search(self, per_layer: bool = False) -> tuple[Clips, dict[str, Any]]:
        """Global coordinate search, then (``per_layer``) one pass of one-grid-step moves per layer."""
        spec_pair = (self.spec.k_clip, self.spec.v_clip)
        grids = (self.k_grid, self.v_grid)

        def everywhere(x: tuple[float, ...]) -> float:
            return self.loss({i: (x[0], x[1]) for i in self.layers})

        (kc, vc), best = coordinate_search(everywhere, spec_pair, grids)
        clips: Clips = {i: (kc, vc) for i in self.layers}
        report: dict[str, Any] = {
            "objective": self.objective,
            "scored_tokens": sum(s[:, 1:].numel() for _, s, _ in self._batches),
            "exact": self.loss(None),
            "spec": everywhere(spec_pair),
            "global_choice": [kc, vc],
            "global": best,
        }
        if per_layer:
            for layer in self.layers:

                def one(x: tuple[float, ...], layer: int = layer) -> float:
                    return self.loss({**clips, layer: (x[0], x[1])})

                near = tuple(_neighbours(g, c) for g, c in zip(grids, clips[layer], strict=True))
                pair, best = coordinate_search(one, clips[layer], near, rounds=1)
                clips[layer] = (pair[0], pair[1])
            report["per_layer"] = best
        report["evaluations"] = len(self._memo)
        return clips, report
