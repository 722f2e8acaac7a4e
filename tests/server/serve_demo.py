"""The bundled demo model behind a live server, for the server tests (bf16 KV, CPU), and the
helpers those tests share."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

import oscarkv
from oscarkv.config import EngineConfig, ServerConfig
from oscarkv.server.launch import RunningServer, start_server

DEMO = str(Path(oscarkv.__file__).parent / "assets" / "demo-model")
MODEL = "demo-model"
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


def engine_config(**kw: Any) -> EngineConfig:
    """The demo model, bf16 KV on the CPU in 0.25 GiB (several servers share a test process), 4
    slots, page accounting checked after every step."""
    return EngineConfig(**{"model": DEMO, "kv_dtype": "bf16", "device": "cpu", "max_running": 4,
                           "kv_budget_gb": 0.25, "check_invariants": True, **kw})  # fmt: skip


def serve_with_template(tmp: Path, template: str = TEMPLATE, engine: EngineConfig | None = None,
                        **server: Any) -> RunningServer:  # fmt: skip
    """A server on a free port whose chat template (written into ``tmp``) is ``template``."""
    tpl = tmp / "chat.jinja"
    tpl.write_text(template)
    return start_server(engine or engine_config(), ServerConfig(port=0, chat_template=str(tpl), **server))


def wait_idle(srv: RunningServer, timeout: float = 20.0) -> float:
    """Seconds until the server holds no request (every choice finished, every page free, the
    engine with nothing to run); fails after ``timeout``."""
    eng, t0 = srv.engine, time.monotonic()

    def idle() -> bool:
        pools = [p for p in (eng.hp, getattr(eng, "q", None)) if p is not None]
        return (eng.scheduler.idle and not eng.scheduler.running and not eng.scheduler.waiting
                and all(p.n_free == p.capacity for p in pools) and srv.async_engine.num_live == 0
                and not eng.has_unfinished())  # fmt: skip

    while not idle():
        assert time.monotonic() - t0 < timeout, "the engine did not return to idle"
        time.sleep(0.05)
    return time.monotonic() - t0


def slow_long_prompts(monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    """Long prompts take ``delay`` seconds to tokenize (as a megabyte does on a slow tokenizer)."""
    import oscarkv.server.async_engine as ae

    real = ae.encode_prompt

    def slow(tok: Any, prompt: Any, vocab: int) -> list[int]:
        if isinstance(prompt, str) and len(prompt) > ae.SHORT_PROMPT_CHARS:
            time.sleep(delay)
        return real(tok, prompt, vocab)

    monkeypatch.setattr(ae, "encode_prompt", slow)


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> tuple[float | None, bytes]:
    """Seconds until the server closes ``sock`` (None if it stays open ``seconds``) and what it
    sent before, sending ``trickle`` one byte every 0.2 s meanwhile."""
    t0, got = time.monotonic(), b""
    sock.settimeout(0.2)
    for i in range(int(seconds / 0.2)):
        try:
            data = sock.recv(65536)
            if data == b"":
                return time.monotonic() - t0, got
            got += data
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0, got
        if trickle:
            try:
                sock.sendall(trickle[i % len(trickle) : i % len(trickle) + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0, got
    return None, got
