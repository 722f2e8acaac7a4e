"""KIVI-2 (Liu et al., ICML 2024) as a simulated cache: the baseline's numerics, not its storage.

Keys are quantized per channel over groups of 32 tokens, values per token (one group per head
row), both 2-bit asymmetric with fp16 scale/zero; the newest ``len % 128`` tokens stay in full
precision (the residual) until 128 of them can be quantized together. Dequantized values are
kept, so this cache measures quality only; :func:`kivi_bits_per_element` gives the cost of the
real format.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..quant import dequantize_affine, quantize_asymmetric

__all__ = ["KiviCache", "kivi_bits_per_element", "kivi_fake_kv"]

RESIDUAL, GROUP, BITS = 128, 32, 2


def _fq_keys(k: torch.Tensor) -> torch.Tensor:
    b, h, t, d = k.shape  # t is a multiple of GROUP
    x = k.float().reshape(b, h, t // GROUP, GROUP, d).transpose(-1, -2)  # per channel, 32 tokens
    q, meta = quantize_asymmetric(x, BITS, GROUP, "fp16")
    return dequantize_affine(q, meta).transpose(-1, -2).reshape(b, h, t, d).to(k.dtype)


def _fq_values(v: torch.Tensor) -> torch.Tensor:
    q, meta = quantize_asymmetric(v.float(), BITS, v.shape[-1], "fp16")
    return dequantize_affine(q, meta).to(v.dtype)


def kivi_fake_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, T, d]`` as KIVI would hold them after writing all T tokens (float32)."""
    m = k.shape[2] - k.shape[2] % RESIDUAL
    kq = torch.cat([_fq_keys(k[:, :, :m]), k[:, :, m:]], dim=2)
    vq = torch.cat([_fq_values(v[:, :, :m]), v[:, :, m:]], dim=2)
    return kq.float(), vq.float()


def kivi_bits_per_element(context_len: int, head_dim: int) -> float:
    """Keys ``2 + 32/32``, values ``2 + 32/d`` bits; the residual at 16 bits."""
    quant = ((BITS + 32 / GROUP) + (BITS + 32 / head_dim)) / 2
    res = context_len % RESIDUAL
    return (res * 16 + (context_len - res) * quant) / context_len


class KiviLayer(DynamicLayer):
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.k_res, self.v_res = key_states[:, :, :0], value_states[:, :, :0]
            self.keys, self.values = self.k_res, self.v_res
            self.k_q, self.v_q = self.k_res, self.v_res
        self.k_res = torch.cat([self.k_res, key_states], dim=2)
        self.v_res = torch.cat([self.v_res, value_states], dim=2)
        m = self.k_res.shape[2] - self.k_res.shape[2] % RESIDUAL
        if m:
            self.k_q = torch.cat([self.k_q, _fq_keys(self.k_res[:, :, :m])], dim=2)
            self.v_q = torch.cat([self.v_q, _fq_values(self.v_res[:, :, :m])], dim=2)
            self.k_res, self.v_res = self.k_res[:, :, m:], self.v_res[:, :, m:]
        self.keys = torch.cat([self.k_q, self.k_res], dim=2)
        self.values = torch.cat([self.v_q, self.v_res], dim=2)
        return self.keys, self.values


class KiviCache(Cache):
    """A transformers cache with KIVI-2 numerics (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=KiviLayer)
