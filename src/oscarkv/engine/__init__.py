"""The serving engine (docs/engine.md): paged INT2 + 16-bit KV pools, a prefix cache,
continuous batching with chunked prefill, and its own lean decoder.

``LLM`` (offline generation) and ``Engine`` (add / abort / step, for the server) load lazily:
``import oscarkv.engine`` alone does not import transformers.
"""

from __future__ import annotations

from typing import Any

from .request import FinishReason, RequestOutput, SamplingParams

__all__ = ["LLM", "Engine", "FinishReason", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module 'oscarkv.engine' has no attribute {name!r}")
