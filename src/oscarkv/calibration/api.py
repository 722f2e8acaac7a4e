"""`calibrate(model, tokenizer, ...) -> RotationSet`: one streaming pass, a fit, a clip search."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import CLIP_GRID_K, CLIP_GRID_V, CalibrationConfig, QuantSpec
from ..config.calibration import GRANULARITY_MARGIN
from ..rotation import LayerRotation, Provenance, RotationSet, config_fingerprint, rotated_offset
from ..version import __version__
from .capture import UnsupportedModelError, attention_geometry, capture_attention, check_supported
from .data import token_sequences
from .error import ClipSearch
from .fit import fit_layer, fixed_layer
from .granularity import choose_granularity, fixed_choice
from .held_out import HeldOut
from .key_bits import high_layer_count, select_key_bits, select_key_bits_for_target
from .loss_search import LossClipSearch
from .offset_select import OffsetSelect
from .select import RotationSelect
from .stats import LayerStats

__all__ = ["calibrate"]


def _progress(enabled: bool, total: int, label: str):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cols = [
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tokens"),
        TextColumn("{task.fields[rate]} tok/s"),
        TimeElapsedColumn(),
    ]
    prog = Progress(*cols, disable=not enabled)
    return prog, prog.add_task(label, total=total, rate="-")


def _run(
    model: Any,
    batches: list[torch.Tensor],
    cb: Callable[..., None],
    want_layers: list[int],
    label: str,
    progress: bool,
) -> None:
    import time

    total = sum(b.numel() for b in batches)
    prog, task = _progress(progress, total, label)
    device = next(model.parameters()).device
    start, done = time.perf_counter(), 0
    with prog, capture_attention(model, cb) as seen, torch.inference_mode():
        for b in batches:
            model(input_ids=b.to(device), use_cache=False)
            missing = sorted(set(want_layers) - seen)
            if missing:
                raise UnsupportedModelError(
                    f"{type(model).__name__}: attention layers {missing} did not go through "
                    "transformers' AttentionInterface; oscarkv cannot calibrate this model"
                )
            done += b.numel()
            rate = done / max(time.perf_counter() - start, 1e-9)
            prog.update(task, completed=done, rate=f"{rate:,.0f}")


def _qkv(update: Callable[..., None]) -> Callable[..., None]:
    """A capture callback that passes a layer's ``(q, k, v)`` on (the held-out passes ignore ``o``)."""
    return lambda i, q, k, v, o: update(i, q, k, v)


def _batches(seqs: Sequence[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for s in seqs:  # sequences of equal length share a batch; a shorter tail goes alone
        if out and out[-1].shape[1] == s.numel() and out[-1].shape[0] < batch_size:
            out[-1] = torch.cat([out[-1], s[None]])
        else:
            out.append(s[None])
    return out


class _HeldProgress:
    """One live line for the held-out passes (the granularity, offset and key-width choices: most of
    a calibration's time on a CPU), started at the first forward: a pulsing bar, the forwards run
    and the time elapsed, refreshed while a forward runs."""

    def __init__(self, enabled: bool):
        self.enabled, self.prog, self.task = enabled, None, None

    def tick(self) -> None:
        if not self.enabled:
            return
        if self.prog is None:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            cols = [TextColumn("held-out passes"), BarColumn(), TextColumn("{task.completed} forwards"),
                    TimeElapsedColumn()]  # fmt: skip
            self.prog = Progress(*cols)
            self.task = self.prog.add_task("held-out", total=None)
            self.prog.start()
        self.prog.advance(self.task)

    def close(self) -> None:
        if self.prog is not None:
            self.prog.stop()


def calibrate(
    model: Any,
    tokenizer: Any,
    config: CalibrationConfig | None = None,
    spec: QuantSpec | None = None,
    data: Sequence[str | Path] | None = None,
    progress: bool = False,
) -> RotationSet:
    """Fit K/V rotations (and per-layer clip ratios) for a transformers causal LM.

    Args:
        model: a loaded ``transformers`` model whose attention uses the AttentionInterface.
        tokenizer: its tokenizer.
        config: the recipe (tokens, sequence length, granularity, method, value target, ...).
        spec: the storage format the rotations are tuned for (clip grid, windows, bits).
        data: text files / folders / JSONL; ``None`` uses the Python standard library sources.
        progress: show progress bars: tokens/s of each pass over the text, then the held-out
            passes of the choices (granularity, offsets, key widths) as they run.
    Returns:
        A validated :class:`~oscarkv.rotation.RotationSet`.
    """
    held_progress = _HeldProgress(progress)
    try:
        return _calibrate(model, tokenizer, config, spec, data, progress, held_progress.tick)
    finally:
        held_progress.close()


def _with_offsets(
    rots: dict[int, LayerRotation], means: dict[int, tuple[torch.Tensor, torch.Tensor]], v: bool
) -> dict[int, LayerRotation]:
    """``rots`` with every layer's calibrated means as offsets, each in its rotation's basis (V's
    only where ``v``); new objects, ``rots`` untouched."""
    return {
        i: dataclasses.replace(
            lr,
            k_offset=rotated_offset(means[i][0], lr.k),
            v_offset=rotated_offset(means[i][1], lr.v) if v else None,
        )
        for i, lr in rots.items()
    }


def _calibrate(
    model: Any,
    tokenizer: Any,
    config: CalibrationConfig | None,
    spec: QuantSpec | None,
    data: Sequence[str | Path] | None,
    progress: bool,
    tick: Callable[[], None],
) -> RotationSet:
    cfg, spec = config or CalibrationConfig(), spec or QuantSpec()
    check_supported(model)
    geo = attention_geometry(model)
    layers, d, hkv = geo["layer_ids"], geo["head_dim"], geo["num_kv_heads"]
    spec.group_for(d)
    if cfg.bits_per_element is not None:  # an impossible budget fails before any forward pass
        high_layer_count(spec, d, len(layers), cfg.bits_per_element, cfg.budget_context, cfg.high_key_bits)
    if cfg.max_ppl_increase is not None:  # and so does a ceiling below the spec's own widths
        high_layer_count(
            spec, d, len(layers), cfg.max_bits_per_element, cfg.budget_context, cfg.high_key_bits
        )
    model.eval()
    needs = LayerStats.needs_for(cfg.method, cfg.v_target)
    gather = needs | ({"mean"} if cfg.offsets != "none" else set())
    n_cal = cfg.num_sequences if gather else 0
    n_all = n_cal + cfg.num_holdout_sequences
    ids = (
        token_sequences(tokenizer, data, n_all, cfg.seq_len, cfg.seed)
        if n_all
        else torch.zeros(0, cfg.seq_len, dtype=torch.long)
    )
    cal = list(ids[:n_cal].reshape(-1)[: cfg.tokens].split(cfg.seq_len)) if n_cal else []
    hold = list(ids[n_cal:])

    # "auto": both granularities from the same statistics, compared on the held-out NLL below
    compare = cfg.compares_granularity and hkv > 1
    gran = "layer" if cfg.granularity == "auto" else cfg.granularity
    gran_choice: dict[str, Any] = {}
    if cfg.granularity == "auto" and not compare:
        gran_choice = fixed_choice("one KV head" if hkv == 1 else f"{cfg.method} is not fitted per KV head")
    rots: dict[int, LayerRotation] = {}
    per_head: dict[int, LayerRotation] = {}
    means: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if gather:
        stats = {i: LayerStats(geo["num_heads"], hkv, d, gather, skip=spec.sink_tokens) for i in layers}
        _run(
            model,
            _batches(cal, cfg.batch_size),
            lambda i, q, k, v, o: stats[i].update(q, k, v, o),
            layers,
            "statistics",
            progress,
        )
        for i in layers:
            if needs:
                targets = stats[i].targets(cfg.method, cfg.v_target)
                rots[i] = fit_layer(*targets, gran)
                if compare:
                    per_head[i] = fit_layer(*targets, "kv_head")
            else:
                rots[i] = fixed_layer(cfg.method, d, hkv, gran)
            if "mean" in gather:
                means[i] = stats[i].means()
            stats[i] = None  # type: ignore[assignment]  # free the K/V buffers early
    else:
        rots = {i: fixed_layer(cfg.method, d, hkv, gran) for i in layers}

    held: HeldOut | None = None  # the held-out NLL's exact pass, made once where first needed
    known: float | None = None  # the held-out NLL of `rots` as they stand, where a step measured it
    offsets_on = False  # whether `rots` carry every offset, in their own basis
    if compare:  # first: every later step tunes the kept rotations
        held = HeldOut(model, _batches(hold, cfg.batch_size), spec, d, tick=tick)
        if means:  # compared as the artifact stores them: each set with its offsets, in its basis
            rots, per_head = (_with_offsets(r, means, cfg.offsets != "k") for r in (rots, per_head))
            offsets_on = True
        rots, gran, gran_choice = choose_granularity(held, rots, per_head, GRANULARITY_MARGIN)
        per_head, known = {}, gran_choice[f"nll_{gran}"]
    selection: dict[str, dict[str, Any]] = {}
    if cfg.rotation_select:  # before the clip search, which then tunes the chosen rotations
        sel = RotationSelect(rots, spec, d, gran)
        _run(model, _batches(hold, cfg.batch_size), _qkv(sel.update), layers, "rotation selection", progress)
        rots, selection, known = *sel.apply(), None  # new matrices, no offsets
        offsets_on = False

    # the offsets in the basis of the final rotations, where the granularity's comparison has not
    # attached them (the clip searches below score rows without them). `known`, if any, is then the
    # NLL with every offset on; the NLL without them is measured where a step needs it
    if means and not offsets_on:
        rots, known = _with_offsets(rots, means, cfg.offsets != "k"), None
    offset_choice: dict[str, dict[str, Any]] = {}
    if cfg.offsets == "auto":
        osel = OffsetSelect(rots, spec, d)
        _run(model, _batches(hold, cfg.batch_size), _qkv(osel.update), layers, "offset selection", progress)
        picked, heads = osel.apply()
        # the per-head choice stands only if it also lowers the held-out NLL of the whole model
        bare = {i: dataclasses.replace(lr, k_offset=None, v_offset=None) for i, lr in rots.items()}
        held = held or HeldOut(model, _batches(hold, cfg.batch_size), spec, d, tick=tick)
        every = all(all(h["k"]) and all(h["v"]) for h in heads.values())  # picked is `rots` as they stand
        nll = {"with": known if every and known is not None else held.nll(picked), "without": held.nll(bare)}
        rots = picked if nll["with"] < nll["without"] else bare
        known = min(nll.values())
        offset_choice = {"heads": heads, "nll_with": nll["with"], "nll_without": nll["without"],
                         "kept": nll["with"] < nll["without"]}  # fmt: skip

    search: dict[int, dict[str, float]] = {}
    loss_report: dict[str, Any] = {}
    if cfg.clip_search and cfg.clip_objective != "attn":
        ls = LossClipSearch(model, rots, spec, d, CLIP_GRID_K, CLIP_GRID_V, cfg.clip_objective)
        for b in _batches(hold, cfg.batch_size):
            ls.add(b)
        clips, loss_report = ls.search(cfg.clip_per_layer)
        search = {i: {"k_clip": kc, "v_clip": vc} for i, (kc, vc) in clips.items()}
        for i, (kc, vc) in clips.items():
            rots[i].k_clip, rots[i].v_clip = kc, vc
        known = None
    elif cfg.clip_search:
        cs = ClipSearch(rots, spec, d, CLIP_GRID_K, CLIP_GRID_V)
        _run(model, _batches(hold, cfg.batch_size), _qkv(cs.update), layers, "clip search", progress)
        search = cs.result()
        for i, r in search.items():
            rots[i].k_clip, rots[i].v_clip = r["k_clip"], r["v_clip"]
        known = None

    key_bits: dict[str, Any] = {}
    if cfg.bits_per_element is not None:  # last: it ranks the layers as they will be stored
        held = held or HeldOut(model, _batches(hold, cfg.batch_size), spec, d, tick=tick)
        rots, key_bits = select_key_bits(
            held, rots, cfg.bits_per_element, cfg.budget_context, cfg.high_key_bits, known
        )
    elif cfg.max_ppl_increase is not None:
        held = held or HeldOut(model, _batches(hold, cfg.batch_size), spec, d, tick=tick)
        rots, key_bits = select_key_bits_for_target(
            held, rots, cfg.max_ppl_increase, cfg.max_bits_per_element, cfg.budget_context,
            cfg.high_key_bits, known,
        )  # fmt: skip

    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    recipe = {
        "method": cfg.method,
        "v_target": cfg.v_target,
        "granularity": gran,
        **({"granularity_choice": gran_choice} if gran_choice else {}),
        "tokens": sum(s.numel() for s in cal),
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "data": [str(p) for p in data] if data else "python-stdlib",
        "clip_search": {str(k): v for k, v in search.items()} if search else "off",
        "rotation_select": selection or "off",
        "offsets": {"mode": "auto", "choice": offset_choice} if offset_choice else cfg.offsets,
        **({"clip_loss": loss_report} if loss_report else {}),
        **({"key_bits": key_bits} if key_bits else {}),
        "holdout_tokens": sum(s.numel() for s in hold),
    }
    prov = Provenance(
        source="oscarkv",
        model_name=str(name),
        config_hash=config_fingerprint(model.config),
        recipe=recipe,
        library_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    rs = RotationSet(rots, spec, gran, prov)
    return rs.validate(model.config, source=f"calibration of {name}")
