"""Passkey and multi-needle retrieval with generation (synthetic haystacks, no downloads).

A haystack of repeated filler lines holds one or several ``name = NUMBER`` lines; the prompt
ends with ``name =`` for one of them and the model must generate the number. One needle is the
classic passkey test; several needles with distinct names is multi-key needle-in-a-haystack.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NeedleCase", "build_cases", "run_case"]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NAMES = ("pass_key", "door_code", "pin_number", "lock_combo", "room_id", "ticket_no", "seat_code", "box_id")


@dataclass(frozen=True)
class NeedleCase:
    context_len: int
    depth: float
    needles: int
    trial: int
    ids: tuple[int, ...]
    answer: str


def build_cases(
    tokenizer: Any,
    lengths: list[int],
    depths: list[float],
    trials: int,
    needles: int,
    seed: int = 0,
    digits: int = 4,
) -> list[NeedleCase]:
    """Prompts of about ``context_len`` tokens; the queried needle sits at ``depth`` (0 = start)."""
    if needles > len(NAMES):
        raise ValueError(f"at most {len(NAMES)} needles; got {needles}")
    rng = random.Random(seed)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    fill = enc(FILLER)
    cases = []
    for n_tok in lengths:
        for depth in depths:
            for trial in range(trials):
                names = rng.sample(NAMES, needles)
                values = [str(rng.randint(10 ** (digits - 1), 10**digits - 1)) for _ in names]
                target = 0
                spots = [depth] + [rng.random() for _ in range(needles - 1)]
                query = enc(f"\n{names[target]} =")
                body = n_tok - len(query)
                lines = [enc(f"\n{n} = {v}\n") for n, v in zip(names, values, strict=True)]
                n_fill = max(1, (body - sum(map(len, lines))) // len(fill))
                slots = [round(s * n_fill) for s in spots]
                ids: list[int] = []
                for j in range(n_fill + 1):
                    for s, line in zip(slots, lines, strict=True):
                        if s == j:
                            ids += line
                    if j < n_fill:
                        ids += fill
                cases.append(NeedleCase(n_tok, depth, needles, trial, tuple(ids + query), values[target]))
    return cases


@torch.inference_mode()
def run_case(model: Any, tokenizer: Any, method: Any, case: NeedleCase, max_new_tokens: int = 6) -> bool:
    """Greedy generation through the method's cache; correct iff the output starts with the answer."""
    device = next(model.parameters()).device
    ids = torch.tensor([case.ids], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        past_key_values=method.make_cache(model),
        pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
    )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    return text.startswith(case.answer) and not text[len(case.answer) : len(case.answer) + 1].isdigit()
