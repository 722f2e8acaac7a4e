"""`run_eval`: every (method, task) pair on one model and one data draw, as result rows."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..calibration.data import eval_sequences, iter_documents, token_sequences
from ..config import EvalConfig
from ..rotation import RotationSet, model_head_dim
from .methods import get_method
from .tasks.agreement import agreement_frame, build_agreement_cases, run_agreement
from .tasks.attn_error import attention_metrics, hidden_state_errors
from .tasks.needle import build_cases, filler_lines, run_cases
from .tasks.ppl import batched_sequence_nlls, perplexity
from .tasks.retrieval import build_retrieval_cases, chat_frame, run_retrieval

__all__ = ["passkey_at_context_cases", "run_eval", "text_sequences"]


def _depths(n: int) -> list[float]:
    return [0.5] if n == 1 else [round(0.05 + 0.9 * i / (n - 1), 3) for i in range(n)]


def _lengths(cfg: EvalConfig) -> list[int]:
    n = cfg.needle_lengths
    return sorted({max(256, cfg.context * (i + 1) // n) for i in range(n)})


def text_sequences(
    tokenizer: Any, data: Sequence[str | Path] | None, num_sequences: int, seq_len: int, seed: int
) -> torch.Tensor:
    """Scored text ``[n, seq_len]``: one window per standard-library module of the ``eval`` split
    (:func:`~oscarkv.calibration.data.eval_sequences`), or, with ``data`` (files, folders, JSONL),
    contiguous windows of the user's documents joined in seeded order."""
    if not data:
        return eval_sequences(tokenizer, num_sequences, seq_len, seed)
    return token_sequences(
        tokenizer, data, num_sequences, seq_len, seed, lower="--context, --ppl-sequences or --attn-sequences"
    )


def run_eval(
    model: Any,
    tokenizer: Any,
    rotations: RotationSet | None,
    config: EvalConfig,
    progress: Any = None,
    data: Sequence[str | Path] | None = None,
    recipes: Mapping[str, RotationSet] | None = None,
) -> list[dict[str, Any]]:
    """Run ``config``'s tasks for its methods; returns rows with at least ``method``, ``task``,
    ``metric``, ``value`` and ``bits_per_element``. ``progress(msg)`` is called between steps.
    ``data``: the user's text for perplexity and the per-layer errors (default: the standard
    library's ``eval`` split). ``recipes``: more rotation artifacts, each evaluated as the method
    ``oscar:NAME`` (the 'oscar' method's storage with that artifact's clips, offsets and key bits)."""
    cfg = config.effective()
    say = progress or (lambda msg: None)
    mcfg = model.config.get_text_config()
    d = model_head_dim(mcfg)
    methods = {m: get_method(m, rotations, mcfg) for m in cfg.method_list}
    for name, rs in (recipes or {}).items():
        methods[f"oscar:{name}"] = get_method("oscar", rs, mcfg)
    rows: list[dict[str, Any]] = []

    def row(method: str, task: str, metric: str, value: float, **extra: Any) -> None:
        ctx = int(extra.get("context_len", cfg.context))
        bpe = methods[method].bits_per_element(ctx, d)
        rows.append(
            {
                "method": method,
                "task": task,
                "metric": metric,
                "value": float(value),
                "bits_per_element": round(bpe, 4),
                **extra,
            }
        )

    tasks = cfg.task_list
    if "chat-retrieval" in tasks:
        chat_frame(tokenizer)  # a tokenizer without a chat template fails before any task runs
    if "chat-agreement" in tasks:
        agreement_frame(tokenizer)
    if "ppl" in tasks:
        seqs = text_sequences(tokenizer, data, cfg.ppl_sequences, cfg.context, cfg.seed)
        ctx = cfg.context - cfg.ppl_continuation
        for name, m in methods.items():
            say(f"ppl: {name}")
            nll, n = batched_sequence_nlls(model, m, seqs, ctx, cfg.ppl_chunk, cfg.batch_size)
            row(
                name,
                "ppl",
                "ppl",
                perplexity(sum(nll), sum(n)),
                context_len=cfg.context,
                tokens=sum(n),
                chunk=cfg.ppl_chunk,
                seq_nll=nll,  # per sequence (summed NLL, scored tokens); same sequences for every method
                seq_tokens=n,
            )
    for task, needles in (("passkey", 1), ("niah", cfg.niah_needles)):
        if task not in tasks:
            continue
        grid = build_cases(
            tokenizer,
            _lengths(cfg),
            _depths(cfg.needle_depths),
            cfg.needle_trials,
            needles,
            seed=cfg.seed + needles,
        )
        extra = passkey_at_context_cases(tokenizer, cfg) if task == "passkey" else []
        for name, m in methods.items():
            say(f"{task}: {name} ({len(grid) + len(extra)} prompts)")
            cells: dict[tuple[int, float], list[bool]] = {}
            for c, hit in zip(grid, run_cases(model, tokenizer, m, grid, cfg.batch_size), strict=True):
                cells.setdefault((c.context_len, c.depth), []).append(hit)
            for (n_tok, depth), ok in sorted(cells.items()):
                row(
                    name,
                    task,
                    "accuracy",
                    sum(ok) / len(ok),
                    context_len=n_tok,
                    depth=depth,
                    n=len(ok),
                    needles=needles,
                )
            if extra:
                ok = run_cases(model, tokenizer, m, extra, cfg.batch_size)
                row(
                    name,
                    task,
                    "accuracy_at_context",
                    sum(ok) / len(ok),
                    context_len=cfg.context,
                    n=len(ok),
                    needles=needles,
                    hits=[int(x) for x in ok],  # per prompt, same prompts for every method
                )
    if "chat-retrieval" in tasks:
        lines = filler_lines() if not data else _user_lines(data, tokenizer)
        cases = build_retrieval_cases(
            tokenizer, cfg.context, cfg.retrieval_prompts, cfg.retrieval_keys, lines, seed=cfg.seed + 11
        )
        for name, m in methods.items():
            say(f"chat-retrieval: {name} ({len(cases)} prompts)")
            ok = run_retrieval(model, tokenizer, m, cases, cfg.batch_size)
            row(name, "chat-retrieval", "accuracy_at_context", sum(ok) / len(ok), context_len=cfg.context,
                n=len(ok), needles=cfg.retrieval_keys, hits=[int(x) for x in ok])  # fmt: skip
    if "chat-agreement" in tasks:
        g = cfg.agreement_tokens
        cases = build_agreement_cases(tokenizer, cfg.context - g, cfg.agreement_prompts, data, cfg.seed + 13)
        ref = methods.get("bf16") or get_method("bf16", None, mcfg)
        for name, r in run_agreement(model, tokenizer, methods, ref, cases, g, cfg.batch_size, say).items():
            common = {"context_len": cfg.context, "n": len(cases), "new_tokens": g}
            if "exact" in r:
                row(name, "chat-agreement", "exact_match", r["exact_rate"], **common, exact=r["exact"],
                    prefix=r["prefix"])  # fmt: skip
            row(name, "chat-agreement", "loop_rate", r["loop_rate"], **common,
                instruction=[c.instruction for c in cases],
                **{k: r[k] for k in ("loops", "repeat", "distinct4", "lengths", "texts")})  # fmt: skip
    if "attn-error" in tasks:
        say("attn-error")
        seqs = text_sequences(tokenizer, data, cfg.attn_sequences, min(cfg.context, 2048), cfg.seed + 1)
        am = attention_metrics(model, methods, seqs)
        hs = hidden_state_errors(model, {k: v for k, v in methods.items() if k != "bf16"}, seqs)
        for name in methods:
            for layer, vals in am[name].items():
                for metric, v in vals.items():
                    row(name, "attn-error", metric, v, layer=layer, context_len=seqs.shape[1])
            for layer, v in hs.get(name, {}).items():
                row(name, "attn-error", "hidden_err", v, layer=layer, context_len=seqs.shape[1])
    return rows


def _user_lines(data: Sequence[str | Path], tokenizer: Any, limit: int = 20000) -> list[str]:
    """Up to ``limit`` non-empty lines of the user's documents, in their seeded order."""
    out: list[str] = []
    for doc in iter_documents(data, tokenizer):
        out += [ln.rstrip() for ln in doc.splitlines() if ln.strip()]
        if len(out) >= limit:
            break
    return out[:limit]


def passkey_at_context_cases(tokenizer: Any, cfg: EvalConfig) -> list[Any]:
    """``passkey_at_context`` single-needle prompts at the full context, depths uniform in
    [0.05, 0.95] (past the sink; with the default windows at 3K, ~96% of them in the INT2 tier)."""
    cfg = cfg.effective()  # context as an int (None = the default)
    rng = random.Random(cfg.seed + 7)
    cases = []
    for _ in range(cfg.passkey_at_context):
        depth = round(rng.uniform(0.05, 0.95), 3)
        cases += build_cases(tokenizer, [cfg.context], [depth], 1, 1, seed=rng.randrange(1 << 30))
    return cases
