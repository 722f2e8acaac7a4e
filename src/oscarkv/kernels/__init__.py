"""Kernel ops behind one backend choice, resolved once (no branching on the hot path).

``Backend.TORCH`` is the readable reference in ``kernels/ref`` (any device); ``Backend.TRITON``
the fused GPU kernels in ``kernels/triton`` (same signatures); ``Backend.AUTO`` picks Triton on a
CUDA device when it can run, else the reference. Asking explicitly for a backend that cannot
run raises :class:`BackendError` with the reason.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import OscarkvError
from .ref import moe as _ref_moe
from .ref import norm as _ref_norm
from .ref import rope as _ref_rope
from .ref import rotate as _ref_rotate
from .ref import router as _ref_router
from .ref.quantize_pack import quantize_pack_into as _ref_quantize_into

__all__ = ["Backend", "BackendError", "KernelOps", "resolve", "triton_unavailable_reason"]


class Backend(str, enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


class BackendError(OscarkvError, RuntimeError):
    """The requested kernel backend cannot run here; the message says why."""


@dataclass(frozen=True)
class KernelOps:
    """The resolved ops (see ``kernels/ref`` for signatures and shapes); the decoder's norm, RoPE
    and activation ops default to the torch twins."""

    backend: Backend
    quantize_pack: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    dequantize: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    prefill_attention_varlen: Callable[..., torch.Tensor]
    rotate_heads: Callable[..., torch.Tensor]
    rotate_new_rows: Callable[..., torch.Tensor]
    rms_norm: Callable[..., Any] = _ref_norm.rms_norm
    silu_and_mul: Callable[..., torch.Tensor] = _ref_norm.silu_and_mul
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _ref_rope.qk_norm_rope
    #: a prefill's rotations of ``[T, H, d]`` rows (``kernels.ref.rotate.rotate_rows``)
    rotate_rows: Callable[..., torch.Tensor] = _ref_rotate.rotate_rows
    #: ``(k_fmt, v_fmt) -> None``; raises ``ValueError`` naming what these kernels cannot store or read
    check_formats: Callable[[Any, Any], None] = lambda k_fmt, v_fmt: None
    #: ``(window_dtype, device) -> None``; raises ``ValueError`` if these kernels cannot read windows
    #: stored in ``window_dtype`` (``QuantSpec.window_dtype``) on ``device``
    check_windows: Callable[[str, torch.device], None] = lambda window_dtype, device: None
    #: quantize pool rows into INT2 pool slots in place (a demotion's gather, quantize and scatter)
    quantize_pack_into: Callable[..., None] = _ref_quantize_into
    #: a few tokens through their chosen experts (``kernels.ref.moe``), used by MoE layers for
    #: steps of at most ``moe_small_tokens`` tokens (0: never; the CPU runs the reference loop)
    moe_experts: Callable[..., torch.Tensor] = _ref_moe.moe_experts
    moe_small_tokens: int = 0
    #: a MoE router (``kernels.ref.router.route_topk``), used for the same few-token steps
    route_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _ref_router.route_topk
    #: FP8 block-scaled weights kept as FP8 (``kernels.ref.fp8`` contracts): dense projections and
    #: routed experts; ``None`` where the backend has no such kernels (the weights are then
    #: dequantized at load, or run by cuBLAS's block-scaled GEMM where it can)
    fp8_linear: Callable[..., torch.Tensor] | None = None
    fp8_moe_experts: Callable[..., torch.Tensor] | None = None

    def require_formats(self, formats: Sequence[tuple[Any, Any]], fix: str) -> None:
        """Fail at start-up, not at the first quantize: raises :class:`BackendError` naming the first
        layer whose ``(k_fmt, v_fmt)`` these kernels cannot handle, and ``fix``."""
        for i, (kf, vf) in enumerate(formats):
            try:
                self.check_formats(kf, vf)
            except ValueError as e:
                raise BackendError(f"layer {i}: {e}; {fix}") from None

    def require_windows(self, window_dtype: str, device: torch.device | str, fix: str) -> None:
        """Fail at start-up, not at the first decode: raises :class:`BackendError` if these kernels
        cannot read windows stored in ``window_dtype`` on ``device``, with ``fix``."""
        try:
            self.check_windows(window_dtype, torch.device(device))
        except ValueError as e:
            raise BackendError(f"{e}; {fix}") from None


def triton_unavailable_reason(device: torch.device) -> str | None:
    """``None`` if the Triton kernels can run on ``device``, else why not."""
    if device.type != "cuda":
        return f"Triton kernels need a CUDA device; got {device}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install 'oscarkv[triton]')"
    try:
        from .triton import ops  # noqa: F401
    except ImportError as e:
        return f"the Triton kernels failed to import: {e}"
    return None


def _torch_ops() -> KernelOps:
    from . import ref

    return KernelOps(
        Backend.TORCH,
        ref.quantize_pack,
        ref.dequantize,
        ref.decode_attention,
        ref.prefill_attention,
        ref.prefill_attention_varlen,
        ref.rotate_heads,
        ref.rotate_new_rows,
        ref.rms_norm,
        ref.silu_and_mul,
        ref.qk_norm_rope,
    )


def resolve(backend: Backend | str, device: torch.device | str) -> KernelOps:
    """Pick the ops for ``device`` once; raises :class:`BackendError` for an impossible request."""
    try:
        backend = Backend(backend)
    except ValueError as e:
        raise BackendError(f"backend must be one of auto, torch, triton; got {backend!r}") from e
    device = torch.device(device)
    if backend is Backend.TORCH:
        return _torch_ops()
    reason = triton_unavailable_reason(device)
    if reason is None:
        from .triton import ops

        return ops.KERNEL_OPS
    if backend is Backend.TRITON:
        raise BackendError(f"backend 'triton' cannot run: {reason}")
    return _torch_ops()
