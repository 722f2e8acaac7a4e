"""Reference twin of the fused router (``kernels.triton.router``): transformers' three MoE routers.

``route_topk(x, weight, bias, kind, top_k, renormalize, ...)`` turns a step's hidden states into
each token's ``top_k`` experts and their weights:

- ``softmax`` (Qwen3-MoE): softmax over the model-dtype logits in fp32, top-k, renormalized when
  ``renormalize``; the weights are rounded to the model dtype.
- ``sigmoid`` (GLM-4 MoE, MiniMax-M2): sigmoid scores in fp32; experts chosen by score + ``bias``
  (the correction bias: selection only), first within the ``topk_group`` best of ``n_group`` groups
  (a group scores the sum of its two best) when ``n_group > 1``; weights are the plain scores,
  renormalized when ``renormalize`` (GLM adds ``renorm_eps`` = 1e-20 to the sum), times ``scale``.
  ``fp32_logits``: the logits are an fp32 product of fp32 casts (GLM).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["route_topk"]


def route_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    top_k: int,
    renormalize: bool,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
    fp32_logits: bool = False,
    renorm_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` (model dtype), router ``weight [E, H]``, correction ``bias`` fp32 ``[E]`` or None
    -> ``(weights [T, k]`` (model dtype for softmax, fp32 for sigmoid), ``ids`` int64 ``[T, k])``.
    Softmax ids come in descending order of weight; sigmoid ids in no set order."""
    if kind == "softmax":
        logits = nn.functional.linear(x, weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids
    logits = (
        nn.functional.linear(x.float(), weight.float()) if fp32_logits else nn.functional.linear(x, weight)
    )
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        t, e = choice.shape
        groups = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(groups).scatter_(
            1, torch.topk(groups, topk_group, dim=-1, sorted=False)[1], 1
        )
        keep = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    top = scores.gather(1, ids)
    if renormalize:
        top = top / (top.sum(dim=-1, keepdim=True) + renorm_eps)
    return top * scale if scale != 1.0 else top, ids
