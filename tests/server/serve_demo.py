"""The bundled demo model behind a live server, for the server tests (bf16 KV, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import oscarkv
from oscarkv.config import EngineConfig, ServerConfig
from oscarkv.server.launch import RunningServer, start_server

DEMO = str(Path(oscarkv.__file__).parent / "assets" / "demo-model")
MODEL = "demo-model"
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


def engine_config(**kw: Any) -> EngineConfig:
    """The demo model, bf16 KV on the CPU, 4 slots, page accounting checked after every step."""
    return EngineConfig(**{"model": DEMO, "kv_dtype": "bf16", "device": "cpu", "max_running": 4,
                           "check_invariants": True, **kw})  # fmt: skip


def serve_with_template(tmp: Path, template: str = TEMPLATE, engine: EngineConfig | None = None,
                        **server: Any) -> RunningServer:  # fmt: skip
    """A server on a free port whose chat template (written into ``tmp``) is ``template``."""
    tpl = tmp / "chat.jinja"
    tpl.write_text(template)
    return start_server(engine or engine_config(), ServerConfig(port=0, chat_template=str(tpl), **server))
