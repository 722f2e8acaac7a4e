"""Next-token sampling for one engine step (§5.8): logit bias, greedy, temperature, top-k, top-p,
per-request seed.

Rows are filtered independently and then drawn with the exponential-race trick: ``argmax(p / E)``
with ``E ~ Exp(1)`` draws from ``p``. Unseeded rows share one batched draw from the device's default
generator; a seeded row draws its noise from its own :class:`torch.Generator`, so its tokens do not
depend on which other requests share the batch (given equal logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import SamplingParams

__all__ = ["make_generator", "sample", "to_device", "token_logprobs"]


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


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]`` as a ``LongTensor [B]`` on the logits' device.

    ``generators[i]`` (from :func:`make_generator`, on the logits' device) drives row ``i``'s
    noise when given; rows with ``None`` use the default generator. Greedy rows ignore both.
    """
    _check(logits, params, generators)
    if any(p.logit_bias for p in params):
        logits = _biased(logits, params)
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(-1)
    dev = logits.device
    temps = _column([1.0 if p.greedy else p.temperature for p in params], torch.float32, dev)
    probs = _filter(logits.float() / temps, params).softmax(-1)
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
