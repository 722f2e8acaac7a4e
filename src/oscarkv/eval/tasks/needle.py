"""Passkey and multi-needle retrieval with generation (code haystacks, no downloads).

The haystack is code: a block of ``BLOCK_LINES`` consecutive lines of the standard library's
``eval`` split (the split calibration never reads; non-empty lines without digits or quotes, the
block drawn per prompt) repeated line by line to the prompt length, the way the classic passkey
test repeats a prose filler. One or several needle lines ``NAME: int = NUMBER`` (upper-case
constant names, distinct random 4-digit values, a line each) sit at filler line boundaries at
the requested depths, and the prompt ends with the line ``NAME: int =`` for one of them: the
model must generate the number. One needle is the passkey test; several needles with distinct
names is multi-key needle-in-a-haystack. Every method is scored on the same prompts.

Why this format: the reference model is a code model; with an English-prose haystack or
contiguous real code it fails often in BF16 already, and without ``: int`` it tends to open a
string literal. In a 100-prompt BF16 run at 3K it copied numbers whose first token is one digit
(``" 4", "82", "13"``) 0.84 of the time (n = 73), those starting with a two-digit token
(``" 48", "39"``) 0.41 (n = 27), so values get a one-digit first token where the tokenizer
allows; the confirming run still gave only 0.74 (n = 100, vs 0.73 before). Measured on BF16 and
not kept (n = 30-40 each, within noise or worse): a 24-line block, ``NAME = N``, a blank-line
delimited constant, the value repeated in a comment, string, hex or digit-tuple values, queries
that are not the needle's own prefix (``assert NAME ==``, few-shot decoy pairs: 0.0-0.2). BF16
misses ~10-20% at 768 tokens too: this 30M model mis-copies digits (8349 for 8339).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["NAMES", "NeedleCase", "build_cases", "filler_lines", "generate_answers", "run_cases"]

NAMES = ("PASS_KEY", "DOOR_CODE", "PIN_NUMBER", "LOCK_COMBO", "ROOM_ID", "TICKET_NO", "SEAT_CODE", "BOX_ID")
#: lines of filler kept in the pool (from the first eval-split files in a stable order)
POOL_LINES = 20000
#: lines in the repeated filler block
BLOCK_LINES = 6
#: between a needle's name and its value; the query is the needle line up to the value
SEP = ": int = "


@dataclass(frozen=True)
class NeedleCase:
    context_len: int
    depth: float
    needles: int
    trial: int
    ids: tuple[int, ...]
    answer: str
    #: token offset of the queried needle line in ``ids``
    needle_pos: int = -1


@functools.lru_cache(maxsize=4)
def _stdlib_lines(root: str | None) -> tuple[str, ...]:
    from ...calibration.data import ranked_eval_files

    lines: list[str] = []
    for p in ranked_eval_files(0, root)[1]:
        text = p.read_text(encoding="utf-8", errors="replace")
        lines += [ln.rstrip() for ln in text.splitlines() if not any(n in ln for n in NAMES)]
        if len(lines) >= POOL_LINES:
            break
    return tuple(lines[:POOL_LINES])


def filler_lines(root: str | Path | None = None) -> tuple[str, ...]:
    """The haystack's line pool: code lines of the standard library's ``eval`` split, files in a
    stable hash order (as :func:`~oscarkv.calibration.data.eval_sequences`), needle names removed."""
    return _stdlib_lines(None if root is None else str(root))


def _clean(line: str) -> bool:
    return bool(line.strip()) and not any(c.isdigit() or c in "\"'" for c in line)


@functools.lru_cache(maxsize=8)
def _block_starts(pool: tuple[str, ...], n: int) -> tuple[int, ...]:
    """Pool indices where ``n`` consecutive non-empty lines without digits or quotes start."""
    ok = [_clean(ln) for ln in pool]
    return tuple(i for i in range(len(pool) - n + 1) if all(ok[i : i + n]))


def _single_digit_lead(tokenizer: Any, value: str) -> bool:
    """Whether the first token of ``" " + value`` that holds a digit holds only one."""
    for i in tokenizer(" " + value, add_special_tokens=False)["input_ids"]:
        n = sum(c.isdigit() for c in tokenizer.decode([i]))
        if n:
            return n == 1
    return False


def _values(rng: random.Random, tokenizer: Any, k: int, digits: int) -> list[str]:
    """``k`` distinct random ``digits``-digit numbers whose first digit is a token of its own where
    the tokenizer allows (BF16 copied 0.84 of those vs 0.41 with a leading ``" 48"``-like token);
    distinct, so no other needle holds the answer."""
    out: list[str] = []
    for tries in range(100 * k):
        v = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if v not in out and (tries >= 50 * k or _single_digit_lead(tokenizer, v)):
            out.append(v)
            if len(out) == k:
                break
    return out


def build_cases(
    tokenizer: Any,
    lengths: list[int],
    depths: list[float],
    trials: int,
    needles: int,
    seed: int = 0,
    digits: int = 4,
    filler: Sequence[str] | None = None,
    block_lines: int = BLOCK_LINES,
) -> list[NeedleCase]:
    """Prompts of exactly ``context_len`` tokens (the first filler line may start cut); the queried
    needle starts at about ``depth`` of the prompt (0 = start), at the nearest filler line boundary. ``filler``: the line pool (default
    :func:`filler_lines`)."""
    if needles > len(NAMES):
        raise ValueError(f"at most {len(NAMES)} needles; got {needles}")
    pool = tuple(filler if filler is not None else filler_lines())
    starts = _block_starts(pool, block_lines)
    if not starts:
        raise ValueError(
            f"the filler pool has no {block_lines} consecutive non-empty lines without digits or quotes; "
            "pass a larger filler or a smaller block_lines"
        )
    rng = random.Random(seed)
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    nl = len(enc("\n"))
    cases = []
    for n_tok in lengths:
        for depth in depths:
            for trial in range(trials):
                names = rng.sample(NAMES, needles)
                values = _values(rng, tokenizer, needles, digits)
                s0 = rng.choice(starts)
                block = list(pool[s0 : s0 + block_lines])
                needle_text = [f"{n}{SEP}{v}" for n, v in zip(names, values, strict=True)]
                query = enc(f"\n{names[0]}{SEP.rstrip()}")
                per_block = len(enc("\n".join(block * 2))) - len(enc("\n".join(block)))  # one more
                body = n_tok - len(query) - sum(len(enc(t)) + nl for t in needle_text)
                n_lines = max(1, round(body * block_lines / per_block))  # the block repeated, cut at a line
                lines = [block[j % block_lines] for j in range(n_lines)]
                spots = [depth] + [rng.uniform(0.05, 0.95) for _ in range(needles - 1)]
                at = sorted((round(sp * len(lines)), i) for i, sp in enumerate(spots))
                ids: list[int] = []
                pos, first, prev = -1, -1, 0
                for k, i in at:
                    if k > prev:  # the filler lines before this needle; line breaks open a line
                        ids += enc(("\n" if ids else "") + "\n".join(lines[prev:k]))
                    first = len(ids) + (nl if ids else 0) if first < 0 else first
                    pos = len(ids) + (nl if ids else 0) if i == 0 else pos
                    ids += enc(("\n" if ids else "") + needle_text[i])
                    prev = k
                if prev < len(lines):
                    ids += enc("\n" + "\n".join(lines[prev:]))
                ids += query
                # exactly n_tok tokens, so prompts batch without padding: filler lines added in
                # front (the block's, cyclically backwards), then the surplus cut from the start
                back = 0
                while len(ids) < n_tok:
                    back += 1
                    head = enc(block[-back % block_lines] + "\n")
                    ids, pos, first = head + ids, pos + len(head), first + len(head)
                cut = len(ids) - n_tok
                if cut > first:
                    raise ValueError(
                        f"a {n_tok}-token prompt with a needle at depth {depth} leaves no filler to trim "
                        "before it; use a longer context or a later depth"
                    )
                cases.append(NeedleCase(n_tok, depth, needles, trial, tuple(ids[cut:]), values[0], pos - cut))
    return cases


def _correct(text: str, answer: str) -> bool:
    text = text.strip()
    return text.startswith(answer) and not text[len(answer) : len(answer) + 1].isdigit()


@torch.inference_mode()
def generate_answers(
    model: Any, tokenizer: Any, method: Any, cases: Sequence[NeedleCase], batch_size: int = 16,
    max_new_tokens: int = 6,
) -> list[str]:  # fmt: skip
    """Greedy continuations through the method's cache, ``batch_size`` prompts of one length at a
    time (prompts are exact-length, so no padding); one decoded string per case, in order."""
    device = next(model.parameters()).device
    by_len: dict[int, list[int]] = {}
    for j, c in enumerate(cases):
        by_len.setdefault(len(c.ids), []).append(j)
    texts = [""] * len(cases)
    for group in by_len.values():
        for b in range(0, len(group), batch_size):
            idx = group[b : b + batch_size]
            ids = torch.tensor([cases[j].ids for j in idx], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                past_key_values=method.make_cache(model),
                pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
            )
            for row, j in enumerate(idx):
                texts[j] = tokenizer.decode(out[row, ids.shape[1] :], skip_special_tokens=True)
    return texts


def run_cases(
    model: Any, tokenizer: Any, method: Any, cases: Sequence[NeedleCase], batch_size: int = 16
) -> list[bool]:
    """Per case: whether the greedy output starts with the answer (and no further digit)."""
    texts = generate_answers(model, tokenizer, method, cases, batch_size)
    return [_correct(t, c.answer) for t, c in zip(texts, cases, strict=True)]
