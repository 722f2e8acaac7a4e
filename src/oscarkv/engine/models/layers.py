"""Building blocks of the engine's decoder (RMSNorm, RoPE, SiluAndMul, fused linears), config checks.

Every block reproduces the arithmetic of the transformers modules it replaces (same op order and
dtypes), so fp32 logits agree with HF to float rounding and bf16 ones to a bf16 step or so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...errors import ModelError
from ...kernels.ref import norm as ref_norm
from ...kernels.ref.rope import apply_rotary

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "UNSUPPORTED_ROPE",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "apply_rotary",
    "check_config",
    "head_dim_of",
    "model_error",
    "rope_inv_freq",
    "rope_parameters",
    "text_config",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_SUPPORTED = "llama, mistral (no sliding window), qwen2, qwen3"
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


class MergedLinear(nn.Linear):
    """Several projections of one input side by side (``q|k|v``, ``gate|up``): ``out = sum(sizes)``.

    ``shard(t, i)`` is the row block of projection ``i`` in the weight or bias ``t`` (a view), which
    is where the loader copies that projection's checkpoint tensor.
    """

    def __init__(
        self, in_features: int, sizes: Sequence[int], bias: bool, *, dtype: torch.dtype, device: Any
    ):
        super().__init__(in_features, sum(sizes), bias=bias, dtype=dtype, device=device)
        self.sizes = tuple(int(s) for s in sizes)

    def shard(self, t: torch.Tensor, i: int) -> torch.Tensor:
        return t.narrow(0, sum(self.sizes[:i]), self.sizes[i])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[T, sum(sizes)]`` -> one ``[T, size]`` view per projection."""
        return y.split(self.sizes, dim=-1)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The HF config's RoPE dict (``rope_parameters``, transformers 5; else ``rope_theta``/``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq fp32 [head_dim/2] on CPU, attention_scaling)`` exactly as HF's rotary module.

    The default type is computed here; other types go through
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``. Raises ``ModelError`` for
    length-dependent types, partial rotary factors and unknown types.
    """
    params = rope_parameters(config)
    kind = params["rope_type"]
    if head_dim % 2:
        raise ModelError(f"head_dim {head_dim} is odd; rotary embeddings need an even head_dim")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelError(
            f"partial rotary embeddings (factor {params['partial_rotary_factor']}) are not supported"
        )
    if kind == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind in UNSUPPORTED_ROPE or kind not in ROPE_INIT_FUNCTIONS:
        ok = ["default", *sorted(k for k in ROPE_INIT_FUNCTIONS if k not in UNSUPPORTED_ROPE)]
        raise ModelError(
            f"RoPE type {kind!r} is not supported by the engine; supported: {', '.join(ok)}",
            "length-dependent RoPE (dynamic, longrope) has no single sequence length in a token-flat batch",
        )
    inv, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    if inv.numel() * 2 != head_dim:
        raise ModelError(f"RoPE type {kind!r} gives {inv.numel()} frequencies for head_dim {head_dim}")
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


# ---- config checks -----------------------------------------------------------------------------
def model_error(where: str, msg: str, hint: str = "") -> ModelError:
    """``ModelError("{where}: {msg}", hint)``."""
    return ModelError(f"{where}: {msg}", hint)


def check_config(config: Any, where: str = "model") -> None:
    """Raise :class:`ModelError` (one line) unless the text config is a family the decoder covers."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        msg = f"model_type {mt!r} is not supported by the engine; supported: {_SUPPORTED}"
        raise model_error(where, msg, "run other architectures through oscarkv.hf.OscarCache (transformers)")
    window = getattr(config, "sliding_window", None)
    sliding_layers = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if sliding_layers or (mt == "mistral" and window is not None):
        msg = f"{mt} with sliding-window attention (sliding_window={window}) is not supported"
        raise model_error(where, f"{msg}; the engine serves full attention only ({_SUPPORTED})")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise model_error(where, f"hidden_act {act!r} is not supported; the engine's MLP is SiLU-gated")
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    if hq % hkv:
        raise model_error(where, f"{hq} attention heads are not a multiple of {hkv} KV heads")
    try:
        rope_inv_freq(config, head_dim_of(config))
    except ModelError as e:
        raise model_error(where, str(e), e.hint) from None


def head_dim_of(config: Any) -> int:
    """``config.head_dim``, else ``hidden_size // num_attention_heads``."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def text_config(config: Any) -> Any:
    """The text part of an HF config (the config itself for plain causal LMs)."""
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config
