"""Reference twin of the fused small-batch experts kernel (``kernels.triton.moe``).

``moe_experts(x, w13, w2, weights, ids)``: every token ``t`` through its ``k`` chosen experts,
``out[t] = Σ_j round(weights[t, j] · round(down_e(a)))`` with ``a = round(silu(round(g)) ·
round(u))``, ``g|u = x_t · w13[e]ᵀ``, ``e = ids[t, j]``: the arithmetic of the engine's grouped
experts (``engine.models.moe.grouped_experts``), each product in fp32 and rounded to ``x``'s dtype
where eager torch rounds it, the ``k`` terms summed in fp32 in order and rounded once.
"""

from __future__ import annotations

import torch

__all__ = ["moe_experts"]


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (one dtype), ``weights [T, k]`` (fp32 or
    ``x``'s dtype), ``ids [T, k]`` (int) -> ``[T, H]`` in ``x``'s dtype."""
    dt = x.dtype
    inter = w2.shape[-1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(ids.shape[1]):
        e = ids[:, j].long()
        h = torch.einsum("th,tnh->tn", x.float(), w13[e].float()).to(dt)
        g, u = h[:, :inter].float(), h[:, inter:].float()
        a = (torch.nn.functional.silu(g).to(dt).float() * u).to(dt)
        y = torch.einsum("ti,thi->th", a.float(), w2[e].float()).to(dt)
        out += (y.float() * weights[:, j, None].float()).to(dt).float()
    return out.to(dt)
