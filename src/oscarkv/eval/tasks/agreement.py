"""Greedy agreement with BF16 and loop rate on long chat prompts (the ``chat-agreement`` task).

Each prompt is one user message holding an excerpt of the evaluation text (the standard library's
``eval`` split, or the user's ``--data`` documents joined in seeded order; consecutive windows, so
no two prompts share text) followed by one of :data:`INSTRUCTIONS`, rendered with the chat
template and its generation prompt. Every prompt is exactly ``context − new_tokens`` tokens, so the
prompt and its answer fit the context and same-length prompts batch without padding. Every method
greedily generates ``new_tokens`` tokens on the same prompts (stopping at the end-of-turn token);
a continuation is the generated tokens up to and including the first end token.

Per method against BF16 (the reference, generated in the same batches): the exact-match rate of
whole continuations and the common prefix (tokens before the first position where the two differ;
the whole continuation when they match). For every method, BF16 included, the loop rate:

**A continuation loops** when it has at least :data:`LOOP_MIN_TOKENS` tokens (end token left out)
and at least :data:`LOOP_THRESHOLD` of the 4-grams starting in its last :data:`LOOP_WINDOW`
tokens already started at an earlier position of the continuation. A cycle that began at least
one period before the last 64 tokens scores 1, whatever its period; a repeated phrase whose
numbers change (``a 500 (a bug) for a 404 (not found) for a 400 …``) ~0.55–0.65 on SmolLM2's
tokenizer; fluent prose under 0.1.

The distinct-4-gram ratio (distinct 4-grams over 4-grams in the whole continuation) is averaged
per method as a softer measure of repetition.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import InputError
from .retrieval import chat_frame

__all__ = [
    "INSTRUCTIONS",
    "LOOP_MIN_TOKENS",
    "LOOP_THRESHOLD",
    "LOOP_WINDOW",
    "AgreementCase",
    "agreement_frame",
    "agreement_markdown",
    "agreement_summary",
    "build_agreement_cases",
    "common_prefix",
    "distinct_ngram_ratio",
    "generate_tokens",
    "is_loop",
    "run_agreement",
    "tail_repeat_fraction",
]

INSTRUCTIONS = (
    "Summarize the text above.",
    "List the main points of the text above.",
    "Explain what the code or text above does, step by step.",
    "What questions could a reader ask about the text above? Answer two of them.",
    "Write a short title and a one-paragraph abstract for the text above.",
    "Explain the text above to a beginner.",
)
LOOP_WINDOW = 64
LOOP_NGRAM = 4
LOOP_THRESHOLD = 0.5
LOOP_MIN_TOKENS = 16


def tail_repeat_fraction(tokens: Sequence[int], window: int = LOOP_WINDOW, n: int = LOOP_NGRAM) -> float:
    """The fraction of the ``n``-grams starting in the last ``window`` tokens that already started
    at an earlier position of ``tokens`` (0.0 when there is no ``n``-gram)."""
    toks = list(tokens)
    first: dict[tuple[int, ...], int] = {}
    for i in range(len(toks) - n + 1):
        first.setdefault(tuple(toks[i : i + n]), i)
    idx = range(max(0, len(toks) - window), len(toks) - n + 1)
    if not idx:
        return 0.0
    return sum(first[tuple(toks[i : i + n])] < i for i in idx) / len(idx)


def is_loop(tokens: Sequence[int]) -> bool:
    """Whether a continuation (without its end token) loops: see the module docstring."""
    return len(tokens) >= LOOP_MIN_TOKENS and tail_repeat_fraction(tokens) >= LOOP_THRESHOLD


def distinct_ngram_ratio(tokens: Sequence[int], n: int = LOOP_NGRAM) -> float:
    """Distinct ``n``-grams over all ``n``-grams of ``tokens`` (1.0 when there is none)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens before the first position where ``a`` and ``b`` differ."""
    k = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        k += 1
    return k


@dataclass(frozen=True)
class AgreementCase:
    ids: tuple[int, ...]
    #: index into :data:`INSTRUCTIONS`
    instruction: int


def agreement_frame(tokenizer: Any) -> tuple[list[int], list[int]]:
    """:func:`~.retrieval.chat_frame`, with this task's error for a tokenizer without a template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "the chat-agreement task asks through the chat template, and this tokenizer has none",
            "use an instruct/chat model, or leave chat-agreement out of --tasks",
        )
    return chat_frame(tokenizer)


def _documents(tokenizer: Any, data: Sequence[str | Path] | None, seed: int) -> Iterator[str]:
    from ...calibration.data import iter_documents, quiet_length_warning, ranked_eval_files

    if data:
        yield from iter_documents(data, tokenizer, seed)
        return
    quiet_length_warning(tokenizer)
    for path in ranked_eval_files(seed)[1]:
        yield path.read_text(encoding="utf-8", errors="replace")


def _excerpts(tokenizer: Any, docs: Iterator[str], count: int, length: int) -> list[list[int]]:
    """``count`` consecutive, non-overlapping ``length``-token windows of ``docs`` joined by blank
    lines, each moved to start after a line break within its first 64 tokens where there is one."""
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    sep, out, buf = enc("\n\n"), [], []
    for doc in docs:
        buf += enc(doc) + sep
        while len(buf) >= length + 64:
            lead = next((i + 1 for i, t in enumerate(buf[:64]) if tokenizer.decode([t]).endswith("\n")), 0)
            out.append(buf[lead : lead + length])
            buf = buf[lead + length :]
            if len(out) == count:
                return out
    raise InputError(
        f"the evaluation text gives {len(out)} excerpts of {length} tokens, fewer than the "
        f"{count} chat-agreement prompts asked",
        "pass more --data, or lower --agreement-prompts or --context",
    )


def build_agreement_cases(
    tokenizer: Any, prompt_len: int, prompts: int, data: Sequence[str | Path] | None = None, seed: int = 0
) -> list[AgreementCase]:
    """``prompts`` chat prompts of exactly ``prompt_len`` tokens: an excerpt of the text, then an
    instruction drawn with ``seed`` from :data:`INSTRUCTIONS`, in the chat template."""
    head, tail = agreement_frame(tokenizer)
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    asks = [enc("\n\n" + s) for s in INSTRUCTIONS]
    longest = prompt_len - len(head) - len(tail) - min(len(a) for a in asks)
    if prompt_len - len(head) - len(tail) - max(len(a) for a in asks) < 64:
        raise InputError(
            f"a {prompt_len}-token chat-agreement prompt leaves no room for the text",
            "raise --context or lower --agreement-tokens",
        )
    rng = random.Random(seed)
    picks = [rng.randrange(len(INSTRUCTIONS)) for _ in range(prompts)]
    cases = []
    for k, text in zip(picks, _excerpts(tokenizer, _documents(tokenizer, data, seed), prompts, longest),
                       strict=True):  # fmt: skip
        fill = prompt_len - len(head) - len(tail) - len(asks[k])
        ids = head + text[:fill] + asks[k] + tail
        assert len(ids) == prompt_len, (len(ids), prompt_len)
        cases.append(AgreementCase(tuple(ids), k))
    return cases


def _end_ids(model: Any, tokenizer: Any) -> list[int]:
    gen = getattr(model, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    tok = getattr(tokenizer, "eos_token_id", None)
    return sorted({*ids, *([tok] if isinstance(tok, int) else [])})


@torch.inference_mode()
def generate_tokens(
    model: Any, tokenizer: Any, method: Any, cases: Sequence[AgreementCase], new_tokens: int,
    batch_size: int = 16,
) -> list[list[int]]:  # fmt: skip
    """Greedy continuations through the method's cache, ``batch_size`` prompts at a time: each the
    generated tokens up to and including the first end token (the model's or tokenizer's EOS)."""
    device = next(model.parameters()).device
    end = _end_ids(model, tokenizer)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (end[0] if end else 0)
    out: list[list[int]] = []
    for b in range(0, len(cases), batch_size):
        ids = torch.tensor([c.ids for c in cases[b : b + batch_size]], device=device)
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            do_sample=False, past_key_values=method.make_cache(model), pad_token_id=pad,
            eos_token_id=end or None,
        )  # fmt: skip
        for row in gen[:, ids.shape[1] :].tolist():
            stop = next((i for i, t in enumerate(row) if t in end), None)
            out.append(row if stop is None else row[: stop + 1])
    return out


def run_agreement(
    model: Any, tokenizer: Any, methods: Mapping[str, Any], reference: Any, cases: Sequence[AgreementCase],
    new_tokens: int, batch_size: int = 16, say: Callable[[str], None] = lambda m: None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per method: its continuations' per-prompt statistics (lists, prompt order), ``loops`` and
    ``loop_rate`` for every method, ``exact``/``prefix`` against ``reference``'s continuations for
    the others. ``reference`` is the ``bf16`` entry of ``methods`` when there is one (run once)."""
    end = set(_end_ids(model, tokenizer))
    order = sorted(methods, key=lambda n: n != "bf16")
    ref = None
    if "bf16" not in methods:
        ref = generate_tokens(model, tokenizer, reference, cases, new_tokens, batch_size)
    out: dict[str, dict[str, Any]] = {}
    for name in order:
        say(f"chat-agreement: {name} ({len(cases)} prompts, {new_tokens} new tokens)")
        toks = generate_tokens(model, tokenizer, methods[name], cases, new_tokens, batch_size)
        ref = toks if name == "bf16" else ref
        body = [t[:-1] if t and t[-1] in end else t for t in toks]
        r: dict[str, Any] = {
            "loops": [int(is_loop(t)) for t in body],
            "repeat": [round(tail_repeat_fraction(t), 4) for t in body],
            "distinct4": [round(distinct_ngram_ratio(t), 4) for t in body],
            "lengths": [len(t) for t in toks],
            "texts": [tokenizer.decode(t, skip_special_tokens=True) for t in toks],
        }
        r["loop_rate"] = sum(r["loops"]) / len(cases)
        if name != "bf16":
            r["exact"] = [int(a == b) for a, b in zip(toks, ref, strict=True)]
            r["prefix"] = [common_prefix(a, b) for a, b in zip(toks, ref, strict=True)]
            r["exact_rate"] = sum(r["exact"]) / len(cases)
        out[name] = r
    return out


def agreement_summary(rows: Sequence[Mapping[str, Any]], method: str) -> dict[str, Any]:
    """The report's ``chat-agreement`` fields for ``method`` (empty without its rows): loop rate
    and count, exact-match rate, mean / median common prefix, mean distinct-4-gram ratio, and the
    paired loop counts against BF16 (prompts where only this method loops, and only BF16)."""
    by = {r["method"]: r for r in rows if r["task"] == "chat-agreement" and r["metric"] == "loop_rate"}
    ex = {r["method"]: r for r in rows if r["task"] == "chat-agreement" and r["metric"] == "exact_match"}
    if method not in by:
        return {}
    r, s = by[method], {}
    s["agreement_n"], s["agreement_tokens"] = r["n"], r["new_tokens"]
    s["loop_rate"], s["loop_count"] = r["value"], sum(r["loops"])
    s["distinct4"] = statistics.fmean(r["distinct4"])
    if method in ex:
        e = ex[method]
        s["exact_match"], s["exact_count"] = e["value"], sum(e["exact"])
        s["prefix_mean"], s["prefix_median"] = statistics.fmean(e["prefix"]), statistics.median(e["prefix"])
    if method != "bf16" and "bf16" in by:
        mine, ref = r["loops"], by["bf16"]["loops"]
        s["loops_not_bf16"] = sum(a and not b for a, b in zip(mine, ref, strict=True))
        s["bf16_loops_not_this"] = sum(b and not a for a, b in zip(mine, ref, strict=True))
    return s


def agreement_markdown(summ: Sequence[Mapping[str, Any]]) -> str:
    """The "Chat agreement" section of ``results.md`` (empty when the task did not run)."""
    got = [s for s in summ if "loop_rate" in s]
    if not got:
        return ""
    n, g = got[0]["agreement_n"], got[0]["agreement_tokens"]
    lines = [
        f"## Chat agreement with BF16 and loop rate ({n} long chat prompts, {g} greedy tokens each)",
        "",
        "| method | bits/elem | exact match | common prefix, mean / median | loop rate | loops, BF16 does not "
        "| BF16 loops, this does not | distinct 4-grams |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in got:
        em = f"{s['exact_match']:.3f} ({s['exact_count']}/{n})" if "exact_match" in s else "(reference)"
        pre = f"{s['prefix_mean']:.1f} / {s['prefix_median']:.1f}" if "prefix_mean" in s else "-"
        lines.append(
            f"| {s['method']} | {s['bits_per_element']:.2f} | {em} | {pre} | {s['loop_rate']:.3f} "
            f"({s['loop_count']}/{n}) | {s.get('loops_not_bf16', '-')} | {s.get('bf16_loops_not_this', '-')} "
            f"| {s['distinct4']:.3f} |"
        )
    lines += [
        "",
        f"_Same prompts for every method. Common prefix: tokens before the first difference from BF16's "
        f"continuation. A continuation loops when >= {LOOP_THRESHOLD} of the {LOOP_NGRAM}-grams starting in "
        f"its last {LOOP_WINDOW} tokens occurred earlier in it (at least {LOOP_MIN_TOKENS} tokens)._",
    ]
    return "\n".join(lines)
