"""`OscarCache`: a transformers ``Cache`` that stores K/V packed in ~2 bits with OSCAR's tiers.

    cache = OscarCache.from_rotations(model, load_rotations(path))
    model.generate(**inputs, past_key_values=cache)

``from_rotations`` switches the model's attention implementation to ``oscarkv`` (plain SDPA for
any other cache). Everything stored is in the rotated basis; queries are rotated with ``R_K``
and outputs rotated back with ``R_Vᵀ`` (spec §5.6).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..config import QuantSpec
from ..errors import ModelError
from ..kernels import Backend, KernelOps, resolve
from ..quant import RowFormat
from ..quant.window import window_torch_dtype
from ..rotation import LayerRotation, LayerShift, RotationSet, attention_layer_ids, rotate_heads
from ..utils.models import supports_attention_interface
from . import attention as attn
from .absorb import ABSORBED_ATTR, absorb_value_rotation, v_fingerprint
from .health import check_window_memory, raise_if_unhealthy
from .pools import LayerPools
from .slots import SlotTable, StepPlan

__all__ = ["OscarCache", "OscarCacheLayer"]


class OscarCacheLayer(DynamicLayer):
    """One attention layer: its rotations, formats and pools; tiers are shared via the owner."""

    def __init__(
        self,
        owner: OscarCache,
        layer_idx: int,
        r_k: torch.Tensor,
        r_v: torch.Tensor,
        k_fmt: RowFormat,
        v_fmt: RowFormat,
        rotation: LayerRotation | None = None,
    ):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.r_k, self.r_v = r_k, r_v
        self.rotation = rotation  # its static offsets, applied from the first attend on
        self.shift: LayerShift | None = None
        self.k_fmt, self.v_fmt = k_fmt, v_fmt
        self.pools: LayerPools | None = None
        self.seen = 0

    # ---- transformers' layer API ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        window = window_torch_dtype(self.owner.spec.window_dtype, key_states.dtype)
        if self.owner.quantize and all(layer.pools is None for layer in self.owner.layers):
            n = len(self.owner.layers)
            check_window_memory(self.owner.spec, b, n, h, d, window, key_states.device)
        self.pools = LayerPools(b, h, d, key_states.dtype, key_states.device, self.k_fmt, self.v_fmt, window)
        # kept in float32: a 16-bit copy of R is not orthogonal (see ``attend``)
        self.r_k = self.r_k.to(self.device, torch.float32)
        self.r_v = self.r_v.to(self.device, torch.float32)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.layer_idx in attn.PENDING:
            attn.PENDING.clear()
            raise RuntimeError(
                "OscarCache was updated but its attention never ran: the model's attention is not "
                f"'{attn.ATTN_IMPL}'. Build the cache with OscarCache.from_rotations(model, ...) and keep "
                f"model.config._attn_implementation == '{attn.ATTN_IMPL}' while using it"
            )
        attn.PENDING[self.layer_idx] = (id(key_states), self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("OscarCache cannot be reset; build a new one per generate call")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("OscarCache does not support cropping (assisted/speculative decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("OscarCache does not support beam search; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("OscarCache does not support num_return_sequences > 1 or beam search")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("OscarCache does not support batch selection")

    # ---- attention ----------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
    ) -> torch.Tensor:
        """``query [B, Hq, T, d]``, new ``key/value [B, Hkv, T, d]`` -> ``[B, T, Hq, d]``."""
        assert self.pools is not None
        owner, ops = self.owner, self.owner.ops
        bsz, _, t, d = query.shape
        past = self.seen
        self.seen += t
        plan = owner.plan(past, t, mask, bsz, query.device)
        self.pools.health.note_entry(key, value)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
        if past == 0 and self.rotation is not None:
            self.shift = LayerShift.build(
                self.rotation, query.shape[1], owner.values_prerotated, key.device, key.dtype
            )
        if self.shift is not None:
            key, value = self.shift.inputs(key, value, head_axis=1)
            return self.shift.output(self._attend(plan, query, key, value, scale, ops), head_axis=2)
        return self._attend(plan, query, key, value, scale, ops)

    def _attend(self, plan: StepPlan, query, key, value, scale: float, ops: KernelOps) -> torch.Tensor:
        owner = self.owner
        if plan.is_decode:
            return self._decode(plan, query[:, :, 0], key[:, :, 0], value[:, :, 0], scale, ops)[:, None]
        # Rotations run in float32 and round once to the model dtype. With 16-bit R (and 16-bit
        # products) R·Rᵀ ≠ I by ~2^-8, which perturbs every logit q·k, sink and window included.
        q_rot = self._rotate(query, self.r_k).transpose(1, 2)  # [B, T, Hq, d]
        k_rot = self._rotate(key, self.r_k).transpose(1, 2)
        v_rot = (value if owner.values_prerotated else self._rotate(value, self.r_v)).transpose(1, 2)
        o = self._prefill(plan, q_rot, k_rot, v_rot, scale, ops)
        self.pools.apply(plan, k_rot, v_rot, ops)
        return self._rotate(o.transpose(1, 2), self.r_v, inverse=True).transpose(1, 2).contiguous()

    def _decode(
        self,
        plan: StepPlan,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        ops: KernelOps,
    ) -> torch.Tensor:
        """One decode step: ``query [B, Hq, d]``, new ``key/value [B, Hkv, d]`` -> ``[B, Hq, d]``.

        The same fp32 rotations as a prefill: the new rows by ``ops.rotate_new_rows`` (one launch on
        the GPU; K/V go straight to their 16-bit slots, after the step's demotions), the output
        back by ``ops.rotate_heads``.
        """
        p = self.pools
        assert p is not None and plan.decode_dst is not None
        p.ensure(plan.cap_q, plan.cap_h)
        p.demote(plan, ops)
        r_v = None if self.owner.values_prerotated else self.r_v
        q_rot = ops.rotate_new_rows(query, key, value, self.r_k, r_v, p.hp_k, p.hp_v, plan.decode_dst)
        o = ops.decode_attention(
            q_rot,
            p.k_codes,
            p.k_meta,
            p.v_codes,
            p.v_meta,
            p.hp_k,
            p.hp_v,
            *plan.post,
            scale,
            self.k_fmt,
            self.v_fmt,
            lens_hint=plan.post_lens,
        )
        return ops.rotate_heads(o, self.r_v, inverse=True)

    @staticmethod
    def _rotate(x: torch.Tensor, r: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x`` rotated by the float32 ``r`` in float32, rounded once to ``x.dtype``."""
        return rotate_heads(x.float(), r, inverse=inverse).to(x.dtype)

    def _prefill(
        self,
        plan: StepPlan,
        q_rot: torch.Tensor,
        k_rot: torch.Tensor,
        v_rot: torch.Tensor,
        scale: float,
        ops: KernelOps,
    ) -> torch.Tensor:
        assert self.pools is not None
        self.pools.ensure(plan.cap_q, plan.cap_h)
        out = torch.zeros_like(q_rot)
        for b in range(q_rot.shape[0]):
            keep = plan.valid[b]
            if not bool(keep.any()):
                continue
            pk, pv = self.pools.gather_prefix(*plan.pre, b, ops)
            out[b, keep] = ops.prefill_attention(
                q_rot[b, keep], pk, pv, k_rot[b, keep], v_rot[b, keep], scale
            )
        return out


class OscarCache(Cache):
    """A transformers cache holding rotated K/V in OSCAR's three tiers (see docs/hf_cache.md)."""

    def __init__(
        self,
        rotations: RotationSet,
        num_layers: int,
        spec: QuantSpec | None = None,
        backend: Backend | str = Backend.AUTO,
        device: torch.device | str = "cpu",
        quantize: bool = True,
        values_prerotated: bool = False,
        quantizer: str | None = None,
    ):
        self.spec = spec or rotations.spec
        self.rotations, self.quantize = rotations, quantize
        self.values_prerotated = values_prerotated
        self.ops: KernelOps = resolve(backend, device)
        layers: list[Any] = []
        for i in range(num_layers):
            if i not in rotations.layers:
                raise ValueError(f"rotations have no layer {i}; OscarCache needs every attention layer")
            lr = rotations.layers[i]
            kf, vf = rotations.formats(i, spec, quantizer)
            layers.append(OscarCacheLayer(self, i, lr.k.float(), lr.v.float(), kf, vf, lr))
        if quantize:
            fix = "use backend='torch', or calibrate with --high-key-bits 4"
            self.ops.require_formats([(la.k_fmt, la.v_fmt) for la in layers], fix)
            self.ops.require_windows(self.spec.window_dtype, device, "use QuantSpec(window_dtype='model')")
        super().__init__(layers=layers)
        self.table: SlotTable | None = None
        self._plan_key: tuple[int, int] | None = None
        self._plan: StepPlan | None = None

    @classmethod
    def from_rotations(
        cls,
        model: Any,
        rotations: RotationSet,
        spec: QuantSpec | None = None,
        backend: Backend | str = Backend.AUTO,
        absorb_v: bool = False,
        quantize: bool = True,
        quantizer: str | None = None,
    ) -> OscarCache:
        """Validate ``rotations`` against ``model``, route its attention through oscarkv, build a cache.

        ``absorb_v=True`` folds ``R_V`` into the value projections (modifies the model in place,
        once; spec §5.6). A model that holds absorbed ``R_V`` only attends with the same
        rotations (``absorb_v`` then changes nothing); other rotations raise ``ModelError``. ``quantize=False`` keeps every token in the windows (a passthrough used to
        test the plumbing). ``spec`` overrides the artifact's spec (and its per-layer clips);
        ``quantizer`` overrides the spec's codebook (``symmetric``, ``lloyd_max_centroid``, ...; the
        evaluation baselines use it).
        """
        cfg = model.config.get_text_config()
        rotations.validate(cfg, source="rotations passed to OscarCache")
        ids = attention_layer_ids(cfg)
        if ids != list(range(cfg.num_hidden_layers)):
            raise ModelError(
                f"{type(model).__name__} mixes attention with other layer types {getattr(cfg, 'layer_types', '')}; "
                "OscarCache supports models whose every layer is full attention"
            )
        if not supports_attention_interface(model):
            raise ModelError(
                f"{type(model).__name__} does not route attention through transformers' "
                "AttentionInterface; OscarCache cannot serve it"
            )
        absorbed = getattr(model, ABSORBED_ATTR, None)
        if absorbed is not None and absorbed != v_fingerprint(rotations):
            raise ModelError(
                f"this model's value projections already hold the R_V of other rotations (fingerprint "
                f"{absorbed}); attending with these ({v_fingerprint(rotations)}) would rotate values wrongly",
                "use the rotations that were absorbed, or load the model again",
            )
        if absorb_v and absorbed is None:
            absorb_value_rotation(model, rotations)
        absorb_v = absorb_v or absorbed is not None
        attn.register()
        if model.config._attn_implementation != attn.ATTN_IMPL:
            model.set_attn_implementation(attn.ATTN_IMPL)
        device = next(model.parameters()).device
        return cls(rotations, cfg.num_hidden_layers, spec, backend, device, quantize, absorb_v, quantizer)

    # ---- shared planning -------------------------------------------------------------------
    def plan(self, past: int, t: int, mask: torch.Tensor | None, bsz: int, device: torch.device) -> StepPlan:
        """The tier/slot plan of the current forward (computed by its first layer, then reused)."""
        if self._plan_key == (past, t) and self._plan is not None:
            return self._plan
        self.check_health()
        if self.table is None:
            self.table = SlotTable(bsz, self.spec, self.quantize)
        valid = attn.valid_from_mask(mask, bsz, t, past)
        self._plan = self.table.plan(valid, device)
        self._plan_key = (past, t)
        return self._plan

    def check_health(self) -> None:
        """Raise :class:`~oscarkv.errors.KVValueError` if NaN/Inf K/V entered the cache, or if
        stored scales overflowed their dtype (checked by every forward's first layer and by
        :meth:`memory_report`; one host read of per-layer device flags)."""
        pools = [layer.pools for layer in self.layers]
        health = [p.health if p is not None else None for p in pools]
        raise_if_unhealthy(health, list(range(len(self.layers))), self.spec)

    # ---- reporting -------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        """Bytes per tier from the tensors held, and the effective bits per stored element."""
        self.check_health()
        if self.table is None:
            return {
                "quantized_bytes": 0,
                "hp_bytes": 0,
                "total_bytes": 0,
                "allocated_bytes": 0,
                "tokens_quantized": 0,
                "tokens_hp": 0,
                "bits_per_element": float("nan"),
            }
        n_q, n_h = self.table.tokens_held()
        q_bytes = h_bytes = alloc = elems = 0
        for layer in self.layers:
            p = layer.pools
            if p is None:
                continue
            b = p.bytes(n_q, n_h)
            q_bytes, h_bytes = q_bytes + b["quantized"], h_bytes + b["hp"]
            alloc += p.allocated_bytes()
            elems += 2 * (n_q + n_h) * p.heads * p.d
        total = q_bytes + h_bytes
        return {
            "quantized_bytes": q_bytes,
            "hp_bytes": h_bytes,
            "total_bytes": total,
            "allocated_bytes": alloc,
            "tokens_quantized": n_q,
            "tokens_hp": n_h,
            "bf16_bytes": elems * 2,
            "bits_per_element": 8 * total / elems if elems else float("nan"),
        }
