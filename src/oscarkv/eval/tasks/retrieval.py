"""Key/value retrieval asked through the chat template (RULER's multi-key needle task).

A user message holds a haystack of ``context_len`` tokens in all: lines of text (the standard
library's ``eval`` split, or the user's ``--data`` documents) with ``keys`` needle sentences
``The special magic number for KEY is: VALUE.`` at random line boundaries (KEY two random words
joined by a hyphen, VALUE a random 7-digit number, all distinct), then the question for one of
them. The prompt is the chat template's rendering of that message with the generation prompt, so
an instruct model answers as it was trained to; an answer is correct when its first
``max_new_tokens`` tokens hold the value (RULER's string-match score). Every method is scored on
the same prompts, so differences can be paired per prompt.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ...errors import InputError
from .needle import NeedleCase, generate_answers

__all__ = ["WORDS", "build_retrieval_cases", "chat_frame", "run_retrieval"]

WORDS = (
    "amber", "anchor", "apple", "arrow", "autumn", "badge", "bamboo", "banner", "basket", "beacon",
    "berry", "blossom", "bridge", "candle", "canyon", "carbon", "castle", "cedar", "cherry", "cobalt",
    "comet", "copper", "coral", "crystal", "dawn", "delta", "desert", "dolphin", "ember", "falcon",
    "feather", "forest", "galaxy", "garden", "glacier", "granite", "harbor", "hazel", "island", "ivory",
    "jasmine", "jungle", "lagoon", "lantern", "lemon", "marble", "meadow", "meteor", "mirror", "nectar",
    "oasis", "ocean", "orchid", "pebble", "pepper", "planet", "prairie", "quartz", "raven", "river",
    "saffron", "sapphire", "shadow", "silver", "spruce", "summit", "thunder", "timber", "topaz", "tulip",
    "velvet", "violet", "walnut", "willow", "winter", "zephyr",
)  # fmt: skip
QUESTION = (
    "What is the special magic number for {key} mentioned in the provided text? Answer with the number only."
)
NEEDLE = "The special magic number for {key} is: {value}."
#: a stand-in for the user message while the chat template is split around it
_SLOT = "\x00HAYSTACK\x00"


def chat_frame(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The chat template's tokens before and after the user message (generation prompt included).
    Raises ``ValueError`` when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "the chat-retrieval task asks through the chat template, and this tokenizer has none",
            "use an instruct/chat model, or leave chat-retrieval out of --tasks",
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SLOT}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    if text.count(_SLOT) != 1:
        raise ValueError("the chat template does not render the user message verbatim once")
    head, tail = text.split(_SLOT)
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    return enc(head), enc(tail)


def build_retrieval_cases(
    tokenizer: Any, context_len: int, prompts: int, keys: int, lines: Sequence[str], seed: int = 0
) -> list[NeedleCase]:
    """``prompts`` chat prompts of exactly ``context_len`` tokens, ``keys`` needles each (the queried
    one at a depth uniform in [0.05, 0.95] of the haystack, the others anywhere), haystack lines
    drawn as one contiguous run of ``lines`` from a random start (cyclically)."""
    if keys < 1 or keys * 2 > len(WORDS):
        raise ValueError(f"keys per prompt must be in [1, {len(WORDS) // 2}]; got {keys}")
    pool = [ln for ln in lines if ln.strip()]
    if not pool:
        raise ValueError("the retrieval haystack needs text lines; the filler has none")
    head, tail = chat_frame(tokenizer)
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    rng = random.Random(seed)
    cases = []
    for trial in range(prompts):
        names = _keys(rng, keys)
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), keys)]
        question = enc("\n\n" + QUESTION.format(key=names[0]))
        budget = context_len - len(head) - len(tail) - len(question)
        needles = [enc(NEEDLE.format(key=k, value=v) + "\n") for k, v in zip(names, values, strict=True)]
        fill = budget - sum(len(n) for n in needles)
        if fill < 16 * keys:
            raise ValueError(f"a {context_len}-token prompt leaves no room for the haystack; raise --context")
        start, body = rng.randrange(len(pool)), []
        while len(body) < fill + 64:  # whole lines, a little more than needed, then cut exactly
            body += enc(pool[start % len(pool)] + "\n")
            start += 1
        body = body[len(body) - fill :]
        # needles go at line boundaries nearest their spots: after a newline token of the filler
        nl = enc("\n")[-1]
        breaks = [i + 1 for i, t in enumerate(body) if t == nl] or [len(body)]
        depth = rng.uniform(0.05, 0.95)
        spots = [depth] + [rng.uniform(0.0, 1.0) for _ in range(keys - 1)]
        at = sorted((min(breaks, key=lambda b, s=s: abs(b - s * len(body))), i) for i, s in enumerate(spots))
        ids, prev, pos = list(head), 0, -1
        for b, i in at:
            ids += body[prev:b]
            pos = len(ids) if i == 0 else pos
            ids += needles[i]
            prev = b
        ids += body[prev:] + question + tail
        assert len(ids) == context_len, (len(ids), context_len)
        cases.append(NeedleCase(context_len, round(depth, 3), keys, trial, tuple(ids), values[0], pos))
    return cases


def _keys(rng: random.Random, n: int) -> list[str]:
    words = rng.sample(WORDS, 2 * n)
    return [f"{words[2 * i]}-{words[2 * i + 1]}" for i in range(n)]


def run_retrieval(
    model: Any, tokenizer: Any, method: Any, cases: Sequence[NeedleCase], batch_size: int = 16,
    max_new_tokens: int = 24,
) -> list[bool]:  # fmt: skip
    """Per case: whether the greedy answer holds the queried value."""
    texts = generate_answers(model, tokenizer, method, cases, batch_size, max_new_tokens)
    return [c.answer in t for t, c in zip(texts, cases, strict=True)]
