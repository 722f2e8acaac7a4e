"""`ServerConfig`: how `oscarkv serve` listens, authenticates and limits requests (engine.md §6)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .base import SpecError, field_error, help_field, is_int, is_num

__all__ = ["ServerConfig", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's knobs; the engine's are in :class:`~oscarkv.config.EngineConfig`."""

    host: str = help_field("address to listen on (non-loopback needs --api-key-file)", default="127.0.0.1")
    port: int = help_field("TCP port (0: any free port)", default=8000)
    api_key_file: str | None = help_field(
        "file holding the API key; clients send 'Authorization: Bearer KEY' on /v1/*", default=None
    )
    served_model_name: str | None = help_field(
        "model name in /v1/models and responses (default: the model directory's name)", default=None
    )
    chat_template: str | None = help_field(
        "jinja2 chat template file (overrides the tokenizer's)", default=None
    )
    max_queued: int = help_field(
        "most choices (prompts x n, over all requests) waiting or running; a request whose choices "
        "do not fit now gets 503",
        default=1024,
    )
    max_request_choices: int = help_field(
        "most choices (prompts x n) one request may ask for; more get 400", default=256
    )
    max_request_tokens: int | None = help_field(
        "most tokens one request may ask for, its choices' prompt + max_tokens summed; more get 400 "
        "(unset: 64 x max_model_len)",
        default=None,
    )
    max_request_share: float = help_field(
        "share of the engine's running slots (max_running) one request's choices take at a time; its "
        "other choices wait in the server until earlier ones finish (1: every slot)",
        default=0.5,
    )
    max_body_bytes: int = help_field("largest request body in bytes; larger get 413", default=1_000_000)
    max_prompt_bytes: int | None = help_field(
        "largest prompt text in UTF-8 bytes, refused (400) before it is tokenized (unset: 64 bytes "
        "per token of max_model_len)",
        default=None,
    )
    max_connections: int = help_field(
        "most open connections; more are answered 503 at once (uvicorn's limit_concurrency)", default=1024
    )
    keep_alive_s: float = help_field("seconds an idle keep-alive connection stays open", default=5.0)
    header_timeout_s: float = help_field(
        "seconds a connection may take to send a whole request head (from opening, or from its "
        "last response) before it is closed",
        default=10.0,
    )
    body_timeout_s: float = help_field(
        "seconds a request may take to send its whole body once its head has arrived; later it is "
        "answered 408 and its connection closed",
        default=30.0,
    )
    shutdown_grace_s: float = help_field(
        "seconds SIGTERM waits for requests in flight; open streams end at once with an error event "
        "and [DONE]",
        default=5.0,
    )
    tokenizer_workers: int = help_field(
        "threads tokenizing long prompts; prompts under 8 KiB have a thread of their own", default=4
    )
    insecure_no_api_key: bool = help_field(
        "allow a non-loopback --host without --api-key-file (anyone who can connect may use it)",
        default=False,
    )

    def __post_init__(self) -> None:
        n = type(self).__name__
        if not isinstance(self.host, str) or not self.host:
            raise field_error(n, "host", "a host name or IP address", self.host, True)
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise field_error(n, "port", "an integer in [0, 65535]", self.port, True)
        for name in ("api_key_file", "served_model_name", "chat_template"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise field_error(n, name, "unset or a non-empty string", v, True)
        for name in ("keep_alive_s", "header_timeout_s", "body_timeout_s", "shutdown_grace_s"):
            v = getattr(self, name)
            if not is_num(v) or not 0 < v < float("inf"):
                raise field_error(n, name, "a positive number of seconds", v, True)
        for name in (
            "max_queued",
            "max_request_choices",
            "max_body_bytes",
            "tokenizer_workers",
            "max_connections",
        ):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise field_error(n, name, "an integer >= 1", v, True)
        for name in ("max_prompt_bytes", "max_request_tokens"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise field_error(n, name, "unset or an integer >= 1", v, True)
        if not is_num(self.max_request_share) or not 0 < self.max_request_share <= 1:
            raise field_error(n, "max_request_share", "a number in (0, 1]", self.max_request_share, True)
        if not isinstance(self.insecure_no_api_key, bool):
            raise field_error(n, "insecure_no_api_key", "a bool", self.insecure_no_api_key)
        if not is_loopback(self.host) and self.api_key_file is None and not self.insecure_no_api_key:
            raise SpecError(
                f"ServerConfig.host {self.host!r} is not loopback and no --api-key-file is set",
                "pass --api-key-file FILE, or --insecure-no-api-key to serve without authentication",
            )
