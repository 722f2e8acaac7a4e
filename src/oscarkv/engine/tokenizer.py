"""The tokenizer side of serving: loading, EOS ids, chat templates and prompt checks.

This is the only engine module (besides ``engine/models/``) that imports ``transformers``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config.base import is_int
from ..errors import InputError, ModelError
from ..utils.models import quiet_length_warning

__all__ = ["ROLES", "apply_chat", "encode_prompt", "eos_token_ids", "load_tokenizer"]

ROLES = ("system", "user", "assistant", "tool")


def load_tokenizer(model_dir: str | Path) -> Any:
    """``AutoTokenizer`` of ``model_dir``, with the long-input warning off (the engine checks lengths)."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise ModelError(f"model {model_dir}: not a directory", "pass a model directory with tokenizer files")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ModelError(
            f"model {model_dir}: cannot load its tokenizer ({first})",
            "the directory needs tokenizer.json or the tokenizer files of its model",
        ) from None
    if len(tok) == 0:
        raise ModelError(f"model {model_dir}: its tokenizer is empty; the tokenizer files are incomplete")
    return quiet_length_warning(tok)


def eos_token_ids(tokenizer: Any, config_dir: str | Path) -> tuple[int, ...]:
    """The tokenizer's EOS id, then those of ``config_dir/generation_config.json`` (deduplicated)."""
    ids: list[int] = []
    if is_int(getattr(tokenizer, "eos_token_id", None)):
        ids.append(tokenizer.eos_token_id)
    path = Path(config_dir) / "generation_config.json"
    if path.is_file():
        try:
            extra = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError):
            raise ModelError(f"{path}: not a JSON object", "fix or remove generation_config.json") from None
        extra = [extra] if is_int(extra) else extra or []
        if not isinstance(extra, list) or not all(is_int(i) and i >= 0 for i in extra):
            raise ModelError(f"{path}: eos_token_id must be a token id or a list of them; got {extra!r}")
        ids += extra
    return tuple(dict.fromkeys(ids))


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"messages[{i}] must be an object with role and content; got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise InputError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            got = type(m.get("content")).__name__
            raise InputError(f"messages[{i}].content must be a string (text only); got {got}")
        _check_text(m["content"], f"messages[{i}].content")


def _check_text(text: str, what: str) -> None:
    """``text`` encodes to UTF-8 (JSON's ``\\ud800`` escapes can carry lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            f"{what} is not valid text: a lone UTF-16 surrogate at character {e.start}",
            "send the text as UTF-8 (surrogates only in valid pairs)",
        ) from None


def apply_chat(tokenizer: Any, messages: list[dict], chat_template: str | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, ending in the assistant's turn.

    ``chat_template`` (a jinja string) overrides the tokenizer's; with neither this raises
    :class:`~oscarkv.errors.InputError` (there is no silent fallback format).
    """
    _check_messages(messages)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template; pass chat_template=...")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as e:
        raise InputError(f"the chat template rejected the messages: {e}") from None
    # the template writes its own special tokens (BOS included), as transformers and vLLM do
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int], vocab_size: int) -> list[int]:
    """Token ids of a text prompt (the tokenizer's default special tokens), or checked given ids."""
    if isinstance(prompt, str):
        _check_text(prompt, "the prompt")
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise InputError("the prompt is empty: it encodes to no tokens", "pass some text")
        return ids
    if not isinstance(prompt, (list, tuple)):
        raise InputError(f"a prompt must be a string or a list of token ids; got {type(prompt).__name__}")
    if not prompt:
        raise InputError("the prompt is empty: an empty list of token ids", "pass at least one token id")
    for i, t in enumerate(prompt):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InputError(f"prompt token {i} must be an integer id in [0, {vocab_size}); got {t!r}")
    return list(prompt)
