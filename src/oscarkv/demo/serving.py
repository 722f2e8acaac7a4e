"""The demo's serving half: the engine in INT2 and in BF16 at one KV budget, on the same prompts.

Each side takes the request slots its budget holds for requests of ``max_model_len`` tokens
(``EngineConfig.max_running`` unset), so "requests held at once" is the engine's own choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Side", "serve_side"]


@dataclass(frozen=True)
class Side:
    """One engine's result: slots, its pools' plan, outputs and speed."""

    kv_dtype: str
    held: int
    plan: Any  # store.PoolPlan: request_bytes(length) is one request's KV bytes
    tokens: list[list[int]]
    seconds: float

    @property
    def tok_s(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


def serve_side(
    model: str, kv_dtype: str, rotations: str | None, budget_gb: float, max_model_len: int,
    prompts: list[list[int]], gen_tokens: int,
) -> Side:  # fmt: skip
    """Run ``prompts`` (greedy, ``gen_tokens`` each) on one engine; its slots and timings."""
    from ..engine import SamplingParams
    from ..engine.llm import LLM

    llm = LLM(model, rotations=rotations, kv_dtype=kv_dtype, device="cpu", dtype="bf16",
              kv_budget_gb=budget_gb, max_model_len=max_model_len)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        return Side(
            kv_dtype,
            llm.engine.cfg.max_running,
            llm.engine.runner.plan,
            [list(o.token_ids) for o in outs],
            seconds,
        )
    finally:
        llm.shutdown()
