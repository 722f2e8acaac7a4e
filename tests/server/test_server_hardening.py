"""The server's edges, each found by a load and fault-injection run (live server, demo model, CPU):
text that is not text, JSON nested past the parser, a 500 that ends its connection visibly, bodies
that are not JSON, requests from web pages (Host and Origin on a loopback bind), and API keys
kept out of the access log."""

from __future__ import annotations

import logging
import logging.config
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import oscarkv
from oscarkv.config import EngineConfig, ServerConfig
from oscarkv.server.launch import RedactQuery, RunningServer, access_log_config, start_server

DEMO = str(Path(oscarkv.__file__).parent / "assets" / "demo-model")
MODEL = "demo-model"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tpl = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    tpl.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    cfg = EngineConfig(model=DEMO, kv_dtype="bf16", device="cpu", max_running=2)
    s = start_server(cfg, ServerConfig(port=0, chat_template=str(tpl)))
    yield s
    s.stop()


def _post(s: RunningServer, path: str, body: str | bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(s.url + path, content=body, headers=JSON if headers is None else headers, timeout=30)


def test_lone_surrogates_are_400_not_500(srv: RunningServer) -> None:
    r = _post(srv, "/v1/completions", '{"model": "demo-model", "prompt": "a\\ud800b", "max_tokens": 2}')
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    chat = '{"model": "demo-model", "messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}'
    r = _post(srv, "/v1/chat/completions", chat)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    ok = _post(srv, "/v1/completions", '{"model": "demo-model", "prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert ok.status_code == 200  # a valid pair (an emoji) is text


def test_json_nested_past_the_parser_is_422(srv: RunningServer) -> None:
    r = _post(srv, "/v1/completions", "[" * 200_000 + "]" * 200_000)
    assert r.status_code == 422 and "nested" in r.json()["error"]["message"]


def test_a_500_closes_its_connection_visibly(srv: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    async def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(srv.async_engine, "encode", boom)
    with httpx.Client(timeout=30) as c:
        r = c.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and r.headers["connection"] == "close"
        assert "simulated" not in r.text
    monkeypatch.undo()
    assert (
        httpx.post(
            srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        ).status_code
        == 200
    )


@pytest.mark.parametrize(
    "ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_post_bodies_must_be_json(srv: RunningServer, ctype: str | None) -> None:
    body = '{"model": "demo-model", "prompt": "hi", "max_tokens": 2}'
    r = _post(srv, "/v1/completions", body, {} if ctype is None else {"Content-Type": ctype})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert (
        _post(srv, "/v1/completions", body, {"Content-Type": "application/json; charset=utf-8"}).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Host": "evil.example:8000"}, 403),  # a rebinding page: its own name, our address
        ({"Origin": "http://evil.example"}, 403),  # a page elsewhere posting to localhost
        ({"Origin": "null"}, 403),
        ({"Host": "localhost"}, 200),
        ({"Origin": "http://localhost:3000"}, 200),
        ({"Origin": "http://[::1]:5173"}, 200),
    ],
)
def test_loopback_server_answers_only_loopback_names(srv: RunningServer, headers: dict, status: int) -> None:
    r = httpx.get(srv.url + "/v1/models", headers=headers)
    assert r.status_code == status
    if status == 403:
        assert r.json()["error"]["code"] == "forbidden_host"
        p = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers=headers)  # fmt: skip
        assert p.status_code == 403


def test_api_keys_in_query_strings_stay_out_of_the_access_log() -> None:
    rec = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                            ("127.0.0.1:5000", "GET", "/v1/models?api_key=sk-secret&x=1", "1.1", 200), None)  # fmt: skip
    assert RedactQuery().filter(rec)
    line = rec.getMessage()
    assert "sk-secret" not in line and "/v1/models?api_key=[redacted]&x=[redacted]" in line
    plain = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "%s %s %s %s %d",
                              ("c", "GET", "/health", "1.1", 200), None)  # fmt: skip
    assert RedactQuery().filter(plain) and plain.getMessage() == "c GET /health 1.1 200"
    cfg = access_log_config()
    assert cfg["handlers"]["access"]["filters"] == ["redact_query"]
    logging.config.dictConfig(cfg)  # the configuration uvicorn gets is valid
