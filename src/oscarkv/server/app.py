"""`create_app`: the OpenAI-compatible routes over an :class:`AsyncEngine` (engine.md §6)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..config.base import SpecError
from ..config.server import ServerConfig, is_loopback
from ..engine.request import RequestOutput
from ..errors import InputError, OscarkvError
from ..utils.files import read_text
from .async_engine import AsyncEngine, EngineDeadError, QueueFullError, Reservation
from .choices import (
    DISCONNECT_POLL_S,
    Choice,
    ChoiceItem,
    add_choices,
    answer,
    event_stream,
    until_disconnected,
    until_set,
)
from .connection import READ_TIMED_OUT
from .guard import GuardMiddleware
from .limits import RequestLimits
from .params import sampling_params, spec_param
from .protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    error_response,
    new_id,
)

__all__ = ["create_app"]

log = logging.getLogger("oscarkv.server")


T = TypeVar("T")


def check_server_files(cfg: ServerConfig) -> None:
    """Read the API key and chat template files now (before a model loads): a missing or empty
    file fails at once."""
    if cfg.api_key_file:
        _read_key(cfg.api_key_file)
    if cfg.chat_template:
        read_text(cfg.chat_template, "--chat-template")


def _read_key(path: str) -> bytes:
    key = read_text(path, "--api-key-file").strip()
    if not key:
        raise InputError(f"--api-key-file {path} is empty", "write the API key into the file")
    return key.encode()


async def _read_json(request: Request, limit: int) -> Any:
    """The JSON body; 413 before reading past ``limit`` bytes, 422 when it is not JSON."""
    cl = request.headers.get("content-length")
    if cl is not None and (not cl.isdigit() or int(cl) > limit):
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    except ClientDisconnect:  # nobody to answer, nothing went wrong here: no traceback in the log
        if not request.scope.get(READ_TIMED_OUT):  # else the connection logged its 408
            log.info("client disconnected while sending a request to %s", request.url.path)
        raise ApiError(
            499, "the client disconnected while sending the request", code="client_closed"
        ) from None
    try:
        return json.loads(buf)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(422, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise ApiError(422, "the request body's JSON is nested too deeply", code="invalid_json") from None


def _parse(cls: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(422, "the request body must be a JSON object", code="invalid_json")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{loc}: {err['msg']}", str(err["loc"][0]) if err["loc"] else None) from None
    bad = req.unsupported()
    if bad is not None:
        raise bad
    return req


def create_app(engine: AsyncEngine, cfg: ServerConfig, metrics: Any | None = None) -> FastAPI:
    """The FastAPI app; it starts ``engine``'s thread on startup and stops it on shutdown."""
    if metrics is None:
        from .metrics import ServerMetrics

        metrics = ServerMetrics()
    model_name = cfg.served_model_name or Path(engine.engine.cfg.model).name or "oscarkv"
    template = read_text(cfg.chat_template, "--chat-template") if cfg.chat_template else None
    api_key = _read_key(cfg.api_key_file) if cfg.api_key_file else None
    max_len, vocab = engine.engine.max_model_len, engine.engine.vocab_size
    tok = engine.engine.tokenizer
    token_text = functools.lru_cache(maxsize=1 << 20)(lambda t: tok.decode([t]))  # at most the vocabulary

    def decode(ids: list[int]) -> str:
        """The text of token ids (one token's from a cache: log-probabilities name every token)."""
        return token_text(ids[0]) if len(ids) == 1 else tok.decode(ids)

    limits = RequestLimits(cfg, max_len, engine.max_queued)

    def observe(out: RequestOutput) -> None:
        n = len(out.token_ids)
        tpot = None
        if n > 1 and out.ttft_s is not None and out.e2e_s is not None:
            tpot = (out.e2e_s - out.ttft_s) / (n - 1)
        try:
            metrics.observe_finished(
                prompt_tokens=len(out.prompt_token_ids), completion_tokens=n,
                cached_tokens=out.num_cached_tokens, finish_reason=out.finish_reason or "abort",
                ttft_s=out.ttft_s, tpot_s=tpot, e2e_s=out.e2e_s or 0.0,
            )  # fmt: skip
        except Exception:  # metrics never break serving
            log.exception("metrics.observe_finished failed")

    engine.on_finished = observe
    watchers: set[asyncio.Task] = set()  # strong references to the disconnect watchers

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.running:
            engine.start(asyncio.get_running_loop())
        yield
        engine.shutdown()

    app = FastAPI(title="oscarkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_engine, app.state.metrics, app.state.model_name = engine, metrics, model_name
    app.state.draining = draining = threading.Event()  # set by the exit signal (launch.py)

    app.add_middleware(GuardMiddleware, loopback=is_loopback(cfg.host))

    @app.exception_handler(ApiError)
    async def _apierror_response(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(OscarkvError)
    async def _usererror_response(request: Request, e: OscarkvError) -> JSONResponse:
        if isinstance(e, (QueueFullError, EngineDeadError)):
            return error_response(503, str(e), code="unavailable")
        param = (
            spec_param(str(e)) if isinstance(e, SpecError) else getattr(request.state, "prompt_param", None)
        )
        return error_response(400, str(e), param)

    @app.exception_handler(StarletteHTTPException)
    async def _httperror_response(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(400, str(e.errors()[:1]))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        r = error_response(500, "internal server error", code="internal_error")
        r.headers["Connection"] = "close"  # the client knows this connection ends here
        return r

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")  # fmt: skip

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found")  # fmt: skip

    async def guarded(request: Request, work: Awaitable[T], client: bool = True) -> T:
        """``work`` (reading, tokenizing or adding a request), given up when the server begins
        shutting down (503) or, with ``client``, when the client leaves (499); cancelling it
        aborts whatever it added. (While the body is read the read itself sees a departure.)"""
        task = asyncio.ensure_future(work)
        watch = [asyncio.ensure_future(until_set(draining))]
        if client:
            watch.append(asyncio.ensure_future(until_disconnected(request)))
        try:
            await asyncio.wait({task, *watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in watch:
                w.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
                if not task.cancelled():
                    task.exception()  # retrieved: the 503 or 499 below is the answer
        if not task.cancelled():
            return task.result()
        if draining.is_set():
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        raise ApiError(499, "the client disconnected", code="client_closed")

    async def respond(request: Request, req: Any, choices: list[Choice], base: str, chat: bool) -> Response:
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            body = event_stream(engine, choices, base, model_name, chat, usage, draining, decode)
            watcher = asyncio.ensure_future(_abort_on_disconnect(request, choices))  # also if never iterated
            watchers.add(watcher)
            watcher.add_done_callback(watchers.discard)
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        return await answer(engine, request, choices, base, model_name, chat, draining, decode)

    async def _abort_on_disconnect(request: Request, choices: list[Choice]) -> None:
        while any(engine.is_live(c.rid) for c in choices):
            if await request.is_disconnected():
                engine.abort(*(c.rid for c in choices))
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def read(request: Request, cls: type[BaseModel]) -> Any:
        check_auth(request)
        req = _parse(cls, await guarded(request, _read_json(request, cfg.max_body_bytes), client=False))
        check_model(req.model)
        return req

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await read(request, CompletionRequest)
        request.state.prompt_param = "prompt"
        prompts, n, base = req.prompts(), req.n or 1, new_id("cmpl")
        param = "n" if n > 1 else "prompt"

        async def prepare(res: Reservation) -> list[Choice]:
            items: list[ChoiceItem] = []
            tokens = 0
            for p in prompts:
                if isinstance(p, str):
                    limits.prompt_size(p, "prompt")
                ids = await engine.encode(p)
                echo = (p if isinstance(p, str) else decode(ids)) if req.echo else None
                mine = [(ids, sampling_params(req, len(ids), req.max_tokens, "completion", max_len, vocab, j),
                         j == 0, echo) for j in range(n)]  # fmt: skip
                tokens = limits.tokens(tokens, [(c[0], c[1]) for c in mine], param)
                items += mine
            return await add_choices(engine, items, base, res)

        with engine.reserve(limits.choices(len(prompts), n, param)) as res:
            choices = await guarded(request, prepare(res))
        return await respond(request, req, choices, base, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await read(request, ChatRequest)
        request.state.prompt_param = "messages"
        if template is None and not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; start the server with "
                           "--chat-template FILE, or use /v1/completions", "messages", "no_chat_template")  # fmt: skip
        messages = req.plain_messages()
        limits.prompt_size("".join(m["content"] for m in messages), "messages")
        n, base = req.n or 1, new_id("chatcmpl")
        param = "n" if n > 1 else "messages"
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens

        async def prepare(res: Reservation) -> list[Choice]:
            ids = await engine.encode_chat(messages, template)
            items = [(ids, sampling_params(req, len(ids), max_tokens, "chat", max_len, vocab, j), j == 0, None)
                     for j in range(n)]  # fmt: skip
            limits.tokens(0, [(c[0], c[1]) for c in items], param)
            return await add_choices(engine, items, base, res)

        with engine.reserve(limits.choices(1, n, param)) as res:
            choices = await guarded(request, prepare(res))
        return await respond(request, req, choices, base, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_auth(request)
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "oscarkv",
                "max_model_len": max_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return error_response(503, "the engine thread has stopped", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.update_engine(engine.engine)
        body, ctype = metrics.render()
        return Response(content=body, media_type=ctype)

    return app
