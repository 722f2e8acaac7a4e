"""A step queued on the device (:class:`Launched`) and the reading of its results: the sampled
tokens, their log-probabilities and a prefill's prompt log-probabilities, host-side, once the
device has produced them."""

from __future__ import annotations

import dataclasses

import torch

from .request import Batch, StepSeq, TokenLogprob

__all__ = ["Launched", "Scored", "pinned", "prompt_logprobs_of", "token_logprobs_of", "tokens_of"]

#: log-probabilities of ``R`` rows: the scored token's ``[R]``, the top values and ids ``[R, K]``
Scored = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class Launched:
    """A step queued on the device: its batch and its sampled tokens (``tokens`` on the device,
    ``host`` their pinned copy once ``event`` has passed; on the CPU ``tokens`` is final)."""

    batch: Batch
    tokens: torch.Tensor | None  # long [R]: one per item that samples, in item order
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    # (chosen [R], top values [R, K], top ids [R, K]) where a row asked for log-probabilities;
    # host copies on CUDA, read after ``event``
    logprobs: Scored | None = None
    # the same for the prompt rows a prefill scores (``StepSeq.n_prompt_scored`` per item)
    prompt_logprobs: Scored | None = None


def pinned(t: Scored | None) -> Scored | None:
    """Pinned host copies of the CUDA tensors ``t`` (read after the step's event)."""
    if t is None:
        return t
    return tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)
                 for x in t)  # type: ignore[return-value]  # fmt: skip


def tokens_of(step: Launched) -> list[int | None]:
    """The tokens of a launched step, one per item (None for chunks that do not end a prompt);
    blocks until the device has produced them."""
    if step.tokens is None:
        return [None] * len(step.batch.items)
    if step.event is not None:
        assert step.host is not None
        step.event.synchronize()
        toks = iter(step.host.tolist())
    else:
        toks = iter(step.tokens.tolist())
    return [next(toks) if it.ends_prompt else None for it in step.batch.items]


def token_logprobs_of(step: Launched) -> list[TokenLogprob | None]:
    """Each item's sampled-token log-probability and its top ``params.logprobs`` (None where the
    item samples nothing or asked for none); call after :func:`tokens_of`."""
    if step.logprobs is None:
        return [None] * len(step.batch.items)
    chosen, vals, ids = (t.tolist() for t in step.logprobs)
    out: list[TokenLogprob | None] = []
    r = 0
    for it in step.batch.items:
        if not it.ends_prompt:
            out.append(None)
            continue
        k = it.seq.params.logprobs
        out.append(None if k is None else (chosen[r], tuple(zip(ids[r][:k], vals[r][:k], strict=True))))
        r += 1
    return out


def prompt_logprobs_of(step: Launched) -> list[tuple[StepSeq, list[TokenLogprob]]]:
    """For each item that scores prompt rows: the item and, per row, the next prompt token's
    log-probability and the top ``params.prompt_logprobs`` (the row at position ``p`` scores
    prompt token ``p + 1``)."""
    if step.prompt_logprobs is None:
        return []
    if step.event is not None:
        step.event.synchronize()
    chosen, vals, ids = (t.tolist() for t in step.prompt_logprobs)
    out, r = [], 0
    for it in step.batch.items:
        k = it.seq.params.prompt_logprobs
        if k is None:
            continue
        n = it.n_prompt_scored
        out.append(
            (it, [(chosen[j], tuple(zip(ids[j][:k], vals[j][:k], strict=True))) for j in range(r, r + n)])
        )
        r += n
    return out
