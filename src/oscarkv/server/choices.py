"""One HTTP request's choices: every prompt of the request times ``n``, each its own engine request
(choices of one prompt share its KV pages through the prefix cache). They are added all or none,
answered together (one JSON body, or one event stream merged in arrival order, each chunk naming
its choice's index), and aborted together when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine.request import RequestOutput, SamplingParams
from ..errors import OscarkvError
from .async_engine import AsyncEngine, Reservation
from .protocol import (
    ChoiceBody,
    Usage,
    chat_choice,
    chat_chunk,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_response,
    error_body,
    error_response,
    logprobs_object,
)

__all__ = [
    "DISCONNECT_POLL_S",
    "Choice",
    "ChoiceItem",
    "add_choices",
    "answer",
    "event_stream",
    "until_disconnected",
    "until_set",
    "whole_body",
]

#: how often a waiting handler checks whether its client has gone
DISCONNECT_POLL_S = 0.25


@dataclass
class Choice:
    """A choice's engine request: its index in the response, id and outputs; ``first`` marks the
    first choice of its prompt (the one whose prompt tokens ``usage`` counts); ``echo`` is the
    prompt text the choice's text starts with (completions' ``echo``), else None."""

    index: int
    rid: str
    outs: AsyncIterator[RequestOutput]
    first: bool
    echo: str | None = None


#: one choice to add: prompt ids, params, whether it is its prompt's first, the text to echo
ChoiceItem = tuple[list[int], SamplingParams, bool, "str | None"]


async def add_choices(
    engine: AsyncEngine, items: Sequence[ChoiceItem], base: str, reservation: Reservation | None = None
) -> list[Choice]:
    """Add ``items`` together, all or none (ids ``base`` for one choice, else ``base-INDEX``); at
    most the engine's ``group_slots`` of them run at a time, the others in index order after."""
    rids = [base] if len(items) == 1 else [f"{base}-{k}" for k in range(len(items))]
    qs = await engine.add([(ids, params) for ids, params, _, _ in items], rids, base, reservation)
    return [Choice(k, rid, engine.stream(rid, q), first, echo)
            for k, (rid, q, (_, _, first, echo)) in enumerate(zip(rids, qs, items, strict=True))]  # fmt: skip


def _usage(outs: Sequence[tuple[Choice, RequestOutput]]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for c, o in outs if c.first)
    cached = sum(o.num_cached_tokens for c, o in outs if c.first)
    return Usage.of(prompt, sum(len(o.token_ids) for _, o in outs), cached)


def _logprobs(
    decode: Callable[[list[int]], str], out: RequestOutput, chat: bool, start: int = 0, offset: int = 0
) -> dict | None:
    """The OpenAI logprobs object of ``out``'s tokens from ``start`` (None where none were asked)."""
    if out.logprobs is None:
        return None
    return logprobs_object(decode, out.token_ids[start:], out.logprobs[start:], chat, offset)


def _echoed(decode: Callable[[list[int]], str], out: RequestOutput) -> dict | None:
    """The logprobs object of ``out``'s prompt tokens (the first unscored), if any were asked,
    with ``prompt_scoring``: what the scores attended to (``Engine.prompt_scoring``)."""
    if out.prompt_logprobs is None:
        return None
    lp = logprobs_object(decode, out.prompt_token_ids, out.prompt_logprobs, False)
    return {**lp, "prompt_scoring": out.prompt_scoring}


def _body(decode: Callable[[list[int]], str], c: Choice, out: RequestOutput, chat: bool) -> ChoiceBody:
    """A finished choice's text, finish reason and logprobs, the prompt first where it echoes."""
    if c.echo is None:
        return out.text, out.finish_reason, _logprobs(decode, out, chat)
    lp = _logprobs(decode, out, chat, offset=len(c.echo))
    head = _echoed(decode, out)
    if lp is not None and head is not None:
        lp = {**{k: head[k] + lp[k] for k in lp}, "prompt_scoring": head["prompt_scoring"]}
    return c.echo + out.text, out.finish_reason, lp


async def until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def until_set(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def answer(
    engine: AsyncEngine,
    request: Request,
    choices: list[Choice],
    base: str,
    model: str,
    chat: bool,
    draining: threading.Event,
    decode: Callable[[list[int]], str],
) -> Response:
    """The non-streamed response once every choice finished; 499 (all aborted) if the client
    left, 503 (all aborted) if the server began shutting down first. ``decode`` gives the token
    texts of the log-probabilities."""

    async def last(c: Choice) -> RequestOutput:
        out = None
        async for out in c.outs:  # noqa: B007
            pass
        assert out is not None
        return out

    task = asyncio.ensure_future(asyncio.gather(*(last(c) for c in choices)))
    watch = asyncio.ensure_future(until_disconnected(request))
    drain = asyncio.ensure_future(until_set(draining))
    await asyncio.wait({task, watch, drain}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    drain.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        engine.abort(*(c.rid for c in choices))  # a stream cancelled before it started aborted nothing
        if draining.is_set():
            return error_response(503, "the server is shutting down", code="shutting_down")
        return Response(status_code=499)
    body = await asyncio.to_thread(whole_body, decode, choices, task.result(), base, model, chat)
    return Response(body, media_type="application/json")


def _json(obj: Any) -> bytes:
    """``obj`` as ``JSONResponse`` writes it: UTF-8, compact, no NaN."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def whole_body(
    decode: Callable[[list[int]], str],
    choices: list[Choice],
    outs: list[RequestOutput],
    base: str,
    model: str,
    chat: bool,
) -> bytes:
    """The non-streamed response's JSON (run in a thread, off the event loop). Each choice is
    serialized on its own: ``json.dumps`` holds the GIL for the whole object it is given, and
    one call over a body of tens of megabytes (echo with logprobs) would stall the loop."""
    make, one = (chat_response, chat_choice) if chat else (completion_response, completion_choice)
    pairs = list(zip(choices, outs, strict=True))
    parts = [_json(one(c.index, _body(decode, c, o, chat))) for c, o in pairs]
    head, mark, tail = _json(make(base, model, [], _usage(pairs))).partition(b'"choices":[]')
    assert mark, "the response envelope has no empty choices list"
    return head + b'"choices":[' + b",".join(parts) + b"]" + tail


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def event_stream(
    engine: AsyncEngine,
    choices: list[Choice],
    base: str,
    model: str,
    chat: bool,
    with_usage: bool,
    draining: threading.Event,
    decode: Callable[[list[int]], str],
) -> AsyncIterator[str]:
    """Server-sent events of every choice, merged as their tokens arrive, then the usage chunk
    (``with_usage``) and ``[DONE]``; an engine error, or the server shutting down (``draining``),
    ends the stream with an error event (and ``[DONE]`` on shutdown)."""
    created = int(time.time())
    sent = {c.index: 0 for c in choices}
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for out in c.outs:
                await arrivals.put((c, out))
        except Exception as e:
            await arrivals.put((c, e))

    def chunk(index: int, text: str | None, finish: str | None, usage: Usage | None = None,
              lp: dict | None = None) -> str:  # fmt: skip
        if chat:
            delta = None if text is None else ({"content": text} if text or not finish else {})
            return _sse(chat_chunk(base, model, created, delta, finish, usage, with_usage, index, lp))
        return _sse(completion_chunk(base, model, created, text, finish, usage, with_usage, index, lp))

    n_lp = {c.index: 0 for c in choices}  # tokens whose log-probabilities were sent
    echoed: set[int] = set()  # choices whose prompt text was sent

    pumps = [asyncio.ensure_future(pump(c)) for c in choices]
    finals: dict[int, tuple[Choice, RequestOutput]] = {}
    try:
        if chat:
            for c in choices:
                yield _sse(chat_chunk(base, model, created, {"role": "assistant", "content": ""}, None, None,
                                      with_usage, c.index))  # fmt: skip
        while len(finals) < len(choices):
            if draining.is_set():  # the finally aborts what is unfinished
                yield _sse(error_body(503, "the server is shutting down", code="shutting_down"))
                yield "data: [DONE]\n\n"
                return
            try:
                c, out = await asyncio.wait_for(arrivals.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if isinstance(out, BaseException):
                raise out
            if c.echo is not None and c.index not in echoed:  # the prompt first, with its scores
                echoed.add(c.index)  # (built in a thread: a long prompt's scores are megabytes)
                lp = await asyncio.to_thread(_echoed, decode, out)
                yield chunk(c.index, c.echo, None, lp=lp)
            delta, sent[c.index] = out.text[sent[c.index] :], len(out.text)
            finish = out.finish_reason if out.finished else None
            if delta or finish:
                at = sent[c.index] - len(delta) + len(c.echo or "")
                lp = _logprobs(decode, out, chat, n_lp[c.index], at)
                n_lp[c.index] = len(out.token_ids)
                yield chunk(c.index, delta, finish, lp=lp)
            if out.finished:
                finals[c.index] = (c, out)
        if with_usage:
            yield chunk(0, None, None, _usage(list(finals.values())))
        yield "data: [DONE]\n\n"
    except OscarkvError as e:
        yield _sse(error_body(503, str(e), code="unavailable"))
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for c in choices:
            await c.outs.aclose()  # type: ignore[attr-defined]
        engine.abort(*(c.rid for c in choices if c.index not in finals))  # all in one command
