"""The OpenAI-compatible HTTP server (``oscarkv serve``): FastAPI + uvicorn over one engine thread.

Import :mod:`oscarkv.server.app`, :mod:`oscarkv.server.async_engine` or
:mod:`oscarkv.server.launch` directly; this package root imports nothing heavy.
"""

from __future__ import annotations

__all__: list[str] = []
