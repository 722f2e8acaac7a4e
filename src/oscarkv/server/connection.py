"""uvicorn's h11 connection with a header-read timeout: a connection that has not sent a whole
request head within ``header_timeout_s`` of opening (or of its last response) is closed, so
a client that trickles headers cannot hold one of ``--max-connections`` forever."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["header_timeout_protocol"]


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's ``H11Protocol`` with a ``seconds`` header-read timeout (pass as ``http=``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _expired(self) -> None:
            self.header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.logger.info("closing a connection that sent no request head within %.0f s", seconds)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # a whole head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11
