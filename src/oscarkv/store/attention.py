"""One layer's attention over the tiered store, in ``OscarCache``'s order of operations (§5.6).

The engine and the vLLM plug-in run this class; the rows it reads and writes come in a step's
:class:`~.steps.PrefillTensors` / :class:`~.steps.DecodeTensors` over the layer's flat pools
(:class:`~.layout.LayerViews`), whatever layout produced them.

Everything stored is in the rotated basis: keys by ``R_K``, values by ``R_V`` (or already
rotated, when ``R_V`` was absorbed into ``v_proj``); queries are rotated by ``R_K`` and outputs
back by ``R_Vᵀ`` (or left rotated, when ``R_Vᵀ`` was absorbed into ``o_proj``). Rotations run in
float32 and round once to the model dtype (``ops.rotate_rows`` in a prefill, ``ops.rotate_new_rows``
in decode): with the torch ops exactly as ``hf/cache.py`` does, so the engine matches the HF cache
bit for bit on the same inputs; the Triton kernels sum the same products in another order.
BF16 mode passes ``r_k = r_v = None``: plain 16-bit rows, no rotation at all.
"""

from __future__ import annotations

import itertools

import torch

from ..kernels import KernelOps, pool_ops
from ..quant import RowFormat
from ..rotation import LayerShift
from .layout import LayerViews
from .steps import DecodeTensors, PrefillTensors
from .windows import invariant_prefill

__all__ = ["TierAttention"]


class TierAttention:
    """Attention of layer ``layer``.

    Args:
        r_k, r_v: float32 ``[d, d]`` or ``[Hkv, d, d]`` rotations on the pools' device, or both
            ``None`` (BF16 mode). ``r_v`` is needed even when absorbed: it rotates outputs back.
        values_prerotated: ``R_V`` is folded into ``v_proj`` (new values arrive rotated).
        outputs_rotated: ``R_Vᵀ`` is folded into ``o_proj`` (outputs stay in the rotated basis).
        shift: the layer's static channel offsets (``None``: none).
        k_fmt, v_fmt: the layer's INT2 formats (per-layer clips); sm_scale: softmax scale.
    """

    def __init__(
        self,
        layer: int,
        r_k: torch.Tensor | None,
        r_v: torch.Tensor | None,
        k_fmt: RowFormat,
        v_fmt: RowFormat,
        ops: KernelOps,
        sm_scale: float,
        values_prerotated: bool = False,
        shift: LayerShift | None = None,
        outputs_rotated: bool = False,
    ):
        if (r_k is None) != (r_v is None):
            raise ValueError("TierAttention: r_k and r_v are both given (int2) or both None (bf16)")
        self.layer = layer
        # kept in float32: a 16-bit copy of R is not orthogonal (see hf/cache.py)
        self.r_k = None if r_k is None else r_k.float()
        self.r_v = None if r_v is None else r_v.float()
        self.k_fmt, self.v_fmt, self.ops, self.sm_scale = k_fmt, v_fmt, ops, sm_scale
        self.values_prerotated = values_prerotated
        self.shift = shift
        # the output rotation back, unless o_proj carries it
        self.r_out = None if outputs_rotated else self.r_v

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pools: LayerViews, p: PrefillTensors
    ) -> torch.Tensor:
        """New tokens of all sequences, flat: ``q [T, Hq, d]``, ``k, v [T, Hkv, d]`` (model dtype,
        RoPE applied) -> ``[T, Hq, d]``. Each sequence attends to its pre-step prefix (fully
        visible) and causally to its own new tokens; then the step's writes are applied."""
        return self._shifted(self._prefill, q, k, v, pools, p)

    def _shifted(self, run, q, k, v, pools, p):
        """``run(q, k, v, pools, p)`` between the layer's channel offsets, if it has any."""
        if self.shift is None:
            return run(q, k, v, pools, p)
        k, v = self.shift.inputs(k, v, head_axis=-2)
        return self.shift.output(run(q, k, v, pools, p), head_axis=-2)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pools: LayerViews, p: PrefillTensors
    ) -> torch.Tensor:
        ops = self.ops
        q_rot, k_rot = ops.rotate_rows(q, self.r_k), ops.rotate_rows(k, self.r_k)
        v_rot = v if self.values_prerotated else ops.rotate_rows(v, self.r_v)
        # sequences without new tokens have no query rows: the others' rows are all of q, in order
        run = [i for i in range(len(p.cu_host) - 1) if p.cu_host[i + 1] > p.cu_host[i]]
        out = torch.zeros_like(q_rot)
        if run and p.win_idx is not None:  # prefill_attention="invariant" (windows.py)
            out = invariant_prefill(
                q_rot, k_rot, v_rot, pools, p.pre_hp.indices, p.pre_q.indices, p.win_idx, p.win_cu,
                p.win_max, ops, self.sm_scale, p.win_groups, win_mask=p.win_mask, win_raw=p.win_raw,
            )  # fmt: skip
        elif run:
            k_all, v_all, cu_k, max_k = self._keys(k_rot, v_rot, pools, p, run)
            lens_q = [p.cu_host[i + 1] - p.cu_host[i] for i in run]
            cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
            cu = torch.stack([cu_q, cu_k]).to(q.device, non_blocking=True)
            out = ops.prefill_attention_varlen(
                q_rot, k_all, v_all, cu[0], cu[1], max(lens_q), max_k, self.sm_scale
            )
        q_rows = (k_rot[p.q_tok], v_rot[p.q_tok])
        hp_rows = (k_rot[p.hp_tok], v_rot[p.hp_tok])
        pool_ops.write_step(pools, p.demote_src, p.demote_dst, p.q_dst, q_rows, p.hp_dst, hp_rows, ops)
        return ops.rotate_rows(out, self.r_out, inverse=True)

    def _keys(self, k_rot, v_rot, pools: LayerViews, p: PrefillTensors, run: list[int]):
        """The flat keys and values of the sequences ``run`` for the varlen prefill: per sequence
        its cached window rows (upcast to the model dtype), its dequantized INT2 rows, then its new
        rows as computed; with ``cu_k`` (int32 host ``[n+1]``) and the longest key list."""
        ops, dt = self.ops, k_rot.dtype  # the model's: the window pools may be fp8
        hi, qi = p.pre_hp.indices.long(), p.pre_q.indices.long()
        hk, hv = pools.hp_k[hi].to(dt), pools.hp_v[hi].to(dt)
        qk = ops.dequantize(pools.k_codes[qi], pools.k_meta[qi], pools.k_fmt, dt)
        qv = ops.dequantize(pools.v_codes[qi], pools.v_meta[qi], pools.v_fmt, dt)
        hp_ptr, q_ptr, cu = p.pre_hp.indptr_host, p.pre_q.indptr_host, p.cu_host
        ks, vs, lens = [], [], []
        for i in run:
            h0, h1, q0, q1, a, b = hp_ptr[i], hp_ptr[i + 1], q_ptr[i], q_ptr[i + 1], cu[i], cu[i + 1]
            ks += [hk[h0:h1], qk[q0:q1], k_rot[a:b].to(dt)]
            vs += [hv[h0:h1], qv[q0:q1], v_rot[a:b].to(dt)]
            lens.append(h1 - h0 + q1 - q0 + b - a)
        cu_k = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        return torch.cat(ks), torch.cat(vs), cu_k, max(lens)

    def decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pools: LayerViews, p: DecodeTensors
    ) -> torch.Tensor:
        """One token per sequence: ``q [B, Hq, d]``, ``k, v [B, Hkv, d]`` -> ``[B, Hq, d]``.

        Demotions first (they free ring rows), then the new K/V rows go to ``decode_dst``
        (``-1``: skipped), then attention over the post-step lists and the output rotation."""
        return self._shifted(self._decode, q, k, v, pools, p)

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pools: LayerViews, p: DecodeTensors
    ) -> torch.Tensor:
        ops = self.ops
        pool_ops.demote(pools, p.demote_src, p.demote_dst, ops)
        if self.r_k is None:
            ops.rotate_heads(k, None, out=pools.hp_k, dst=p.decode_dst)
            ops.rotate_heads(v, None, out=pools.hp_v, dst=p.decode_dst)
            q_rot = q
        else:
            r_v = None if self.values_prerotated else self.r_v
            q_rot = ops.rotate_new_rows(q, k, v, self.r_k, r_v, pools.hp_k, pools.hp_v, p.decode_dst)
        o = ops.decode_attention(
            q_rot,
            pools.k_codes,
            pools.k_meta,
            pools.v_codes,
            pools.v_meta,
            pools.hp_k,
            pools.hp_v,
            p.q.indptr,
            p.q.indices,
            p.hp.indptr,
            p.hp.indices,
            self.sm_scale,
            self.k_fmt,
            self.v_fmt,
            lens_hint=p.lens_hint,
        )
        return o if self.r_out is None else ops.rotate_heads(o, self.r_out, inverse=True)
