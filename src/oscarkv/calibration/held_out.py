"""The held-out NLL of the fake-quantized model, evaluated for many rotation sets on the same text
(the offsets' choice, the key widths' ranking and the quality target's search).

Protocol: each held-out sequence's prefix attends exactly (as a prefill does); its last
``n_score`` targets are predicted by positions whose attention reads every layer's cache as
stored (:func:`~oscarkv.calibration.windowed.windowed_fake_quant_attention`: ``rotations``' clips,
else the spec's, their offsets and key widths; layers without a rotation exact).

One exact pass at construction keeps what every later pass shares:
- the prefix's KV cache, so a pass runs only the scored suffix (models whose cache layers are all
  plain :class:`~transformers.cache_utils.DynamicLayer`; hybrid and sliding-window caches cannot
  be cropped back, and run the whole sequence each pass, with the same result);
- each decoder layer's exact output, so a pass starts at the first layer that quantizes: the
  layers below it compute what the exact pass did (ranking one layer at a time then costs half
  as many layers on average).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from ..config import QuantSpec
from ..rotation import LayerRotation
from .loss_search import LossClipSearch, _patched

__all__ = ["HeldOut", "held_out_nll"]


class HeldOut:
    """Held-out NLL for rotation sets: ``HeldOut(model, batches, spec, head_dim).nll(rotations)``.

    ``batches``: token ids ``[B, T]`` (``T >= 2``); ``n_score``: targets scored per sequence;
    ``tick``: called after every forward (a progress display).
    """

    @torch.inference_mode()
    def __init__(
        self,
        model: Any,
        batches: Sequence[torch.Tensor],
        spec: QuantSpec,
        head_dim: int,
        n_score: int = 1024,
        tick: Callable[[], None] | None = None,
    ):
        self.model, self.spec, self.head_dim = model, spec, head_dim
        self.tick = tick or (lambda: None)
        self.decoder = _decoder_layers(model)
        device = next(model.parameters()).device
        # per batch: (kept prefix cache or None, the ids a pass runs, targets, exact layer outputs)
        self._runs: list[tuple[Any, torch.Tensor, torch.Tensor, list[Any]]] = []
        total, count = 0.0, 0
        for b in batches:
            ids = b.to(device)
            n = min(n_score, ids.shape[1] - 1)
            cache, run = None, ids
            if ids.shape[1] > n + 1:
                out = model(input_ids=ids[:, : -n - 1], use_cache=True)
                if all(
                    type(layer) is DynamicLayer for layer in getattr(out.past_key_values, "layers", [None])
                ):
                    cache, run = out.past_key_values, ids[:, -n - 1 :]
            outputs: list[Any] = []
            with self._recording(outputs):
                logits = self._forward(cache, run)
            self._runs.append((cache, run, ids[:, -n:], outputs))
            self.tick()
            total += _nll_sum(logits, ids[:, -n:])
            count += ids[:, -n:].numel()
        self.count = count
        self.base = total / max(count, 1)  # the unquantized model's NLL

    @torch.inference_mode()
    def nll(self, rotations: dict[int, LayerRotation]) -> float:
        """Mean next-token NLL of the scored targets with ``rotations``' layers fake-quantized."""
        if not rotations:
            return self.base
        ls = LossClipSearch(self.model, rotations, self.spec, self.head_dim, (), (), "nll")
        ls.clips = {
            i: (self.spec.k_clip if lr.k_clip is None else lr.k_clip,
                self.spec.v_clip if lr.v_clip is None else lr.v_clip)
            for i, lr in rotations.items()
        }  # fmt: skip
        first = min(rotations)
        total = 0.0
        for cache, run, targets, outputs in self._runs:
            ls.score_last = None if cache is not None else targets.shape[1] + 1
            with _patched(self.model, ls), self._replaying(outputs, first):
                logits = self._forward(cache, run)
            total += _nll_sum(logits, targets)
            self.tick()
        return total / max(self.count, 1)

    def _forward(self, cache: Any, run: torch.Tensor) -> torch.Tensor:
        """Logits of the positions that predict the scored targets; the cache cropped back after."""
        n = run.shape[1] if cache is not None else None
        if cache is None:
            return self.model(input_ids=run, use_cache=False).logits
        before = [layer.get_seq_length() for layer in cache.layers]
        try:
            return self.model(input_ids=run, past_key_values=cache, use_cache=True).logits[:, -n:]
        finally:
            for layer, length in zip(cache.layers, before, strict=True):
                extra = layer.get_seq_length() - length
                if extra:
                    layer.crop(-extra)  # negative: tokens to drop (every supported transformers)

    @contextlib.contextmanager
    def _recording(self, outputs: list[Any]) -> Iterator[None]:
        hooks = [m.register_forward_hook(lambda _m, _a, out: outputs.append(out)) for m in self.decoder]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    @contextlib.contextmanager
    def _replaying(self, outputs: list[Any], first: int) -> Iterator[None]:
        """Decoder layers below ``first`` return their exact outputs instead of computing them."""
        skipped = self.decoder[:first] if len(outputs) == len(self.decoder) else []
        for m, out in zip(skipped, outputs, strict=False):
            m.forward = lambda *_a, _out=out, **_k: _out
        try:
            yield
        finally:
            for m in skipped:
                del m.forward


def _decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers in order (``model.get_decoder().layers``); ``[]`` where not found."""
    try:
        layers = model.get_decoder().layers
    except AttributeError:
        return []
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed NLL of ``targets [B, n]`` under the last ``n + 1 .. 1`` positions of ``logits``."""
    n = targets.shape[1]
    lp = logits[:, -n - 1 : -1].float().log_softmax(-1)
    return -float(lp.gather(-1, targets[..., None]).sum())


def held_out_nll(
    model: Any,
    rotations: dict[int, LayerRotation],
    spec: QuantSpec,
    head_dim: int,
    batches: Sequence[torch.Tensor],
    n_score: int = 1024,
) -> float:
    """One evaluation of :class:`HeldOut` (its exact pass included)."""
    return HeldOut(model, batches, spec, head_dim, n_score).nll(rotations)
