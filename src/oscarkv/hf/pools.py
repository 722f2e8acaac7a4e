"""One layer's storage: packed quantized rows + window rows, laid out as :mod:`.slots` says.

Only packed codes and their (scale, zero) metadata are kept for the quantized tier: no float
copy of the history exists anywhere. The writes and reads themselves are
:mod:`oscarkv.kernels.pool_ops`; this class owns the tensors and regrows them when the
per-sequence regions of :mod:`.slots` grow.
"""

from __future__ import annotations

import torch

from ..kernels import KernelOps, pool_ops
from ..quant import RowFormat
from .health import KVHealth
from .slots import StepPlan

__all__ = ["LayerPools"]


def _relayout(t: torch.Tensor, batch: int, old_cap: int, new_cap: int) -> torch.Tensor:
    """Move each sequence's region from stride ``old_cap`` to stride ``new_cap`` (rows)."""
    out = t.new_zeros((batch * new_cap, *t.shape[1:]))
    if old_cap:
        keep = min(old_cap, new_cap)
        out.view(batch, new_cap, *t.shape[1:])[:, :keep] = t.view(batch, old_cap, *t.shape[1:])[:, :keep]
    return out


class LayerPools:
    """Packed K/V codes + metadata ``[B·cap_q, H, ...]`` and window K/V ``[B·cap_h, H, d]`` in
    ``window_dtype`` (default: the model's ``dtype``; float8_e4m3fn with fp8 windows)."""

    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        k_fmt: RowFormat,
        v_fmt: RowFormat,
        window_dtype: torch.dtype | None = None,
    ):
        self.batch, self.heads, self.d, self.dtype = batch, heads, head_dim, dtype
        hp_dtype = dtype if window_dtype is None else window_dtype
        self.k_fmt, self.v_fmt = k_fmt, v_fmt
        self.cap_q = self.cap_h = 0
        meta = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
        self.k_codes = torch.zeros(0, heads, k_fmt.packed_dim, dtype=torch.uint8, device=device)
        self.v_codes = torch.zeros(0, heads, v_fmt.packed_dim, dtype=torch.uint8, device=device)
        self.k_meta = torch.zeros(0, heads, k_fmt.groups, 2, dtype=meta[k_fmt.meta_dtype], device=device)
        self.v_meta = torch.zeros(0, heads, v_fmt.groups, 2, dtype=meta[v_fmt.meta_dtype], device=device)
        self.hp_k = torch.zeros(0, heads, head_dim, dtype=hp_dtype, device=device)
        self.hp_v = torch.zeros(0, heads, head_dim, dtype=hp_dtype, device=device)
        self.health = KVHealth(device)

    def ensure(self, cap_q: int, cap_h: int) -> None:
        if cap_q != self.cap_q:
            b, o = self.batch, self.cap_q
            self.k_codes = _relayout(self.k_codes, b, o, cap_q)
            self.v_codes = _relayout(self.v_codes, b, o, cap_q)
            self.k_meta = _relayout(self.k_meta, b, o, cap_q)
            self.v_meta = _relayout(self.v_meta, b, o, cap_q)
            self.cap_q = cap_q
        if cap_h != self.cap_h:
            self.hp_k = _relayout(self.hp_k, self.batch, self.cap_h, cap_h)
            self.hp_v = _relayout(self.hp_v, self.batch, self.cap_h, cap_h)
            self.cap_h = cap_h

    def apply(self, plan: StepPlan, k_rot: torch.Tensor, v_rot: torch.Tensor, ops: KernelOps) -> None:
        """Write one forward's tokens. ``k_rot, v_rot``: rotated ``[B, T, H, d]`` (model dtype).

        Demotions run first: a slot they free may receive a new token in the same step.
        """
        self.ensure(plan.cap_q, plan.cap_h)
        qb, qt, qs = plan.new_q
        hb, ht, hs = plan.new_hp
        q_rows = (k_rot[qb, qt], v_rot[qb, qt])
        hp_rows = (k_rot[hb, ht], v_rot[hb, ht])
        pool_ops.write_step(self, *plan.demote, qs, q_rows, hs, hp_rows, ops)
        self._note_meta(plan.demote[1], qs)

    def demote(self, plan: StepPlan, ops: KernelOps) -> None:
        """Move the step's demoted 16-bit rows to their quantized slots (before any new writes)."""
        pool_ops.demote(self, *plan.demote, ops)
        self._note_meta(plan.demote[1])

    def _note_meta(self, *slots: torch.Tensor) -> None:
        for s in slots:
            if s.numel():
                self.health.note_meta(self.k_meta[s], self.v_meta[s])

    def gather_prefix(
        self,
        indptr: torch.Tensor,
        idx: torch.Tensor,
        hp_indptr: torch.Tensor,
        hp_idx: torch.Tensor,
        b: int,
        ops: KernelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s cached rows (windows + dequantized) as ``[P, H, d]`` in the model dtype."""
        qi = idx[int(indptr[b]) : int(indptr[b + 1])]
        hi = hp_idx[int(hp_indptr[b]) : int(hp_indptr[b + 1])]
        return pool_ops.gather_prefix(self, qi, hi, ops, self.dtype)

    def bytes(self, n_q: int, n_h: int) -> dict[str, int]:
        """Bytes of ``n_q`` quantized and ``n_h`` window tokens (all heads, K and V)."""
        row_q = self._row_q_bytes()
        row_h = 2 * self.heads * self.d * self.hp_k.element_size()
        return {"quantized": n_q * row_q, "hp": n_h * row_h}

    def _row_q_bytes(self) -> int:
        meta = self.k_meta.element_size()
        k = self.heads * (self.k_fmt.packed_dim + 2 * self.k_fmt.groups * meta)
        v = self.heads * (self.v_fmt.packed_dim + 2 * self.v_fmt.groups * meta)
        return k + v

    def allocated_bytes(self) -> int:
        ts = (self.k_codes, self.v_codes, self.k_meta, self.v_meta, self.hp_k, self.hp_v)
        return sum(t.numel() * t.element_size() for t in ts)
