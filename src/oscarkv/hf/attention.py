"""The ``oscarkv`` attention function, registered in transformers' AttentionInterface.

An :class:`~oscarkv.hf.cache.OscarCacheLayer` returns the new key/value tensors from ``update``
and remembers them; this function recognises them, so it attends through the cache's tiers
(rotated queries, packed history, 16-bit windows) instead of over a materialised K/V. Called
with any other cache (or none), it is plain SDPA: the model behaves exactly as with ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ATTN_IMPL", "register", "valid_from_mask"]

ATTN_IMPL = "oscarkv"
#: layer index -> (id of the key tensor its update() returned, the cache layer)
PENDING: dict[int, tuple[int, Any]] = {}


def valid_from_mask(mask: torch.Tensor | None, bsz: int, t: int, past: int) -> torch.Tensor:
    """Which of the ``t`` new tokens are real (not padding): bool ``[B, T]``.

    A new token is real iff the last query of the chunk may attend to it (left padding).
    """
    if mask is None:
        return torch.ones(bsz, t, dtype=torch.bool)
    if mask.dim() != 4:
        raise ValueError(f"oscarkv attention expects a 4-D attention mask; got shape {tuple(mask.shape)}")
    row = mask[:, 0, -1, past : past + t]
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2
    return row.expand(bsz, t).cpu()


def _forward(module: Any, query, key, value, attention_mask, scaling=None, **kwargs):
    entry = PENDING.pop(int(module.layer_idx), None)
    if entry is not None and entry[0] != id(key):
        raise RuntimeError(
            f"{type(module).__name__} {module.layer_idx}: the key passed to attention is not the tensor "
            "OscarCache.update returned; this model transforms K/V between the cache and attention, "
            "which oscarkv does not support"
        )
    if entry is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if kwargs.get("sliding_window"):
        raise NotImplementedError("OscarCache does not support sliding-window attention layers")
    return entry[1].attend(query, key, value, attention_mask, scaling), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, _forward)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
