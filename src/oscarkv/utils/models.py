"""Duck-typed facts about transformers models (no transformers import)."""

from __future__ import annotations

from typing import Any

__all__ = ["quiet_length_warning", "supports_attention_interface"]

#: the key of transformers' warn-once flag for "Token indices sequence length is longer than ..."
_LENGTH_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


def quiet_length_warning(tokenizer: Any) -> Any:
    """Silence transformers' "Token indices sequence length is longer than the specified maximum
    sequence length" warning on ``tokenizer`` (we tokenize whole documents and check lengths
    ourselves, so it is noise). Tokenizers without the warn-once dict are left alone."""
    flags = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(flags, dict):
        flags[_LENGTH_WARNING] = True
    return tokenizer


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
