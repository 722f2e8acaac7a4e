"""Request and response models of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's shapes)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..engine.request import MAX_LOGPROBS, TokenLogprob

__all__ = [
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "StreamOptions",
    "Usage",
    "chat_choice",
    "chat_chunk",
    "chat_response",
    "completion_choice",
    "completion_chunk",
    "completion_response",
    "error_body",
    "error_response",
    "is_text",
    "new_id",
]

#: the most stop strings a request may carry (OpenAI's limit)
MAX_STOPS = 4
#: the most choices (``n``) one request may ask for per prompt
MAX_N = 16
#: fields other servers take that would change the output, with the values that change nothing
OUTPUT_FIELDS: dict[str, tuple[Any, ...]] = {
    "response_format": (None, {"type": "text"}), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "min_p": (None, 0, 0.0), "min_tokens": (None, 0),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "prompt_logprobs": (None,), "length_penalty": (None, 1, 1.0), "use_beam_search": (None, False),
    "bad_words": (None, []), "allowed_token_ids": (None,), "structured_outputs": (None,),
}  # fmt: skip


def is_text(s: str) -> bool:
    """Whether ``s`` encodes to UTF-8 (JSON's ``\\ud800`` escapes can carry lone surrogates)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ApiError(Exception):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 503: "service_unavailable"}  # fmt: skip


#: error messages longer than this are cut (a message may quote the value it refuses)
MAX_ERROR_CHARS = 1000


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object for ``status``; a message over ``MAX_ERROR_CHARS`` is cut there."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... ({len(message) - MAX_ERROR_CHARS} more characters)"
    message = message.encode("utf-8", "backslashreplace").decode()  # a quoted lone surrogate, escaped
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


#: seconds a 503 (queue full, engine stopped, shutting down) asks a client to wait before retrying
RETRY_AFTER_S = 1


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """The error answered with ``status`` (a 503 says when to retry)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


#: a JSON number (an integer is a number); strings and booleans are refused, not converted
Number = Annotated[float, Field(strict=True)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields both endpoints share; unknown fields are ignored (clients send many)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None  # vLLM's extension
    user: StrictStr | None = None

    def stops(self) -> tuple[str, ...]:
        s = self.stop
        return () if s is None else (s,) if isinstance(s, str) else tuple(s)

    def unsupported(self) -> ApiError | None:
        """The first field asking for something this server does not do (unknown fields that
        would change the output are refused by name, never ignored)."""
        extra = self.model_extra or {}
        for name, neutral in OUTPUT_FIELDS.items():
            if name in extra and extra[name] not in neutral:
                return ApiError(400, f"{name} is not supported; leave it out", name)
        if self.n is not None and not 1 <= self.n <= MAX_N:
            return ApiError(400, f"n must be between 1 and {MAX_N}; got {self.n}", "n")
        if len(self.stops()) > MAX_STOPS:
            return ApiError(400, f"stop takes at most {MAX_STOPS} strings; got {len(self.stops())}", "stop")
        if self.stream_options is not None and not self.stream:
            return ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
        for name, texts in (("stop", self.stops()), ("user", (self.user or "",))):
            if not all(is_text(t) for t in texts):
                return ApiError(400, f"{name} is not valid text: it holds a lone UTF-16 surrogate; send "
                                "the text as UTF-8 (surrogates only in valid pairs)", name)  # fmt: skip
        return None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or id list, or a batch of either (a choice block each)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def logprob_count(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> ApiError | None:
        if isinstance(self.prompt, list) and not self.prompt:
            return ApiError(400, "prompt must not be an empty list", "prompt")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return ApiError(
                400, f"logprobs must be between 0 and {MAX_LOGPROBS}; got {self.logprobs}", "logprobs"
            )
        if self.best_of not in (None, self.n or 1):
            return ApiError(400, "best_of must equal n (choices are not ranked on the server)", "best_of")
        if self.suffix:
            return ApiError(400, "suffix is not supported", "suffix")
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None

    def text(self, i: int) -> str:
        """The message's text: the string, or its text parts joined (other parts: 400)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise ApiError(400, f"messages[{i}]: only text content parts are supported; got {p.type!r}",
                               "messages")  # fmt: skip
        return "".join(p.text or "" for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    tools: list[Any] | None = None

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> ApiError | None:
        if self.top_logprobs is not None and not self.logprobs:
            return ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            return ApiError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}; got {self.top_logprobs}",
                            "top_logprobs")  # fmt: skip
        if self.tools:
            return ApiError(400, "tools are not supported", "tools")
        if (self.model_extra or {}).get("echo") not in (None, False):
            return ApiError(400, "echo is a completions field: chat does not echo (vLLM's chat echo, which "
                            "repeats the last message, is not implemented); leave it out", "echo")  # fmt: skip
        return super().unsupported()

    def plain_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None

    @classmethod
    def of(cls, n_prompt: int, n_out: int, n_cached: int = 0) -> Usage:
        return cls(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                   prompt_tokens_details={"cached_tokens": n_cached})  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _head(rid: str, obj: str, model: str, created: int | None) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


ChoiceBody = tuple[str, "str | None", "dict | None"]  # text, finish_reason, logprobs object


def completion_choice(index: int, choice: ChoiceBody) -> dict:
    """One choice of a non-streamed completion: ``(text, finish_reason, logprobs)``."""
    text, finish, lp = choice
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}


def chat_choice(index: int, choice: ChoiceBody) -> dict:
    """One choice of a non-streamed chat completion: ``(text, finish_reason, logprobs)``."""
    text, finish, lp = choice
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
            "finish_reason": finish}  # fmt: skip


def completion_response(rid: str, model: str, choices: list[ChoiceBody], usage: Usage) -> dict:
    """``choices``: ``(text, finish_reason, logprobs)`` in index order."""
    out = [completion_choice(i, c) for i, c in enumerate(choices)]
    return {**_head(rid, "text_completion", model, None), "choices": out, "usage": usage.model_dump()}


def chat_response(rid: str, model: str, choices: list[ChoiceBody], usage: Usage) -> dict:
    """``choices``: ``(text, finish_reason, logprobs)`` in index order."""
    out = [chat_choice(i, c) for i, c in enumerate(choices)]
    return {**_head(rid, "chat.completion", model, None), "choices": out, "usage": usage.model_dump()}


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish: str | None,
    usage: Usage | None,
    with_usage: bool,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One SSE chunk of choice ``index``; ``text is None`` makes the final usage-only chunk."""
    out = _head(rid, "text_completion", model, created)
    out["choices"] = (
        []
        if text is None
        else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    )
    if with_usage:
        out["usage"] = usage.model_dump() if usage is not None else None
    return out


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict | None,
    finish: str | None,
    usage: Usage | None,
    with_usage: bool,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One SSE chunk of choice ``index``; ``delta is None`` makes the final usage-only chunk."""
    out = _head(rid, "chat.completion.chunk", model, created)
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    out["choices"] = [] if delta is None else [choice]
    if with_usage:
        out["usage"] = usage.model_dump() if usage is not None else None
    return out


def logprobs_object(
    decode: Any, token_ids: list[int], lps: list[TokenLogprob | None], chat: bool, offset: int = 0
) -> dict:
    """OpenAI's logprobs of ``token_ids`` (``decode([id])`` gives a token's text): completions'
    ``{tokens, token_logprobs, top_logprobs, text_offset}`` (offsets from ``offset``; a ``None``
    entry, an echoed prompt's first token, gives ``null`` scores), or chat's
    ``{content: [{token, logprob, bytes, top_logprobs}]}``."""
    texts = [decode([t]) for t in token_ids]
    tops = [None if lp is None else [(decode([i]), v) for i, v in lp[1]] for lp in lps]
    if chat:

        def entry(t: str, v: float) -> dict:
            return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}

        return {"content": [{**entry(t, c), "top_logprobs": [entry(s, v) for s, v in top]}
                            for t, (c, _), top in zip(texts, lps, tops, strict=True)]}  # fmt: skip
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [None if lp is None else lp[0] for lp in lps],
            "top_logprobs": [None if top is None else dict(top) for top in tops], "text_offset": offsets}  # fmt: skip
