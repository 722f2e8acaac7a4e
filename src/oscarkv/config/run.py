"""`EvalConfig` and `GenerateConfig`: what `oscarkv eval` runs and how `oscarkv generate` decodes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .base import SpecError, check_positions, field_error, flag_name, help_field, is_int, is_num, short_repr

__all__ = [
    "ALL_EVAL_METHODS",
    "DEFAULT_CONTEXT",
    "EVAL_TASKS",
    "OPTIONAL_EVAL_METHODS",
    "QUICK_CONTEXT",
    "EvalConfig",
    "GenerateConfig",
]

ALL_EVAL_METHODS = "bf16,oscar,naive-int2,quarot-int2,clip-only,hadamard-int2,kivi2,turboquant-k3v3,int4"
#: methods run only when named: oscar-fp8w is oscar with the sink and recent window in fp8 e4m3
OPTIONAL_EVAL_METHODS = "oscar-fp8w"
EVAL_TASKS = ("ppl", "passkey", "niah", "attn-error", "chat-retrieval", "chat-agreement")
#: the tasks run when --tasks is not given (the chat tasks need a chat template)
DEFAULT_EVAL_TASKS = ("ppl", "passkey", "niah", "attn-error")
#: ``EvalConfig.context`` when unset, without and with ``quick``
DEFAULT_CONTEXT = 3072
QUICK_CONTEXT = 1024
QUICK_PPL_CONTINUATION = 128


@dataclass(frozen=True)
class EvalConfig:
    """What `oscarkv eval` runs (``quick`` shrinks every budget for CI)."""

    methods: str = help_field(
        f"comma-separated methods: {ALL_EVAL_METHODS} (the default), or {OPTIONAL_EVAL_METHODS}",
        default=ALL_EVAL_METHODS,
    )
    tasks: str = help_field(
        "comma-separated tasks: " + ", ".join(EVAL_TASKS), default=",".join(DEFAULT_EVAL_TASKS)
    )
    context: int | None = help_field(
        "longest context in tokens (ppl sequence length, largest needle prompt); "
        f"unset: {DEFAULT_CONTEXT}, or {QUICK_CONTEXT} with --quick",
        default=None,
    )
    quick: bool = help_field(
        f"tiny budgets (CI smoke run; at most {QUICK_CONTEXT} tokens of context)", default=False
    )
    ppl_sequences: int = help_field("perplexity sequences", default=8)
    ppl_continuation: int = help_field("scored continuation tokens per sequence", default=512)
    ppl_chunk: int = help_field("continuation tokens per forward", default=32)
    needle_trials: int = help_field("prompts per (context length, depth) cell", default=4)
    needle_depths: int = help_field("needle depths spread over [0.05, 0.95]", default=5)
    needle_lengths: int = help_field("context lengths from context/N up to context", default=3)
    passkey_at_context: int = help_field(
        "extra passkey prompts at the full context (accuracy n; 0 = none)", default=100
    )
    niah_needles: int = help_field("needles per prompt in the niah task", default=4)
    retrieval_prompts: int = help_field(
        "chat-retrieval prompts at the full context (accuracy n)", default=100
    )
    retrieval_keys: int = help_field("key/value needles per chat-retrieval prompt", default=4)
    agreement_prompts: int = help_field(
        "chat-agreement prompts (excerpts of the text with an instruction; the rates' n)", default=120
    )
    agreement_tokens: int = help_field(
        "greedy tokens generated per chat-agreement prompt (prompts are context minus this)", default=128
    )
    batch_size: int = help_field(
        "ppl sequences / needle prompts run together (equal lengths, no padding)", default=16
    )
    attn_sequences: int = help_field("sequences for the per-layer error metrics", default=4)
    seed: int = help_field("seed for data sampling and needle prompts", default=0)

    def __post_init__(self) -> None:
        name = type(self).__name__
        known = [*ALL_EVAL_METHODS.split(","), *OPTIONAL_EVAL_METHODS.split(",")]
        if not isinstance(self.methods, str):
            raise field_error(name, "methods", "a comma-separated string of methods", self.methods, True)
        names = self.methods.split(",")
        if not all(names):
            raise SpecError(
                f"{name}.methods must be comma-separated method names (none empty); "
                f"got {short_repr(self.methods)}",
                f"known methods: {ALL_EVAL_METHODS},{OPTIONAL_EVAL_METHODS}",
            )
        for m in names:
            if m not in known:
                raise SpecError(
                    f"{name}.methods: unknown method {short_repr(m)}; known: {', '.join(known)}",
                    "e.g. --methods bf16,oscar",
                )
            if names.count(m) > 1:
                raise SpecError(f"{name}.methods lists {m!r} twice; got {short_repr(self.methods)}")
        if not isinstance(self.tasks, str):
            raise field_error(name, "tasks", "a comma-separated string of tasks", self.tasks, True)
        tasks = [t for t in self.tasks.split(",") if t]
        bad = [t for t in tasks if t not in EVAL_TASKS]
        if len(set(tasks)) != len(tasks):
            raise field_error(name, "tasks", "each task at most once", self.tasks, True)
        if bad or not tasks:
            raise field_error(
                name, "tasks", "a comma-separated subset of " + ",".join(EVAL_TASKS), self.tasks, True
            )
        if not isinstance(self.quick, bool):
            raise field_error(name, "quick", "True or False", self.quick, True)
        if self.context is not None and (not is_int(self.context) or self.context < 1):
            raise field_error(
                name, "context", "a positive integer (or None for the default)", self.context, True
            )
        for f in ("ppl_sequences", "ppl_continuation", "ppl_chunk", "needle_trials", "needle_depths",
                  "needle_lengths", "niah_needles", "batch_size", "attn_sequences", "retrieval_prompts",
                  "retrieval_keys", "agreement_prompts", "agreement_tokens"):  # fmt: skip
            v = getattr(self, f)
            if not is_int(v) or v < 1:
                raise field_error(name, f, "a positive integer", v, True)
        pk = self.passkey_at_context
        if not is_int(pk) or pk < 0:
            raise field_error(name, "passkey_at_context", "an integer >= 0 (0 = none)", pk, True)
        if not is_int(self.seed):
            raise field_error(name, "seed", "an integer", self.seed, True)
        if self.quick and self.context is not None and self.context > QUICK_CONTEXT:
            raise SpecError(
                f"--quick runs at most {QUICK_CONTEXT} tokens of context, got --context {self.context}; "
                "drop --context or --quick"
            )
        ctx = self._context()
        cont = QUICK_PPL_CONTINUATION if self.quick else self.ppl_continuation
        if ctx <= cont + 64:
            raise field_error(
                name, "context", f"> ppl_continuation + 64 = {cont + 64}", ctx,
                "raise --context or lower --ppl-continuation",
            )  # fmt: skip
        if "chat-agreement" in tasks and self.agreement_tokens * 2 > ctx:
            raise field_error(
                name, "agreement_tokens", f"at most half the context ({ctx // 2})", self.agreement_tokens,
                "raise --context or lower --agreement-tokens",
            )  # fmt: skip

    def _context(self) -> int:
        if self.context is not None:
            return self.context
        return QUICK_CONTEXT if self.quick else DEFAULT_CONTEXT

    @property
    def method_list(self) -> list[str]:
        return [m for m in self.methods.split(",") if m]

    @property
    def task_list(self) -> list[str]:
        return [t for t in self.tasks.split(",") if t]

    def effective(self) -> EvalConfig:
        """The budgets actually used: ``context`` resolved to an int, ``quick`` applied (and off)."""
        if not self.quick:
            return self if self.context is not None else dataclasses.replace(self, context=self._context())
        return dataclasses.replace(
            self, context=self._context(), ppl_sequences=1, ppl_continuation=QUICK_PPL_CONTINUATION,
            ppl_chunk=64, needle_trials=1, needle_depths=2, needle_lengths=1,
            passkey_at_context=min(self.passkey_at_context, 1), niah_needles=2, retrieval_prompts=2, attn_sequences=1, quick=False,
            agreement_prompts=2, agreement_tokens=min(self.agreement_tokens, 32),
        )  # fmt: skip

    def check_model_positions(self, max_positions: int | None) -> None:
        """Raise :class:`SpecError` if the effective context exceeds the model's
        ``max_position_embeddings`` (``None``: unknown, no check)."""
        check_positions("--context", self._context(), max_positions)


MAX_NEW_TOKENS = 1 << 20
#: sampling defaults of :meth:`GenerateConfig.sampling_kwargs` (top-k off)
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95


@dataclass(frozen=True)
class GenerateConfig:
    """How `oscarkv generate` decodes: greedy by default, or sampled with ``sample``."""

    max_new_tokens: int = help_field(f"tokens to generate (1 to {MAX_NEW_TOKENS})", default=128)
    sample: bool = help_field("sample instead of greedy decoding", default=False)
    temperature: float | None = help_field(
        f"sampling temperature > 0 (needs --sample; unset: {DEFAULT_TEMPERATURE})", default=None
    )
    top_p: float | None = help_field(
        f"nucleus sampling mass in (0, 1] (needs --sample; unset: {DEFAULT_TOP_P})", default=None
    )
    top_k: int | None = help_field(
        "sample among the k likeliest tokens (needs --sample; unset: off)", default=None
    )

    def __post_init__(self) -> None:
        name = type(self).__name__
        n = self.max_new_tokens
        if not is_int(n) or not 1 <= n <= MAX_NEW_TOKENS:
            raise field_error(name, "max_new_tokens", f"an integer in [1, {MAX_NEW_TOKENS}]", n, True)
        if not isinstance(self.sample, bool):
            raise field_error(name, "sample", "True or False", self.sample, True)
        t = self.temperature
        if t is not None and (not is_num(t) or not math.isfinite(t) or t <= 0):
            raise field_error(
                name, "temperature",
                "a finite number > 0 (use greedy decoding (no --sample) for temperature 0)", t, True,
            )  # fmt: skip
        p = self.top_p
        if p is not None and (not is_num(p) or not math.isfinite(p) or not 0 < p <= 1):
            raise field_error(name, "top_p", "a number in (0, 1]", p, True)
        k = self.top_k
        if k is not None and (not is_int(k) or k < 1):
            raise field_error(name, "top_k", "an integer >= 1", k, True)
        if not self.sample:
            for f in ("temperature", "top_p", "top_k"):
                if getattr(self, f) is not None:
                    raise SpecError(
                        f"{flag_name(f)} only applies with --sample; add --sample",
                        f"or drop {flag_name(f)} for greedy decoding",
                    )

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for transformers' ``generate`` (``max_new_tokens`` not included):
        ``{"do_sample": False}``, or sampling with temperature (default 0.7), top-p (default
        0.95) and top-k (default 0 = off, so the model's generation config does not add one)."""
        if not self.sample:
            return {"do_sample": False}
        return {
            "do_sample": True,
            "temperature": float(self.temperature if self.temperature is not None else DEFAULT_TEMPERATURE),
            "top_p": float(self.top_p if self.top_p is not None else DEFAULT_TOP_P),
            "top_k": self.top_k if self.top_k is not None else 0,
        }
