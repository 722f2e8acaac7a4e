"""Next-token sampling for one engine step (§5.8): logit bias, penalties (repetition, frequency,
presence), greedy, temperature, top-k, top-p, per-request seed.

Rows are filtered independently and then drawn with the exponential-race trick: ``argmax(p / E)``
with ``E ~ Exp(1)`` draws from ``p``. Unseeded rows share one batched draw from the device's default
generator; a seeded row draws its noise from its own :class:`torch.Generator`, so its tokens do not
depend on which other requests share the batch (given equal logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .request import SamplingParams

__all__ = ["Seen", "make_generator", "sample", "to_device", "token_logprobs"]

_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32 number
_FMAX = torch.finfo(torch.float32).max


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (any Python int, reduced mod 2**64)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64)
    return g


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a ``[B]`` device tensor, copied without a device sync on CUDA."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a ``[B, 1]`` device tensor (:func:`to_device`)."""
    return to_device(values, dtype, device).unsqueeze(1)


def _check(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence) -> None:
    if logits.dim() != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"sample: logits must be [B, V] with B, V >= 1; got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"sample: logits must be floating point; got {logits.dtype}")
    b = logits.shape[0]
    if len(params) != b or len(generators) != b:
        raise ValueError(f"sample: {b} logit rows but {len(params)} params and {len(generators)} generators")
    for g in generators:
        if g is not None and g.device.type != logits.device.type:
            raise ValueError(f"sample: a generator on {g.device} for logits on {logits.device}")


def _filter(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k then top-p on temperature-scaled logits ``x`` (in place); excluded tokens get -inf."""
    v = x.shape[1]
    ks = [v if p.top_k == -1 else min(p.top_k, v) for p in params]
    if min(ks) < v:
        kth = torch.topk(x, max(ks), dim=-1).values.gather(
            1, _column([k - 1 for k in ks], torch.long, x.device)
        )
        x.masked_fill_(x < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        ps = _column([p.top_p for p in params], torch.float32, x.device)
        sx, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        sp = sx.softmax(-1)
        drop = (sp.cumsum(-1) - sp) > ps  # the mass before a token already covers top_p
        drop &= ps < 1  # rows without top-p stay bit-identical to an unfiltered run
        x.masked_fill_(torch.zeros_like(drop).scatter_(1, idx, drop), float("-inf"))
    return x


def _biased(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` (a copy) plus each row's ``logit_bias``."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            if t >= logits.shape[1]:
                raise ValueError(
                    f"sample: logit_bias token {t} is outside the vocabulary of {logits.shape[1]}"
                )
            rows.append(i)
            cols.append(t)
            vals.append(b)
    out = logits.float().clone()
    dev = logits.device
    out.index_put_((to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)),
                   to_device(vals, torch.float32, dev), accumulate=True)  # fmt: skip
    return out


@dataclass(frozen=True)
class Seen:
    """The tokens each row's penalties count (``sample(..., seen)``), in one of two forms.

    Lists: ``prompt[i]`` and ``output[i]``, row ``i``'s prompt and output token ids as the host
    knows them, and ``pending`` (long ``[B]`` on the logits' device, or None): row ``i``'s one
    output token sampled on the device and not read by the host yet (overlapped scheduling),
    ``-1`` where there is none. Only rows whose params use a penalty are read (give the others
    empty lists). Counts: ``counts`` (fp32 ``[R, V]``, each output token's count) and
    ``in_prompt`` (bool ``[R, V]``) of the ``R`` penalized rows in row order, on the logits'
    device (what ``engine/penalties.py`` keeps per request slot); the lists are then unused."""

    prompt: Sequence[Sequence[int]] = ()
    output: Sequence[Sequence[int]] = ()
    pending: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    in_prompt: torch.Tensor | None = None


def _flat(
    rows: list[int], lists: Sequence[Sequence[int]], v: int, what: str, dev: torch.device
) -> torch.Tensor:
    """``j * v + t`` for every token ``t`` of ``lists[rows[j]]`` (an index into a ``[R, V]`` view),
    on ``dev`` (through numpy: a 32K-token list takes about 0.6 ms on the host)."""
    parts = [np.zeros(0, dtype=np.int64)]
    for j, i in enumerate(rows):
        ids = np.fromiter(lists[i], np.int64, len(lists[i]))
        if ids.size and (ids.min() < 0 or ids.max() >= v):
            raise ValueError(f"sample: row {i}'s {what} token ids must lie in [0, {v})")
        parts.append(ids + j * v)
    flat = torch.from_numpy(np.concatenate(parts))
    if dev.type == "cuda":
        return flat.pin_memory().to(dev, non_blocking=True)
    return flat.to(dev)


def _penalized(logits: torch.Tensor, params: Sequence[SamplingParams], seen: Seen | None,
               copied: bool) -> torch.Tensor:  # fmt: skip
    """fp32 ``logits`` (a copy unless ``copied``) with each penalized row's penalties applied,
    vLLM's ``apply_penalties``: the repetition penalty over the tokens of the prompt and the
    output (a logit > 0 divided by it, else multiplied), then the frequency penalty times each
    token's count in the output, then the presence penalty on every token the output holds.
    The other rows are left as they are. The host work is one list of every counted token id
    (prompt and output) per penalized row, copied to the device: linear in their lengths."""
    b, v = logits.shape
    rows = [i for i, p in enumerate(params) if p.penalized]
    dev, r = logits.device, len(rows)
    if seen is not None and seen.counts is not None and seen.in_prompt is not None:
        if seen.counts.shape != (r, v) or seen.in_prompt.shape != (r, v):
            raise ValueError(
                f"sample: seen.counts and seen.in_prompt must be [{r}, {v}] (the penalized rows)"
            )
        return _apply(logits, params, rows, seen.counts, seen.in_prompt, copied)
    if seen is None or len(seen.prompt) != b or len(seen.output) != b:
        raise ValueError(f"sample: penalties need the tokens seen for each of the {b} rows (seen=Seen(...))")
    idx = to_device(rows, torch.long, dev)
    counts = torch.zeros(r * v, dtype=torch.float32, device=dev)
    out = _flat(rows, seen.output, v, "output", dev)
    counts.index_add_(0, out, torch.ones(out.shape, dtype=torch.float32, device=dev))
    counts = counts.view(r, v)
    if seen.pending is not None:  # the token still on the device counts as output too
        if seen.pending.shape != (b,):
            raise ValueError(f"sample: seen.pending must be [{b}]; got {tuple(seen.pending.shape)}")
        pend = seen.pending.to(dev).index_select(0, idx)[:, None]
        counts.scatter_add_(1, pend.clamp(min=0), (pend >= 0).float())
    in_prompt = torch.zeros(r * v, dtype=torch.bool, device=dev)
    in_prompt.index_fill_(0, _flat(rows, seen.prompt, v, "prompt", dev), True)
    return _apply(logits, params, rows, counts, in_prompt.view(r, v), copied)


def _apply(logits: torch.Tensor, params: Sequence[SamplingParams], rows: list[int], counts: torch.Tensor,
           in_prompt: torch.Tensor, copied: bool) -> torch.Tensor:  # fmt: skip
    """The penalties of ``rows`` from their output ``counts`` and ``in_prompt`` masks ``[R, V]``."""
    dev = logits.device
    idx = to_device(rows, torch.long, dev)
    in_output = counts > 0
    sel = [params[i] for i in rows]
    # a penalty below fp32's range would be 0 (x / 0 = inf); one that takes a logit past it, inf
    rep = _column([p.repetition_penalty for p in sel], torch.float32, dev).clamp_(min=_TINY)
    x = logits.index_select(0, idx).float()
    x = torch.where(in_prompt | in_output, torch.where(x > 0, x / rep, x * rep), x)
    x -= _column([p.frequency_penalty for p in sel], torch.float32, dev) * counts
    x -= _column([p.presence_penalty for p in sel], torch.float32, dev) * in_output
    x.clamp_(-_FMAX, _FMAX)  # so the temperature step's shift never meets inf - inf
    full = logits.float() if copied or logits.dtype != torch.float32 else logits.clone()
    return full.index_copy_(0, idx, x)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    seen: Seen | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]`` as a ``LongTensor [B]`` on the logits' device.

    ``generators[i]`` (from :func:`make_generator`, on the logits' device) drives row ``i``'s
    noise when given; rows with ``None`` use the default generator. Greedy rows ignore both.
    ``seen`` holds the tokens the penalties count; it is needed when a row's params use one
    (``SamplingParams.penalized``) and is not read otherwise. Order: logit bias, penalties, then
    greedy choice or temperature, top-k, top-p and the draw (vLLM's).
    """
    _check(logits, params, generators)
    biased = any(p.logit_bias for p in params)
    if biased:
        logits = _biased(logits, params)
    if any(p.penalized for p in params):
        logits = _penalized(logits, params, seen, copied=biased)
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(-1)
    dev = logits.device
    # (x - max) / T: each row's largest logit becomes 0 and the others <= 0, so no temperature
    # overflows (x / 1e-30 would be inf, and softmax NaN); a temperature below fp32's range
    # (which would round to 0: 0 / 0) is taken at fp32's smallest, where every token short of
    # the row's largest already has probability 0, the limit of a vanishing temperature
    temps = _column([1.0 if p.greedy else p.temperature for p in params], torch.float32, dev)
    temps.clamp_(min=_TINY)
    x = logits.float()
    probs = _filter((x - x.amax(-1, keepdim=True)) / temps, params).softmax(-1)
    noise = torch.empty_like(probs)
    if any(g is None and not gr for g, gr in zip(generators, greedy, strict=True)):
        noise.exponential_()  # one batched draw from the device's default generator
    for i, g in enumerate(generators):
        if g is not None and not greedy[i]:
            noise[i] = torch.empty_like(probs[i]).exponential_(generator=g)
    # Exp(1) can round to 0; 0/0 would be NaN, which argmax treats as the largest value
    tokens = probs.div_(noise.clamp_(min=torch.finfo(probs.dtype).tiny)).argmax(-1)
    if any(greedy):
        tokens = torch.where(_column(greedy, torch.bool, dev).squeeze(1), logits.argmax(-1), tokens)
    return tokens


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's log-probabilities (raw ``logits [B, V]``: no temperature, no bias) of the
    sampled ``tokens [B]`` and the ``k`` most likely per row: ``chosen [B]``, ``values [B, k]``,
    ``ids [B, k]`` (fp32, long), on the logits' device."""
    lp = logits.float().log_softmax(-1)
    top = lp.topk(k, dim=-1) if k else None
    empty = lp.new_empty(lp.shape[0], 0)
    return (
        lp.gather(1, tokens[:, None]).squeeze(1),
        top.values if top is not None else empty,
        top.indices if top is not None else empty.long(),
    )
