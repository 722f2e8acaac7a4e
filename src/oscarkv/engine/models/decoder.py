"""One token-flat decoder for every registered family (``registry.FAMILIES``): dense and
mixture-of-experts layers, each built from the family's attention variant and MLP builder.

A batch is flat: ``input_ids [T]`` with ``positions [T]``, any number of ragged sequences side by
side. Everything but attention is per token; attention is the caller's :class:`AttentionFn`, which
knows which rows belong to which sequence and holds the KV cache. Norms and the MLP activation run
the resolved :class:`~oscarkv.kernels.KernelOps`; each residual add rides in the next norm's call
(``x, residual = norm(x, residual)``), as HF's ``h + x`` followed by ``norm(h)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...kernels import Backend, KernelOps, resolve
from .attention import Attention, AttentionFn
from .family import Build, Family
from .layers import RMSNorm, RotaryEmbedding, head_dim_of, rotary_dim_of, text_config
from .linear import Linear, LinearMethod, Target, Unquantized
from .moe import Experts, SparseMoe
from .parallel import Comm, Shard, VocabParallelEmbedding, vocab_shard
from .registry import family_of

__all__ = ["AttentionFn", "Decoder", "ModelShape", "model_shape"]


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
    rotary_dim: int = 0  # the dims RoPE rotates (the first ones of each head)
    num_experts: int = 0  # routed experts of a sparse layer (0: dense)
    experts_per_token: int = 0


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
    family_of(c, where)
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
        rotary_dim=rotary_dim_of(c, head_dim_of(c)),
        num_experts=int(
            next(
                (
                    getattr(c, k)
                    for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if getattr(c, k, None)
                ),
                0,
            )
        ),
        experts_per_token=int(getattr(c, "num_experts_per_tok", 0) or 0),
    )


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h))``; ``h += mlp(norm(h))``, each add fused into the norm after it.

    ``mlp`` is the family's dense MLP or MoE block, stored under its checkpoint name ``mlp_name``.
    """

    def __init__(self, layer: int, shape: ModelShape, family: Family, build: Build):
        super().__init__()
        kw: dict[str, Any] = {"dtype": build.dtype, "device": build.device}
        self.input_layernorm = RMSNorm(shape.hidden, shape.rms_eps, op=build.ops.rms_norm, **kw)
        self.self_attn = Attention(layer, family.attention(build.config), hidden=shape.hidden,
                                   heads=shape.num_heads, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                                   eps=shape.rms_eps, method=build.method, ops=build.ops, comm=build.comm,
                                   **kw)  # fmt: skip
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.rms_eps, op=build.ops.rms_norm, **kw)
        self.mlp, self.mlp_name = family.mlp(build, layer)

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
    """The causal LM. Module names are HF's minus ``model.``, with ``qkv_proj``/``gate_up_proj``;
    :meth:`checkpoint_targets` maps the checkpoint's names onto the parameters.

    Built from a checked HF text config (:func:`model_shape`) and its :class:`ModelShape`;
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
        method: LinearMethod | None = None,
    ):
        super().__init__()
        self.shape, self.comm = shape, comm
        ops = ops if ops is not None else resolve(Backend.TORCH, "cpu")
        self.ops = ops
        self.family = family_of(config)
        self.method = method if method is not None else Unquantized()
        build = Build(config, self.method, ops, comm, dtype, device)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.layers = nn.ModuleList(
            DecoderLayer(i, shape, self.family, build) for i in range(shape.num_layers)
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

    def finish(self) -> None:
        """After loading: each linear's method finishes its tensors; stacked experts take grouped
        GEMMs on CUDA in bf16 (capturable in CUDA graphs), with the backend's fused kernel for
        steps of a few tokens, else the reference loop; experts kept FP8 take the backend's FP8
        experts kernel. Routers without group-limited selection take the backend's fused router
        for the same few-token steps."""
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.finish(self.ops)
        for mod in self.modules():
            if isinstance(mod, Experts):
                fac = mod.w13.factory
                mod.grouped = fac["dtype"] == torch.bfloat16 and torch.device(fac["device"]).type == "cuda"
                if mod.grouped and self.ops.moe_small_tokens:
                    mod.small, mod.small_tokens = self.ops.moe_experts, self.ops.moe_small_tokens
                if mod.w13.weight.dtype == torch.float8_e4m3fn:  # kept FP8 by its method's finish
                    mod.fp8 = self.ops.fp8_moe_experts
            if isinstance(mod, SparseMoe) and mod.routing.n_group == 1 and self.ops.moe_small_tokens:
                mod.fast_route, mod.fast_route_tokens = self.ops.route_topk, self.ops.moe_small_tokens

    def checkpoint_targets(self) -> dict[str, Target]:
        """Every checkpoint tensor name this decoder reads -> where it goes (this rank's part)."""
        out: dict[str, Target] = {}
        vocab = None if self.comm is None else vocab_shard(self.shape.vocab, self.comm.world, self.comm.rank)
        for name, mod in (("model.embed_tokens", self.embed_tokens), ("lm_head", self.lm_head)):
            if mod is not None:
                shard = None if vocab is None else Shard(0, vocab[0], vocab[1], self.shape.vocab)
                dst = mod.weight.detach()
                out[f"{name}.weight"] = Target(dst if vocab is None else dst.narrow(0, 0, vocab[1]), shard)
        out["model.norm.weight"] = Target(self.norm.weight.detach(), None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = Target(layer.input_layernorm.weight.detach(), None)
            out[f"{p}.post_attention_layernorm.weight"] = Target(
                layer.post_attention_layernorm.weight.detach(), None
            )
            out.update(layer.self_attn.checkpoint_targets(f"{p}.self_attn"))
            out.update(layer.mlp.checkpoint_targets(f"{p}.{layer.mlp_name}"))
        return out

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
