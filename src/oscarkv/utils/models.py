"""Duck-typed facts about transformers models (no transformers import)."""

from __future__ import annotations

from typing import Any

__all__ = ["supports_attention_interface"]


def supports_attention_interface(model: Any) -> bool:
    """Whether transformers lets ``model`` switch attention implementations (its own test)."""
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        return False
    can = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(can):
        try:
            return bool(can())
        except Exception:  # transformers inspects the modeling source; be conservative
            return False
    return bool(getattr(model, "_supports_attention_backend", False))
