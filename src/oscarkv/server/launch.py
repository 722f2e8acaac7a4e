"""Running the server: :func:`serve` (the ``oscarkv serve`` foreground process) and
:func:`start_server` (uvicorn in a background thread, for tests and soak runs)."""

from __future__ import annotations

import copy
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from ..config import EngineConfig
from ..config.server import ServerConfig
from ..engine.engine import Engine
from ..errors import InputError
from .async_engine import AsyncEngine
from .connection import request_timeout_protocol

__all__ = ["RedactQuery", "RunningServer", "access_log_config", "build_app", "serve", "start_server"]


class RedactQuery(logging.Filter):
    """Access-log records show a path's query keys, never their values (a client that sends
    ``?api_key=...`` does not leave its key in the log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            path, _, query = args[2].partition("?")
            keys = "&".join(f"{k}=[redacted]" for k, _ in parse_qsl(query, keep_blank_values=True))
            record.args = (*args[:2], f"{path}?{keys}", *args[3:])
        return True


def access_log_config() -> dict:
    """uvicorn's logging configuration with :class:`RedactQuery` on the access log, and the
    server's own ``oscarkv.server`` logger printing INFO lines as uvicorn's do."""
    from uvicorn.config import LOGGING_CONFIG

    out = copy.deepcopy(LOGGING_CONFIG)
    out.setdefault("filters", {})["redact_query"] = {"()": RedactQuery}
    out["handlers"]["access"]["filters"] = ["redact_query"]
    # the server's own lines (a client gone mid-body, a 408, the connection cap) beside uvicorn's
    out["loggers"]["oscarkv.server"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return out


def build_app(engine_cfg: EngineConfig, server_cfg: ServerConfig, engine: Engine | None = None,
              metrics: Any | None = None) -> Any:  # fmt: skip
    """Load the engine (unless given) and return the FastAPI app over it."""
    from .app import check_server_files, create_app

    check_server_files(server_cfg)
    eng = engine if engine is not None else Engine(engine_cfg)
    aeng = AsyncEngine(eng, server_cfg.max_queued, tokenizer_workers=server_cfg.tokenizer_workers,
                       request_share=server_cfg.max_request_share)  # fmt: skip
    return create_app(aeng, server_cfg, metrics)


def _uvicorn_config(app: Any, cfg: ServerConfig, **kw: Any) -> Any:
    import uvicorn

    return uvicorn.Config(app, limit_concurrency=cfg.max_connections, timeout_keep_alive=cfg.keep_alive_s,
                          timeout_graceful_shutdown=cfg.shutdown_grace_s,
                          http=request_timeout_protocol(cfg.header_timeout_s, cfg.body_timeout_s), **kw)  # fmt: skip


def _draining_server(config: Any) -> Any:
    """uvicorn's server whose exit signal first tells the app to drain (``app.state.draining``):
    open streams end with an error event and ``[DONE]``, waiting requests get 503, before the
    connections close."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            self.config.app.state.draining.set()
            super().handle_exit(sig, frame)

    return Draining(config)


def _check_start(cfg: ServerConfig) -> socket.socket:
    """What can fail before the model loads: the key and template files, the template's Jinja
    syntax, and the address. Returns a socket bound to ``cfg.host:cfg.port``."""
    from .app import check_server_files

    check_server_files(cfg)
    if cfg.chat_template:
        _check_chat_template(cfg.chat_template)
    fam = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        sock.close()
        raise InputError(
            f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}",
            "stop what uses that port, or pass another --port (0 picks a free one)",
        ) from None
    return sock


def _check_chat_template(path: str) -> None:
    """Compile the chat template as transformers will (a syntax error fails now, not per chat)."""
    from jinja2 import TemplateError

    from ..utils.files import read_text

    try:  # transformers' own environment (its extensions and filters)
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        compile_ = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string
    try:
        compile_(read_text(path, "--chat-template"))
    except TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        why = " ".join(str(e.message or e).split())
        raise InputError(
            f"--chat-template {path}: not a valid Jinja template{where}: {why}",
            "fix the template's syntax, or drop --chat-template to use the tokenizer's",
        ) from None


def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> None:
    """Load the model and serve until interrupted (uvicorn in this thread)."""

    sock = _check_start(server_cfg)  # before the model loads; the port is held while it loads
    try:
        eng = Engine(engine_cfg)
    finally:
        sock.close()  # uvicorn binds the address again (and logs it)
    print(f"oscarkv serve: {eng.startup_report()}", file=sys.stderr, flush=True)
    try:
        app = build_app(engine_cfg, server_cfg, eng)
        config = _uvicorn_config(app, server_cfg, host=server_cfg.host, port=server_cfg.port, log_level="info",
                                 log_config=access_log_config())  # fmt: skip
        _draining_server(config).run()
    finally:
        eng.shutdown()


@dataclass
class RunningServer:
    """A server running in a background thread; ``stop()`` shuts it down and joins it."""

    url: str
    app: Any
    engine: Engine
    server: Any
    thread: threading.Thread

    @property
    def async_engine(self) -> AsyncEngine:
        return self.app.state.async_engine

    def stop(self, timeout: float = 30.0) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # what SIGTERM does to `oscarkv serve`
        self.thread.join(timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server(
    engine_cfg: EngineConfig,
    server_cfg: ServerConfig,
    engine: Engine | None = None,
    metrics: Any | None = None,
    timeout: float = 60.0,
) -> RunningServer:
    """Serve on ``server_cfg.host`` in a background thread (port 0 picks a free port)."""

    sock = _check_start(server_cfg)  # before the model loads
    try:
        eng = engine if engine is not None else Engine(engine_cfg)
        app = build_app(engine_cfg, server_cfg, eng, metrics)
    except BaseException:
        sock.close()
        raise
    fam = sock.family
    host, port = sock.getsockname()[:2]
    config = _uvicorn_config(app, server_cfg, log_level="warning", lifespan="on")
    server = _draining_server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="oscarkv-uvicorn", daemon=True
    )
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - t0 > timeout:
            server.should_exit = True
            raise InputError(f"the server did not start on {host}:{port} within {timeout:.0f} s")
        time.sleep(0.02)
    h = f"[{host}]" if fam == socket.AF_INET6 else host
    return RunningServer(f"http://{h}:{port}", app, eng, server, thread)
