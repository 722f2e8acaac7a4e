"""Incremental detokenization of one request, with stop strings and stop token ids.

Each step decodes a short window: the tokens of the last emitted chunk (left context) plus the new
ones, and emits what the new tokens add. Text ending in U+FFFD (an unfinished multi-byte character)
waits for the next token. Because a stop string may span tokens, the last ``max_stop_len - 1``
characters are held back until they are settled (§9, "Honourable mention"); the text never
includes a stop string or any part of one (vLLM's ``include_stop_str_in_output=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer"]

_PROMPT_CONTEXT = 5  # prompt tokens decoded as left context of the first output tokens (as vLLM)
_REPLACEMENT = "\ufffd"


def _backend_decode(tokenizer: Any) -> Any:
    """The Rust tokenizer's ``decode`` where it returns what ``tokenizer.decode`` does (a fast
    tokenizer without the clean-up pass), else ``None``. Every step decodes two short windows per
    request, and ``tokenizer.decode``'s Python conversions cost more than the decoding."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens; ``add`` returns newly settled text.

    For byte-level BPE tokenizers the concatenation of everything returned by :meth:`add` and
    :meth:`flush` equals ``tokenizer.decode(output_ids, skip_special_tokens=True)``, cut before
    the first stop string. The prompt's last tokens serve as left context, so tokenizers that
    drop a leading space at the start of a decode (SentencePiece) keep it, as vLLM does.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self._fast = _backend_decode(tokenizer)
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        ctx = list(prompt_ids[-_PROMPT_CONTEXT:])
        if self._decode(ctx).endswith(_REPLACEMENT):  # a prompt cut inside a character: no context
            ctx = []
        self._ids = ctx  # context + output ids
        self._prefix = 0  # window start in _ids
        self._read = len(ctx)  # end of the tokens already turned into text
        self._text = ""  # all decoded output text (cut at a stop once stopped)
        self._sent = 0  # characters of _text already returned
        self.stopped = False
        self.stop_text: str | None = None

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._sent]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _step(self, final: bool) -> None:
        """Decode the window; append the new tokens' text unless it is unsettled (and not final)."""
        prefix = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if not final and (len(full) <= len(prefix) or full.endswith(_REPLACEMENT)):
            return
        self._text += full[len(prefix) :]
        self._prefix, self._read = self._read, len(self._ids)

    def _release(self, start: int, final: bool) -> str:
        """Cut at a stop string that ends after ``start``; return the newly settled text."""
        lo = max(0, start - self._hold)
        hits = [(i, s) for s in self.stop if (i := self._text.find(s, lo)) >= 0]
        if hits:
            cut, self.stop_text = min(hits, key=lambda h: h[0])
            self._text, self.stopped = self._text[:cut], True
        end = len(self._text) if final or self.stopped else max(self._sent, len(self._text) - self._hold)
        out, self._sent = self._text[self._sent : end], end
        return out

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new output tokens; returns the text they settled ("" once stopped)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        start = len(self._text)
        self._step(final=False)
        return self._release(start, final=False)

    def flush(self) -> str:
        """At finish: decode what is pending and return the held-back rest (never past a stop)."""
        if self.stopped:
            return ""
        start = len(self._text)
        self._step(final=True)
        return self._release(start, final=True)
