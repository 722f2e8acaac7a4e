"""`RequestLimits`: what one request may ask for (prompt text, choices, tokens), each past its
limit a 400 naming the field the client can change; checked before the work it bounds."""

from __future__ import annotations

from collections.abc import Sequence

from ..config.server import ServerConfig
from ..engine.request import SamplingParams
from .protocol import ApiError

__all__ = ["PROMPT_BYTES_PER_TOKEN", "REQUEST_TOKENS_PER_LEN", "RequestLimits"]

#: the prompt text a server takes per token of max_model_len (unless --max-prompt-bytes is set)
PROMPT_BYTES_PER_TOKEN = 64
#: the tokens one request may ask for, in units of max_model_len (unless --max-request-tokens is set)
REQUEST_TOKENS_PER_LEN = 64


class RequestLimits:
    """``cfg``'s per-request limits for a model of ``max_len`` positions, ``max_queued`` places."""

    def __init__(self, cfg: ServerConfig, max_len: int, max_queued: int):
        self.cfg, self.max_len, self.max_queued = cfg, max_len, max_queued
        self.prompt_bytes = cfg.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_len
        self.request_tokens = cfg.max_request_tokens or REQUEST_TOKENS_PER_LEN * max_len

    def prompt_size(self, text: str, param: str) -> None:
        """Refuse a text no prompt of ``max_len`` tokens could be, before tokenizing it."""
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > self.prompt_bytes:
            raise ApiError(400, f"{param} is {n} bytes of text, more than this server takes ({self.prompt_bytes}: "
                           f"--max-prompt-bytes, unset {PROMPT_BYTES_PER_TOKEN} bytes per token of max_model_len "
                           f"{self.max_len})", param, "prompt_too_large")  # fmt: skip

    def choices(self, prompts: int, n: int, param: str) -> int:
        """The request's choice count (prompts x n), before any prompt is tokenized; past
        ``--max-request-choices`` or what ``--max-queued`` could ever hold, 400 naming ``param``."""
        k = prompts * n
        what = f"{k} choices ({prompts} prompt{'s' if prompts > 1 else ''} x n={n})"
        for limit, flag, why in ((self.cfg.max_request_choices, "--max-request-choices", "in one request"),
                                 (self.max_queued, "--max-queued", "queued at once")):  # fmt: skip
            if k > limit:
                raise ApiError(400, f"this request asks for {what}, more than this server takes {why} "
                               f"({flag} {limit}); send fewer prompts or a smaller n", param,
                               "too_many_choices")  # fmt: skip
        return k

    def tokens(self, tokens: int, items: Sequence[tuple[list[int], SamplingParams]], param: str) -> int:
        """``tokens`` plus each item's prompt + ``max_tokens`` (checked as prompts are tokenized);
        past ``--max-request-tokens``, 400 naming ``param``."""
        tokens += sum(len(ids) + p.max_tokens for ids, p in items)
        if tokens > self.request_tokens:
            raise ApiError(400, f"this request asks for more than {self.request_tokens} tokens (its choices' "
                           "prompt + max_tokens, summed; --max-request-tokens); send fewer prompts, a "
                           "smaller n or max_tokens", param, "too_many_tokens")  # fmt: skip
        return tokens
