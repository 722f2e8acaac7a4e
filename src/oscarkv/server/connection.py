"""uvicorn's h11 connection with the server's request-read deadlines and connection cap.

- The head: a connection that has not sent a whole request head within ``header_timeout_s`` of
  opening (or of its last response) is closed.
- The body: a request whose body has not arrived whole within ``body_timeout_s`` of its head is
  answered 408 (an OpenAI-shaped body, ``Connection: close``) and its connection closed; the
  app's handler sees the client gone. uvicorn's own keep-alive timer restarts on every byte, so
  without these a client sending a byte at a time would hold one of ``--max-connections``
  forever.
- Over ``max_connections`` (uvicorn's ``limit_concurrency``), a request is answered 503 with
  ``Retry-After`` and an OpenAI-shaped body, as the app's own 503s are; ``GET /health`` is
  always served, so a health check sees the server alive however many connections are open.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from .protocol import error_body, error_response

__all__ = ["HEALTH_PATH", "READ_TIMED_OUT", "request_timeout_protocol"]

#: the route served over the connection cap
HEALTH_PATH = "/health"
#: the scope key set on a request answered 408 (its handler then logs no disconnect of its own)
READ_TIMED_OUT = "oscarkv.read_timed_out"
log = logging.getLogger("oscarkv.server")


def request_timeout_protocol(header_s: float, body_s: float) -> type:
    """uvicorn's ``H11Protocol`` with a ``header_s`` head deadline, a ``body_s`` body deadline and
    the JSON 503 over the connection cap (pass as ``http=``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = error_response(503, "the server is busy: too many open connections (--max-connections)",
                          code="too_many_connections")  # fmt: skip
    busy.headers["Connection"] = "close"  # the refused connection does not hold a place either

    class RequestTimeoutH11(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None
        body_timer: asyncio.TimerHandle | None = None
        body_cycle: Any = None  # the request whose body the body timer waits for

        def __init__(self, config: Any, *args: Any, **kw: Any) -> None:
            super().__init__(config, *args, **kw)
            self.cap, self.limit_concurrency = self.limit_concurrency, None  # checked in _capped
            self.app = self._capped(self.app)

        # ---- the connection cap -------------------------------------------------------------
        def _capped(self, app: Any) -> Any:
            async def capped(scope: dict, receive: Any, send: Any) -> None:
                # uvicorn's test, made when the request's task starts (so counting it once more)
                over = self.cap is not None and (
                    len(self.connections) >= self.cap or len(self.tasks) > self.cap
                )
                if over and scope["type"] == "http" and scope["path"] != HEALTH_PATH:
                    log.warning(
                        "answering 503: %d connections are open (--max-connections)", len(self.connections)
                    )
                    await busy(scope, receive, send)
                    return
                await app(scope, receive, send)

            return capped

        # ---- the head deadline ---------------------------------------------------------------
        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(header_s, self._head_expired)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _head_expired(self) -> None:
            self.header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.logger.info("closing a connection that sent no request head within %.0f s", header_s)
                self.transport.close()

        # ---- the body deadline ---------------------------------------------------------------
        def _watch_body(self) -> None:
            """Arm the body timer for a request whose body is still coming; disarm it once the
            body is whole or answered."""
            c = self.cycle
            waiting = c is not None and c.more_body and not c.response_started and not c.disconnected
            if waiting and self.body_cycle is not c:
                self._unwatch_body()
                self.body_cycle = c
                self.body_timer = self.loop.call_later(body_s, self._body_expired)
            elif not waiting:
                self._unwatch_body()

        def _unwatch_body(self) -> None:
            if self.body_timer is not None:
                self.body_timer.cancel()
            self.body_timer, self.body_cycle = None, None

        def _body_expired(self) -> None:
            c = self.body_cycle
            self.body_timer, self.body_cycle = None, None
            if c is not self.cycle or not c.more_body or c.response_started or self.transport.is_closing():
                return
            log.info(
                "answering 408: a request to %s sent no whole body within %.0f s", c.scope["path"], body_s
            )
            body = json.dumps(error_body(408, f"the request body did not arrive within {body_s:g} s "
                                         "(--body-timeout-s)", code="request_timeout")).encode()  # fmt: skip
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]  # fmt: skip
            try:
                out = self.conn.send(
                    h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
                )
                out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
                self.transport.write(out)
            except h11.LocalProtocolError:  # no response can be written now: only close
                pass
            c.scope[READ_TIMED_OUT] = True
            c.response_started = c.response_complete = c.disconnected = (
                True  # the handler's answer is dropped
            )
            c.message_event.set()
            self.transport.close()

        # ---- uvicorn's hooks -------------------------------------------------------------------
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # a whole head arrived
                self._disarm()
            self._watch_body()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()
            self._watch_body()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._unwatch_body()
            super().connection_lost(exc)

    return RequestTimeoutH11
