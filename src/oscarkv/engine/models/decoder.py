"""One token-flat decoder for Llama/Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

A batch is flat: ``input_ids [T]`` with ``positions [T]``, any number of ragged sequences side by
side. Everything but attention is per token; attention is the caller's :class:`AttentionFn`, which
knows which rows belong to which sequence and holds the KV cache. Norms and the MLP activation run
the resolved :class:`~oscarkv.kernels.KernelOps`; each residual add rides in the next norm's call
(``x, residual = norm(x, residual)``), as HF's ``h + x`` followed by ``norm(h)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ...kernels import Backend, KernelOps, resolve
from .layers import (
    SUPPORTED_MODEL_TYPES,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    check_config,
    head_dim_of,
    text_config,
)
from .parallel import Comm, RowParallelLinear, VocabParallelEmbedding

__all__ = ["SUPPORTED_MODEL_TYPES", "AttentionFn", "Decoder", "ModelShape", "check_config", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the engine plans with (from the HF text config and generation config)."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    max_positions: int
    rms_eps: float
    tie_embeddings: bool
    eos_token_ids: tuple[int, ...]


class AttentionFn(Protocol):
    """``attn(layer, q [T,Hq,d], k [T,Hkv,d], v [T,Hkv,d]) -> [T,Hq,d]``, all in the model dtype.

    ``q``/``k`` are after q/k-norm and RoPE; ``v`` is straight from ``v_proj`` (already ``v·R_V``
    when the loader absorbed ``R_V``). All three are contiguous. The scale is ``head_dim ** -0.5``.
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def _eos_ids(config: Any, generation_config: Any) -> tuple[int, ...]:
    """``generation_config.eos_token_id`` when set (what HF ``generate`` stops on), else the config's."""
    ids = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return tuple(dict.fromkeys(int(i) for i in ids))


def model_shape(config: Any, generation_config: Any = None, where: str = "model") -> ModelShape:
    """The checked :class:`ModelShape` of an HF config (its text config for composite models)."""
    c = text_config(config)
    check_config(c, where)
    hq = int(c.num_attention_heads)
    return ModelShape(
        model_type=c.model_type,
        num_layers=int(c.num_hidden_layers),
        num_heads=hq,
        num_kv_heads=int(getattr(c, "num_key_value_heads", None) or hq),
        head_dim=head_dim_of(c),
        hidden=int(c.hidden_size),
        vocab=int(c.vocab_size),
        max_positions=int(c.max_position_embeddings),
        rms_eps=float(c.rms_norm_eps),
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(c, generation_config),
    )


def arch_flags(config: Any, model_type: str) -> dict[str, bool]:
    """Which optional parts a family has: ``qkv_bias``, ``o_bias``, ``mlp_bias``, ``qk_norm``."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    return {
        "qkv_bias": model_type == "qwen2" or (model_type in ("llama", "qwen3") and attention_bias),
        "o_bias": model_type in ("llama", "qwen3") and attention_bias,
        "mlp_bias": model_type == "llama" and bool(getattr(config, "mlp_bias", False)),
        "qk_norm": model_type == "qwen3",
    }


class Attention(nn.Module):
    """Fused ``qkv_proj``, optional per-head q/k norms, RoPE, the caller's attention, ``o_proj``."""

    def __init__(
        self,
        layer: int,
        shape: ModelShape,
        flags: dict[str, bool],
        ops: KernelOps,
        *,
        dtype: torch.dtype,
        device: Any,
        comm: Comm | None = None,
    ):
        super().__init__()
        self.layer = layer
        tp = 1 if comm is None else comm.world  # this rank's heads: Hq/tp and Hkv/tp
        d, hq, hkv = shape.head_dim, shape.num_heads // tp, shape.num_kv_heads // tp
        self.hq, self.hkv, self.d = hq, hkv, d
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.qkv_proj = MergedLinear(shape.hidden, (hq * d, hkv * d, hkv * d), flags["qkv_bias"], **kw)
        self.o_proj: nn.Module = (
            nn.Linear(hq * d, shape.hidden, bias=flags["o_bias"], **kw)
            if comm is None
            else RowParallelLinear(hq * d, shape.hidden, flags["o_bias"], comm, **kw)
        )
        self.q_norm = RMSNorm(d, shape.rms_eps, op=ops.rms_norm, **kw) if flags["qk_norm"] else None
        self.k_norm = RMSNorm(d, shape.rms_eps, op=ops.rms_norm, **kw) if flags["qk_norm"] else None
        self.qk_norm_rope = ops.qk_norm_rope

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        qn, kn = self.q_norm, self.k_norm
        norms = (qn.weight, kn.weight, qn.eps) if qn is not None and kn is not None else (None, None, 0.0)
        q, k = self.qk_norm_rope(q, k, cos, sin, *norms)  # per-head norms (Qwen3) and RoPE, one op
        o = attn(self.layer, q, k, v.contiguous())
        return self.o_proj(o.reshape(t, self.hq * self.d))


class MLP(nn.Module):
    """``down(silu(gate(x)) · up(x))`` with ``gate|up`` fused."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        bias: bool,
        ops: KernelOps,
        *,
        dtype: torch.dtype,
        device: Any,
        comm: Comm | None = None,
    ):
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        if comm is not None:
            inter //= comm.world  # this rank's MLP columns
        self.gate_up_proj = MergedLinear(hidden, (inter, inter), bias, **kw)
        self.down_proj: nn.Module = (
            nn.Linear(inter, hidden, bias=bias, **kw)
            if comm is None
            else RowParallelLinear(inter, hidden, bias, comm, **kw)
        )
        self.act = SiluAndMul(ops.silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h))``; ``h += mlp(norm(h))``, each add fused into the norm after it."""

    def __init__(
        self,
        layer: int,
        shape: ModelShape,
        inter: int,
        flags: dict[str, bool],
        ops: KernelOps,
        comm: Comm | None = None,
        **kw: Any,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.rms_eps, op=ops.rms_norm, **kw)
        self.self_attn = Attention(layer, shape, flags, ops, **kw, comm=comm)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.rms_eps, op=ops.rms_norm, **kw)
        self.mlp = MLP(shape.hidden, inter, flags["mlp_bias"], ops, **kw, comm=comm)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` -> ``(mlp out, residual)``: the stream ``h`` is ``x + residual`` (just ``x``
        when ``residual`` is None, the first layer), added up in the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    """The causal LM. Parameter names are HF's minus ``model.``, with ``qkv_proj``/``gate_up_proj``.

    Built from a checked HF text config (:func:`check_config`) and its :class:`ModelShape`;
    parameters are created on ``device`` in ``dtype``. With tied embeddings there is no
    ``lm_head`` module and the logits use ``embed_tokens.weight``. ``ops`` supplies the norm and
    activation kernels (default: the torch twins). With ``comm`` (tensor parallelism) the module
    holds this rank's shards (:mod:`.parallel`) and every rank computes the same outputs.
    """

    def __init__(
        self,
        config: Any,
        shape: ModelShape,
        *,
        dtype: torch.dtype,
        device: Any,
        ops: KernelOps | None = None,
        comm: Comm | None = None,
    ):
        super().__init__()
        self.shape, self.comm = shape, comm
        ops = ops if ops is not None else resolve(Backend.TORCH, "cpu")
        flags = arch_flags(config, shape.model_type)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        inter = int(config.intermediate_size)
        self.layers = nn.ModuleList(
            DecoderLayer(i, shape, inter, flags, ops, **kw, comm=comm) for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden, shape.rms_eps, op=ops.rms_norm, **kw)
        self.embed_tokens: nn.Module
        self.lm_head: nn.Module | None
        if comm is None:
            self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden, **kw)
            self.lm_head = (
                None if shape.tie_embeddings else nn.Linear(shape.hidden, shape.vocab, bias=False, **kw)
            )
        else:
            self.embed_tokens = VocabParallelEmbedding(shape.vocab, shape.hidden, comm, **kw)
            self.lm_head = (
                None
                if shape.tie_embeddings
                else VocabParallelEmbedding(shape.vocab, shape.hidden, comm, **kw)
            )
        self.rotary = RotaryEmbedding(config, shape.head_dim, shape.max_positions, **kw)

    def _stream(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last layer's ``(x, residual)``: the pre-norm hidden states are their sum."""
        x, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        return x, residual

    def _final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """``input_ids``/``positions`` int64 ``[T]`` -> final hidden states ``[T, hidden]`` (after
        the final norm, which takes the last residual add)."""
        return self._final_norm(*self._stream(input_ids, positions, attn))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` final (normed) hidden states -> fp32 logits ``[n, vocab]`` (LM head in the model dtype)."""
        if self.comm is not None:
            head = self.embed_tokens if self.lm_head is None else self.lm_head
            return head.logits(h)  # type: ignore[operator]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(h, weight).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        last_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits ``[n, vocab]`` for the rows ``last_idx`` (int64 ``[n]``) of the flat batch, or all ``T`` rows."""
        return self.logits(self.final_hidden(input_ids, positions, attn, last_idx))

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states ``[n, hidden]`` of the rows ``rows`` (int64 ``[n]``), or all ``T``."""
        x, residual = self._stream(input_ids, positions, attn)
        if rows is not None:
            x, residual = x[rows], None if residual is None else residual[rows]
        return self._final_norm(x, residual)
