"""oscarkv as a vLLM plug-in (no fork): our INT2 KV cache (or 16-bit passthrough) inside vLLM.

vLLM loads :func:`register` in every process through the ``vllm.general_plugins`` entry point
(``pyproject.toml``). It points vLLM's CPU attention backend at ours
(:mod:`oscarkv.vllm_plugin.backend`), its ``CUSTOM`` backend slot at our CUDA backend
(:mod:`oscarkv.vllm_plugin.cuda_backend`, selected with ``--attention-backend CUSTOM``; never
run) and adds the load format ``oscarkv`` (:mod:`oscarkv.vllm_plugin.loader`, R_V absorption).
Nothing changes until a run opts in with ``additional_config={"oscarkv": {...}}``
(``--additional-config`` on the server); without it every layer runs vLLM's own CPU attention
unchanged. Design, what is tested and the limits: ``docs/vllm.md``.

This package imports vLLM lazily: ``import oscarkv`` never imports it.
"""

from __future__ import annotations

__all__ = ["BACKEND_PATH", "CUDA_BACKEND_PATH", "register"]

BACKEND_PATH = "oscarkv.vllm_plugin.backend.OscarCPUAttentionBackend"
CUDA_BACKEND_PATH = "oscarkv.vllm_plugin.cuda_backend.OscarCudaAttentionBackend"


def register() -> None:
    """The ``vllm.general_plugins`` entry point.

    * ``CPU_ATTN`` -> ours: vLLM's CPU platform returns ``CPU_ATTN.get_path()`` for every decoder
      layer and ignores ``--attention-backend`` (``vllm/platforms/cpu.py:177-179``); ``get_path``
      honours ``register_backend`` overrides (``vllm/v1/attention/backends/registry.py:202``);
    * ``CUSTOM`` -> our CUDA backend: vLLM's placeholder for third-party backends (line 158),
      used only when the user passes ``--attention-backend CUSTOM``;
    * the load format ``oscarkv`` (importing :mod:`.loader` registers it).

    Safe to call more than once (vLLM may load plugins repeatedly per process).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)
    from . import loader  # noqa: F401  (registers the load format)
