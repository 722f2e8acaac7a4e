"""Building blocks of the engine's decoder (RMSNorm, RoPE, SiluAndMul) and config helpers.

Every block reproduces the arithmetic of the transformers modules it replaces (same op order and
dtypes), so fp32 logits agree with HF to float rounding and bf16 ones to a bf16 step or so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import ModelError
from ...kernels.ref import norm as ref_norm
from ...kernels.ref.rope import apply_rotary

__all__ = [
    "UNSUPPORTED_ROPE",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "apply_rotary",
    "head_dim_of",
    "model_error",
    "rope_inv_freq",
    "rope_parameters",
    "rotary_dim_of",
    "text_config",
]

#: RoPE types whose frequencies depend on the current sequence length (HF ``dynamic_rope_update``);
#: a token-flat batch of unrelated sequences has no single length, so these are refused
UNSUPPORTED_ROPE = ("dynamic", "longrope")


class RMSNorm(nn.Module):
    """``weight · x / rms(x)`` over the last dim; statistics in fp32, output in ``x``'s dtype (HF).

    ``op`` is the backend's ``rms_norm`` (``kernels.ref.rms_norm``'s contract); ``forward(x,
    residual)`` adds the residual first and returns ``(normed, x + residual)``.
    """

    def __init__(
        self,
        dim: int,
        eps: float,
        *,
        op: Callable[..., Any] = ref_norm.rms_norm,
        dtype: torch.dtype | None = None,
        device: Any = None,
    ):
        super().__init__()
        self.eps = eps
        self.op = op
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.op(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    """``[T, 2I] -> [T, I]``: ``silu(gate) · up`` for the fused ``gate|up`` projection (``op``: the
    backend's ``silu_and_mul``)."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor] = ref_norm.silu_and_mul):
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The HF config's RoPE dict (``rope_parameters``, transformers 5; else ``rope_theta``/``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rotary_dim_of(config: Any, head_dim: int) -> int:
    """The rotary dims ``r``: ``int(head_dim · partial_rotary_factor)`` (HF), even and ``<= head_dim``."""
    factor = float(rope_parameters(config).get("partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)
    if not 2 <= dim <= head_dim or dim % 2:
        raise ModelError(f"partial_rotary_factor {factor} gives {dim} rotary dims of head_dim {head_dim}")
    return dim


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq fp32 [r/2] on CPU, attention_scaling)`` exactly as HF's rotary module, for the
    ``r`` rotary dims (:func:`rotary_dim_of`: all of ``head_dim`` unless the config sets a
    ``partial_rotary_factor``).

    The default type is computed here; other types go through
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``. Raises ``ModelError`` for
    length-dependent and unknown types.
    """
    params = rope_parameters(config)
    kind = params["rope_type"]
    if head_dim % 2:
        raise ModelError(f"head_dim {head_dim} is odd; rotary embeddings need an even head_dim")
    dim = rotary_dim_of(config, head_dim)
    if kind == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind in UNSUPPORTED_ROPE or kind not in ROPE_INIT_FUNCTIONS:
        ok = ["default", *sorted(k for k in ROPE_INIT_FUNCTIONS if k not in UNSUPPORTED_ROPE)]
        raise ModelError(
            f"RoPE type {kind!r} is not supported by the engine; supported: {', '.join(ok)}",
            "length-dependent RoPE (dynamic, longrope) has no single sequence length in a token-flat batch",
        )
    inv, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    if inv.numel() * 2 != dim:
        raise ModelError(f"RoPE type {kind!r} gives {inv.numel()} frequencies for {dim} rotary dims")
    return inv.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """A cos/sin cache for positions ``[0, max_positions)``, built like HF's rotary module.

    ``freqs = pos · inv_freq`` and ``cos/sin(freqs) · attention_scaling`` in fp32 on ``device``,
    then rounded once to ``dtype`` (HF rounds to the activations' dtype per call). The buffer
    ``cos_sin [P, d]`` holds cos in its first half and sin in its second.
    """

    def __init__(self, config: Any, head_dim: int, max_positions: int, *, dtype: torch.dtype, device: Any):
        super().__init__()
        inv_freq, scale = rope_inv_freq(config, head_dim)
        self.attention_scaling = scale
        inv_freq = inv_freq.to(device)
        pos = torch.arange(max_positions, dtype=torch.int64, device=device).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, d/2]
        cos_sin = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
        self.register_buffer("cos_sin", cos_sin.to(dtype), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos_sin.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64 ``[T]`` (each ``< max_positions``) -> ``(cos, sin)`` ``[T, d/2]``."""
        return self.cos_sin[positions].chunk(2, dim=-1)


# ---- config helpers ----------------------------------------------------------------------------
def model_error(where: str, msg: str, hint: str = "") -> ModelError:
    """``ModelError("{where}: {msg}", hint)``."""
    return ModelError(f"{where}: {msg}", hint)


def head_dim_of(config: Any) -> int:
    """``config.head_dim``, else ``hidden_size // num_attention_heads``."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def text_config(config: Any) -> Any:
    """The text part of an HF config (the config itself for plain causal LMs)."""
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config
