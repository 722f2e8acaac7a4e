"""The server's first check on every HTTP request, before routing: who may ask (Host and Origin on
a loopback bind) and in what form (POST bodies are JSON)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse

from ..config.server import is_loopback
from .protocol import error_response

__all__ = ["GuardMiddleware"]


def _loopback_name(netloc: str) -> bool:
    """Whether a Host header or an Origin's ``host[:port]`` names this machine."""
    host = netloc.rsplit("@", 1)[-1]
    if host.startswith("["):  # [::1]:8000
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":")[0]
    return bool(host) and is_loopback(host.lower())


class GuardMiddleware:
    """Plain ASGI (a ``BaseHTTPMiddleware`` would hide client disconnects from the handlers). On a
    loopback bind only loopback Host and Origin headers are served, so a web page the user visits
    can neither reach the server nor read from it after rebinding its DNS name to 127.0.0.1; and
    every POST must be JSON, so a browser's form or text/plain "simple request" is refused."""

    def __init__(self, app: Any, loopback: bool):
        self.app, self.loopback = app, loopback

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            bad = self._refusal(scope["method"], headers)
            if bad is not None:
                await bad(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, method: str, headers: dict[str, str]) -> JSONResponse | None:
        if self.loopback:
            origin = headers.get("origin")
            if not _loopback_name(headers.get("host", "")) or (
                origin is not None and not _loopback_name(urlsplit(origin).netloc)
            ):
                return error_response(403, "this server listens on a loopback address and answers only requests "
                              "addressed to it as localhost (Host and Origin headers)", code="forbidden_host")  # fmt: skip
        if method == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return error_response(415, f"the request body must be application/json; got {ctype or 'no Content-Type'}",
                              code="unsupported_media_type")  # fmt: skip
        return None
