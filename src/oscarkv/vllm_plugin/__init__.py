"""oscarkv as a vLLM plug-in (no fork): our INT2 KV cache (or 16-bit passthrough) inside vLLM.

vLLM loads :func:`register` in every process through the ``vllm.general_plugins`` entry point
(``pyproject.toml``). It points vLLM's CPU attention backend at ours
(:mod:`oscarkv.vllm_plugin.backend`). Nothing changes until a run opts in with
``additional_config={"oscarkv": {...}}`` (``--additional-config`` on ``vllm serve``); without
it every layer runs vLLM's own CPU attention unchanged. Design, what is tested and the limits:
``docs/vllm.md``.

This package imports vLLM lazily: ``import oscarkv`` never imports it.
"""

from __future__ import annotations

__all__ = ["BACKEND_PATH", "register"]

BACKEND_PATH = "oscarkv.vllm_plugin.backend.OscarCPUAttentionBackend"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: override the ``CPU_ATTN`` backend path.

    vLLM's CPU platform returns ``AttentionBackendEnum.CPU_ATTN.get_path()`` for every decoder
    layer and ignores ``--attention-backend`` (``vllm/platforms/cpu.py:177-179``); ``get_path``
    honours ``register_backend`` overrides (``vllm/v1/attention/backends/registry.py:202``).
    Safe to call more than once (vLLM may load plugins repeatedly per process).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
