"""The attention block of every family: fused ``q|k|v``, optional biases, q/k norms, RoPE (full or
partial), the caller's attention over the KV cache, ``o_proj``.

The variants are fields of :class:`AttnSpec`. q/k norms are per head (Qwen3, Qwen3-MoE, GLM with
``use_qk_norm``), run with RoPE as one op (``qk_norm_rope``), or over the full q and k width
(MiniMax-M2: one RMSNorm over all heads of a token; under tensor parallelism its statistics are
summed over every rank's heads). Partial rotary needs nothing here: the rotary cache is narrower
than the head (``cos [T, r/2]``) and the op rotates the first ``r`` dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ...kernels import KernelOps
from .layers import RMSNorm
from .linear import ColumnLinear, LinearMethod, RowLinear, Target
from .parallel import Comm, Shard

__all__ = ["Attention", "AttentionFn", "AttnSpec"]


class AttentionFn(Protocol):
    """``attn(layer, q [T,Hq,d], k [T,Hkv,d], v [T,Hkv,d]) -> [T,Hq,d]``, all in the model dtype.

    ``q``/``k`` are after q/k-norm and RoPE; ``v`` is straight from ``v_proj`` (already ``v·R_V``
    when the loader absorbed ``R_V``). All three are contiguous. The scale is ``head_dim ** -0.5``.
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttnSpec:
    """A family's attention variant: biases, and q/k norms (``None``, ``"head"`` or ``"full"``)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None

    def __post_init__(self) -> None:
        if self.qk_norm not in (None, "head", "full"):
            raise ValueError(f"AttnSpec.qk_norm {self.qk_norm!r}: None, 'head' or 'full'")


class FullNorm(nn.Module):
    """RMSNorm over a token's whole q (or k) row ``[T, H·d]``, this rank's ``weight [H·d/tp]``; the
    mean of squares spans every rank's heads (``full`` columns in all). Arithmetic as HF's RMSNorm."""

    def __init__(
        self, width: int, full: int, eps: float, comm: Comm | None, *, dtype: torch.dtype, device: Any
    ):
        super().__init__()
        self.eps, self.full, self.comm = eps, full, comm
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        ss = f.pow(2).sum(-1, keepdim=True)
        if self.comm is not None:
            ss = self.comm.all_reduce(ss)
        f = f * torch.rsqrt(ss / self.full + self.eps)
        return self.weight * f.to(x.dtype)

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        n = self.weight.shape[0]
        shard = None if self.comm is None else Shard(0, self.comm.rank * n, n, self.full)
        return {f"{prefix}.weight": Target(self.weight.detach(), shard)}


class Attention(nn.Module):
    """This rank's ``Hq/tp`` query and ``Hkv/tp`` KV heads (``comm``), outputs summed over ranks."""

    def __init__(
        self,
        layer: int,
        spec: AttnSpec,
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        method: LinearMethod,
        ops: KernelOps,
        comm: Comm | None = None,
        dtype: torch.dtype,
        device: Any,
    ):
        super().__init__()
        self.layer, self.spec = layer, spec
        tp = 1 if comm is None else comm.world
        d, hq, hkv = head_dim, heads // tp, kv_heads // tp
        self.hq, self.hkv, self.d = hq, hkv, d
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.qkv_proj = ColumnLinear(hidden, (hq * d, hkv * d, hkv * d), spec.qkv_bias, method,
                                     names=("q_proj", "k_proj", "v_proj"), comm=comm, **kw)  # fmt: skip
        self.o_proj = RowLinear(hq * d, hidden, spec.o_bias, method, comm=comm, **kw)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(d, eps, op=ops.rms_norm, **kw)
            self.k_norm = RMSNorm(d, eps, op=ops.rms_norm, **kw)
        elif spec.qk_norm == "full":
            self.q_norm = FullNorm(hq * d, heads * d, eps, comm, **kw)
            self.k_norm = FullNorm(hkv * d, kv_heads * d, eps, comm, **kw)
        self.qk_norm_rope = ops.qk_norm_rope

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        norms: tuple[Any, Any, float] = (None, None, 0.0)
        if self.spec.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        elif self.spec.qk_norm == "head":
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)  # type: ignore[union-attr]
        q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        q, k = self.qk_norm_rope(q, k, cos, sin, *norms)  # per-head norms and RoPE, one op
        o = attn(self.layer, q, k, v.contiguous())
        return self.o_proj(o.reshape(t, self.hq * self.d))

    def checkpoint_targets(self, prefix: str) -> dict[str, Target]:
        out = {**self.qkv_proj.checkpoint_targets(f"{prefix}.qkv_proj"),
               **self.o_proj.checkpoint_targets(f"{prefix}.o_proj")}  # fmt: skip
        for name in ("q_norm", "k_norm"):
            mod = getattr(self, name)
            if isinstance(mod, FullNorm):
                out.update(mod.checkpoint_targets(f"{prefix}.{name}"))
            elif mod is not None:
                out[f"{prefix}.{name}.weight"] = Target(mod.weight.detach(), None)
        return out
