"""Streaming float64 attention statistics for one layer (spec §2.2-2.3 and the softmax target).

Per KV head ``h`` (query heads ``[h·g, (h+1)·g)``, contiguous GQA grouping):

* K target: ``C_Q[h] = Σ qᵀq / (N·g)`` over the group's (token, query-head) rows;
* V target ``oscar``: ``w_t = k_t C_Q[h] k_tᵀ`` normalised to mean 1, ``C_V[h] = Σ w̃_t v_tᵀv_t / N``.
  The weights need the *final* ``C_Q``, so keys and values are buffered on the CPU in the model
  dtype (``N·H_kv·d·4`` bytes per layer) and reduced in :meth:`LayerStats.targets`;
* V target ``softmax``: the paper's ``VᵀSᵀSV`` with the causal softmax ``S``. Since ``S V`` is the
  attention output ``O``, this is ``Σ oᵀo`` over the group's rows — streamed, nothing buffered;
* ``ktk_vtv`` ablation: ``KᵀK/N`` and ``VᵀV/N``.
"""

from __future__ import annotations

import torch

__all__ = ["LayerStats"]


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, d]`` -> per-head ``Σ xᵀx`` ``[H, d, d]`` in float64."""
    x = x.to(torch.float64)
    return torch.einsum("bhtd,bhte->hde", x, x)


class LayerStats:
    """Accumulates one attention layer's statistics over calibration batches."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, needs: set[str], skip: int = 0):
        self.h, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        self.g = num_heads // num_kv_heads
        self.needs = needs  # subset of {"qq", "kv_buffer", "oo", "kk_vv", "mean"}
        self.skip = skip  # "mean": the first positions of each sequence left out (the sink)
        self.mean_n = 0
        self.k_sum: torch.Tensor | None = None
        self.v_sum: torch.Tensor | None = None
        self.tokens = 0
        self.qq: torch.Tensor | None = None
        self.oo: torch.Tensor | None = None
        self.kk: torch.Tensor | None = None
        self.vv: torch.Tensor | None = None
        self.k_buf: list[torch.Tensor] = []
        self.v_buf: list[torch.Tensor] = []

    @staticmethod
    def _add(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        return x if acc is None else acc + x

    def _group(self, x: torch.Tensor) -> torch.Tensor:
        # [B, H_q, T, d] -> [B, H_kv, g*T, d]: the rows of each KV head's query group
        b, _, t, d = x.shape
        return x.reshape(b, self.hkv, self.g * t, d)

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> None:
        """Add one batch: ``q [B, H_q, T, d]``, ``k, v [B, H_kv, T, d]``, ``o [B, T, H_q, d]``."""
        if q.shape[1] != self.h or k.shape[1] != self.hkv or q.shape[-1] != self.d:
            raise ValueError(
                f"captured shapes q{tuple(q.shape)} k{tuple(k.shape)} do not match "
                f"{self.h} query heads / {self.hkv} KV heads / head_dim {self.d}"
            )
        self.tokens += k.shape[0] * k.shape[2]
        if "qq" in self.needs:
            self.qq = self._add(self.qq, _gram(self._group(q)))
        if "oo" in self.needs:
            self.oo = self._add(self.oo, _gram(self._group(o.transpose(1, 2))))
        if "kk_vv" in self.needs:
            self.kk = self._add(self.kk, _gram(k))
            self.vv = self._add(self.vv, _gram(v))
        if "mean" in self.needs and k.shape[2] > self.skip:
            ks, vs = k[:, :, self.skip :].to(torch.float64), v[:, :, self.skip :].to(torch.float64)
            self.mean_n += ks.shape[0] * ks.shape[2]
            self.k_sum = self._add(self.k_sum, ks.sum((0, 2)))
            self.v_sum = self._add(self.v_sum, vs.sum((0, 2)))
        if "kv_buffer" in self.needs:
            # [B, H_kv, T, d] -> [B*T, H_kv, d] on the CPU, model dtype
            self.k_buf.append(k.detach().transpose(1, 2).reshape(-1, self.hkv, self.d).cpu())
            self.v_buf.append(v.detach().transpose(1, 2).reshape(-1, self.hkv, self.d).cpu())

    # ---- targets ----------------------------------------------------------------------------
    def c_q(self) -> torch.Tensor:
        """Per-KV-head query second moment ``[H_kv, d, d]`` (float64)."""
        if self.qq is None:
            raise RuntimeError("no query statistics were accumulated")
        return self.qq / (self.tokens * self.g)

    def c_v_oscar(self, chunk: int = 8192) -> torch.Tensor:
        """OSCAR's score-energy-weighted value second moment ``[H_kv, d, d]`` (float64)."""
        cq = self.c_q().cpu()
        keys, vals = torch.cat(self.k_buf), torch.cat(self.v_buf)
        n = keys.shape[0]
        w_sum = torch.zeros(self.hkv, dtype=torch.float64)
        acc = torch.zeros(self.hkv, self.d, self.d, dtype=torch.float64)
        for s in range(0, n, chunk):
            k = keys[s : s + chunk].to(torch.float64)
            v = vals[s : s + chunk].to(torch.float64)
            w = torch.einsum("thd,hde,the->th", k, cq, k)  # E_q[(q·k_t)²] per head
            w_sum += w.sum(0)
            acc += torch.einsum("th,thd,the->hde", w, v, v)
        # w̃ = w·N/Σw, C_V = Σ w̃ vᵀv / N  ==  Σ w vᵀv / Σw
        return acc / w_sum.clamp_min(1e-12)[:, None, None]

    def targets(self, method: str, v_target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-KV-head ``(Σ_K, Σ_V)`` ``[H_kv, d, d]`` float64 (not yet averaged/symmetrised)."""
        if method == "ktk_vtv":
            assert self.kk is not None and self.vv is not None
            return self.kk / self.tokens, self.vv / self.tokens
        ck = self.c_q()
        if v_target == "softmax":
            assert self.oo is not None
            cv = self.oo / (self.tokens * self.g)
        else:
            cv = self.c_v_oscar()
        return ck, cv.to(ck.device)

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-KV-head mean key and value ``[H_kv, d]`` (float64, original basis) over the
        positions past ``skip``."""
        if self.k_sum is None or self.v_sum is None or not self.mean_n:
            raise RuntimeError(
                f"no key/value means were accumulated (sequences no longer than the {self.skip} skipped positions?)"
            )
        return self.k_sum / self.mean_n, self.v_sum / self.mean_n

    @staticmethod
    def needs_for(method: str, v_target: str) -> set[str]:
        if method in ("hadamard", "identity"):
            return set()
        if method == "ktk_vtv":
            return {"kk_vv"}
        return {"qq", "oo" if v_target == "softmax" else "kv_buffer"}
