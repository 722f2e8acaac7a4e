"""`LLM`: offline batch generation over the :class:`~oscarkv.engine.engine.Engine` (vLLM's shape)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

from ..config import EngineConfig
from .engine import Engine
from .request import RequestOutput, SamplingParams

__all__ = ["LLM"]


class LLM:
    """``LLM(model_dir, rotations=DIR, kv_dtype="int2", **EngineConfig fields)``, e.g.
    ``tensor_parallel=2`` (then ``shutdown()`` it, or use ``with LLM(...) as llm:``).

    ``generate(prompts, params)`` returns one :class:`RequestOutput` per prompt, in order;
    prompts are strings or token-id lists. ``chat(conversations, params)`` renders each message
    list with the tokenizer's chat template first.
    """

    def __init__(self, model: str, rotations: str | None = None, kv_dtype: str = "int2", **kw: Any):
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kw) - names)
        if unknown:
            from ..errors import InputError

            raise InputError(f"LLM: unknown option(s) {unknown}; known: {sorted(names - {'model'})}")
        self.config = EngineConfig(model=model, rotations=rotations, kv_dtype=kv_dtype, **kw)
        self.engine = Engine(self.config)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> LLM:
        """An ``LLM`` over an existing :class:`EngineConfig`."""
        llm = cls.__new__(cls)
        llm.config, llm.engine = cfg, Engine(cfg)
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        plist = (
            list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        )
        if len(plist) != len(prompts):
            from ..errors import InputError

            raise InputError(f"LLM.generate: {len(plist)} SamplingParams for {len(prompts)} prompts")
        rids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.rid] = out
        return [done[r] for r in rids]

    def chat(
        self,
        conversations: list[dict] | Seq[list[dict]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """``generate`` on chat conversations (each a list of ``{"role", "content"}`` messages)."""
        from .tokenizer import apply_chat

        convs = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        ids = [apply_chat(self.tokenizer, list(c), chat_template) for c in convs]  # type: ignore[arg-type]
        return self.generate(ids, params)

    def memory_report(self) -> dict[str, Any]:
        return self.engine.memory_report()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (a no-op with one rank)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
