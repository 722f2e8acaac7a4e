"""What the penalties count, kept on the device per request slot: each slot's output-token
counts and prompt-token mask, so a penalized step costs no host work that grows with the
request (``sampler.Seen``'s counts form).

A slot's rows are rebuilt from the host's lists once per admission (``Sequence.epoch``; the
host knows every token then: a request is admitted with no token in flight), and every token
sampled for a penalized slot is added on the device right after it is drawn, in stream order, so
the next step sees it before the host has read it (overlapped scheduling). Allocated on the
first penalized request: ``max_running x vocab`` int32 counts and bool mask (5 bytes each).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import StepSeq
from .sampler import Seen, to_device

__all__ = ["PenaltyCounts"]


class PenaltyCounts:
    """Per-slot output counts (int32 ``[S, V]``) and prompt masks (bool ``[S, V]``) on ``device``."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.out = torch.zeros(slots, vocab, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.epoch = [-1] * slots  # the admission each slot's rows were built for
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None  # the last seen(): slots, rows

    def _reset(self, slot: int, prompt: Sequence[int], out: Sequence[int]) -> None:
        for name, ids in (("prompt", prompt), ("output", out)):
            if ids and (min(ids) < 0 or max(ids) >= self.vocab):
                raise ValueError(f"penalties: {name} token ids must lie in [0, {self.vocab})")
        self.out[slot].zero_()
        if out:
            t = to_device(list(out), torch.long, self.device)
            self.out[slot].index_add_(0, t, torch.ones(t.shape, dtype=torch.int32, device=self.device))
        self.in_prompt[slot].zero_()
        self.in_prompt[slot].index_fill_(0, to_device(list(prompt), torch.long, self.device), True)

    def seen(self, rows: Sequence[StepSeq]) -> Seen | None:
        """The counts of the penalized ``rows`` (in row order; None when there are none),
        rebuilding a slot whose admission changed; :meth:`count` then adds their sampled tokens."""
        slots, picked = [], []
        for i, it in enumerate(rows):
            seq = it.seq
            if not seq.params.penalized:
                continue
            assert seq.slot is not None
            if self.epoch[seq.slot] != seq.epoch:
                assert it.start + it.n_new == len(seq.prompt) + len(seq.out), "a token in flight at admission"
                self._reset(seq.slot, seq.prompt, seq.out)
                self.epoch[seq.slot] = seq.epoch
            slots.append(seq.slot)
            picked.append(i)
        if not slots:
            self._step = None
            return None
        at = to_device(slots, torch.long, self.device)
        self._step = (at, to_device(picked, torch.long, self.device))
        return Seen(counts=self.out.index_select(0, at).float(), in_prompt=self.in_prompt.index_select(0, at))

    def count(self, tokens: torch.Tensor) -> None:
        """Add the tokens sampled for the rows of the last :meth:`seen` (``tokens [B]``, long, one
        per row of that step) to their slots' counts, on the device."""
        assert self._step is not None, "count() without a seen() of penalized rows"
        slots, picked = self._step
        self.out.index_put_((slots, tokens.index_select(0, picked)), torch.ones_like(slots, dtype=torch.int32),
                            accumulate=True)  # fmt: skip
        self._step = None
