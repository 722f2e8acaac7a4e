"""Static channel offsets: what every stored key and value has subtracted (a deviation from OSCAR).

Post-RoPE keys and values of real models have large per-channel means, which a per-row 2-bit
quantizer spends its range on. Calibration measures them per (layer, KV head) in the rotated
basis (``LayerRotation.k_offset`` / ``v_offset``); every tier stores ``k − c_K`` and ``v − c_V``.
This is exact for attention, so the 16-bit tiers need no special case:

* keys: ``q·(k − c_K) = q·k − q·c_K``, the same shift for every position a query sees, which the
  softmax ignores;
* values: the weights sum to one, so attending over ``v − c_V`` gives the output minus ``c_V``,
  added back to the output.

A :class:`LayerShift` holds one layer's offsets in the bases the attention code needs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rotation_set import LayerRotation

__all__ = ["LayerShift", "rotated_offset"]


def rotated_offset(mean: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per-KV-head means ``[H, d]`` (original basis) -> fp32 offsets in the basis of ``r``
    (``[d, d]`` or ``[H, d, d]``; rows: ``c R``)."""
    m, r = mean.double(), r.double().to(mean.device)
    return (m @ r if r.dim() == 2 else torch.einsum("hd,hde->he", m, r)).float()


def _unrotate(c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``c [H, d]`` in the rotated basis -> the original basis (rows: ``c Rᵀ``), fp32."""
    c, r = c.float(), r.float().to(c.device)
    return c @ r.T if r.dim() == 2 else torch.einsum("he,hde->hd", c, r)


@dataclass(frozen=True)
class LayerShift:
    """One layer's offsets, in the model dtype on its device.

    ``k`` ``[H_kv, d]``: subtracted from new keys (original basis, after RoPE); ``v``
    ``[H_kv, d]``: subtracted from new values in the basis they arrive in (rotated when ``R_V`` is
    absorbed into ``v_proj``); ``v_out`` ``[H_q, d]``: added to the attention output (in the basis it
    leaves attention in: original, or rotated when ``R_Vᵀ`` is absorbed into ``o_proj``; each query
    head its KV head's offset). Absent offsets are ``None``."""

    k: torch.Tensor | None
    v: torch.Tensor | None
    v_out: torch.Tensor | None

    @classmethod
    def build(
        cls,
        lr: LayerRotation,
        num_q_heads: int,
        values_prerotated: bool,
        device: torch.device | str,
        dtype: torch.dtype,
        outputs_rotated: bool = False,
    ) -> LayerShift | None:
        """The shift of layer ``lr`` (``None`` when it has no offsets)."""
        if lr.k_offset is None and lr.v_offset is None:
            return None
        k = v = v_out = None
        if lr.k_offset is not None:
            k = _unrotate(lr.k_offset, lr.k).to(device, dtype)
        if lr.v_offset is not None:
            orig = _unrotate(lr.v_offset, lr.v)
            v = (lr.v_offset.float() if values_prerotated else orig).to(device, dtype)
            hkv = orig.shape[0]
            if num_q_heads % hkv:
                raise ValueError(f"{num_q_heads} query heads cannot share {hkv} KV heads' value offsets")
            out = lr.v_offset.float() if outputs_rotated else orig
            v_out = out.repeat_interleave(num_q_heads // hkv, 0).to(device, dtype)
        return cls(k, v, v_out)

    def inputs(self, k: torch.Tensor, v: torch.Tensor, head_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New ``k, v`` with the offsets subtracted; heads on ``head_axis`` (-2: ``[..., H, d]``;
        1 with 4 dims: ``[B, H, T, d]``)."""
        return _sub(k, self.k, head_axis), _sub(v, self.v, head_axis)

    def output(self, o: torch.Tensor, head_axis: int) -> torch.Tensor:
        """The attention output ``o`` (original basis, query heads on ``head_axis``) with the value
        offsets added back."""
        return o if self.v_out is None else o + _shape(self.v_out, o, head_axis)


def _shape(c: torch.Tensor, x: torch.Tensor, head_axis: int) -> torch.Tensor:
    axis = head_axis % x.dim()
    return c.view(*([1] * axis), c.shape[0], *([1] * (x.dim() - axis - 2)), c.shape[1])


def _sub(x: torch.Tensor, c: torch.Tensor | None, head_axis: int) -> torch.Tensor:
    return x if c is None else x - _shape(c, x, head_axis)
