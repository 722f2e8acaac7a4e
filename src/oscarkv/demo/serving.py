"""The demo's serving half: the engine in INT2 and in BF16 at one KV budget, on the same prompts.

Each side takes the request slots its budget holds for requests of ``max_model_len`` tokens
(``EngineConfig.max_running`` unset), so "requests held at once" is the engine's own choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Side", "request_bytes", "serve_side"]


@dataclass(frozen=True)
class Side:
    """One engine's result: slots, bytes of one full-length request, outputs and speed."""

    kv_dtype: str
    held: int
    request_bytes: int
    tokens: list[list[int]]
    seconds: float

    @property
    def tok_s(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


def request_bytes(plan: Any, spec: Any, length: int) -> int:
    """KV bytes one request of ``length`` tokens takes in ``plan``'s pools (the engine's own
    accounting: an INT2 slot's sinks and ring, and INT2 pages for every token past its sink; or
    16-bit pages for all of them)."""
    ps = plan.page_tokens
    hp_tok = plan.hp_page_bytes // ps
    if not plan.int2:
        return -(-length // ps) * plan.hp_page_bytes
    slot = plan.sink_pages * 2 * plan.hp_page_bytes + plan.ring_cap * hp_tok
    return slot + -(-max(length - spec.sink_tokens, 0) // ps) * plan.q_page_bytes


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
        runner = llm.engine.runner
        size = request_bytes(runner.plan, runner.spec, max_model_len)
        params = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        return Side(kv_dtype, llm.engine.cfg.max_running, size, [list(o.token_ids) for o in outs], seconds)
    finally:
        llm.shutdown()
