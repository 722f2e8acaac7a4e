"""The server's edges, each found by a load and fault-injection run (live server, demo model, CPU):
text that is not text, JSON nested past the parser, a 500 that ends its connection visibly, bodies
that are not JSON, requests from web pages (Host and Origin on a loopback bind), and API keys
kept out of the access log."""

from __future__ import annotations

import contextlib
import logging
import logging.config
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from serve_demo import DEMO, MODEL, serve_with_template

from oscarkv.config import EngineConfig, ServerConfig
from oscarkv.config.base import SpecError
from oscarkv.server.launch import RedactQuery, RunningServer, access_log_config, start_server

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = serve_with_template(tmp_path_factory.mktemp("tpl"), "{% for m in messages %}{{ m.content }}\n{% endfor %}",
                            EngineConfig(model=DEMO, kv_dtype="bf16", device="cpu", max_running=2))  # fmt: skip
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


# ---- tokenization: a byte cap, a short-prompt thread, and the queue counting what is tokenized --
def _slow_long_prompts(monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    """Long prompts take ``delay`` seconds to tokenize (as a megabyte does on a slow tokenizer)."""
    import oscarkv.server.async_engine as ae

    real = ae.encode_prompt

    def slow(tok: Any, prompt: Any, vocab: int) -> list[int]:
        if isinstance(prompt, str) and len(prompt) > ae.SHORT_PROMPT_CHARS:
            time.sleep(delay)
        return real(tok, prompt, vocab)

    monkeypatch.setattr(ae, "encode_prompt", slow)


@contextlib.contextmanager
def _long_prompts_in_flight(s: RunningServer, n: int, settle_s: float) -> Iterator[list[Future]]:
    """``n`` long-prompt requests posted from threads, ``settle_s`` seconds after they were sent."""
    long = {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 1}
    with ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(httpx.post, s.url + "/v1/completions", json=long, timeout=60) for _ in range(n)]
        time.sleep(settle_s)
        yield futs


def _start(**server: Any) -> RunningServer:
    cfg = EngineConfig(model=DEMO, kv_dtype="bf16", device="cpu", max_running=2)
    return start_server(cfg, ServerConfig(port=0, **server))


def test_prompts_over_the_byte_cap_are_refused_before_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_long_prompts(monkeypatch, 30.0)  # a tokenized prompt would time the test out
    s = _start(max_prompt_bytes=20_000)
    try:
        t0 = time.monotonic()
        r = httpx.post(
            s.url + "/v1/completions", json={"model": MODEL, "prompt": "é" * 10_001, "max_tokens": 2}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_large"
        assert "20002 bytes" in r.json()["error"]["message"] and time.monotonic() - t0 < 5
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 20_001}]}
        assert httpx.post(s.url + "/v1/chat/completions", json=chat).status_code == 400
    finally:
        s.stop()
    assert ServerConfig().max_prompt_bytes is None  # unset: 64 bytes per token of max_model_len


def test_a_short_request_is_not_held_behind_long_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_long_prompts(monkeypatch, 3.0)
    s = _start(tokenizer_workers=2)
    try:
        with _long_prompts_in_flight(s, 5, settle_s=0.3) as futs:
            t0 = time.monotonic()
            r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            short_s = time.monotonic() - t0
            assert r.status_code == 200 and short_s < 2.5  # not after five 3 s tokenizations
            assert all(f.result().status_code in (200, 400) for f in futs)
    finally:
        s.stop()


def test_prompts_being_tokenized_count_toward_max_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_long_prompts(monkeypatch, 3.0)
    s = _start(max_queued=2)
    try:
        with _long_prompts_in_flight(s, 2, settle_s=0.5) as futs:  # both being tokenized, none in the engine
            r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            [f.result() for f in futs]
        assert (
            httpx.post(
                s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
            ).status_code
            == 200
        )
    finally:
        s.stop()


# ---- shutdown and connection limits ----------------------------------------------------------
def test_sigterm_ends_open_streams_with_an_error_event_and_done() -> None:
    s = _start(shutdown_grace_s=10.0)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            events.append(next(lines))  # the stream is open and generating
            t = threading.Thread(target=s.stop)  # what SIGTERM does to `oscarkv serve`
            t0 = time.monotonic()
            t.start()
            events += [x for x in lines if x]
        t.join(30)
    finally:
        s.stop()
    assert events[-1] == "data: [DONE]" and "shutting_down" in events[-2]
    assert time.monotonic() - t0 < 8  # the stream ended at once, not at the grace period's end


def test_connection_cap_and_keep_alive_come_from_the_config() -> None:
    s = _start(max_connections=3, keep_alive_s=1.5)
    try:
        cfg = s.server.config
        assert (cfg.limit_concurrency, cfg.timeout_keep_alive, cfg.timeout_graceful_shutdown) == (3, 1.5, 5.0)
        with httpx.Client(timeout=10) as c:
            assert c.get(s.url + "/health").status_code == 200
            time.sleep(2.5)  # past keep_alive_s the server has closed the idle connection
            assert c.get(s.url + "/health").status_code == 200  # httpx reconnects
    finally:
        s.stop()
    with pytest.raises(SpecError, match="keep_alive_s"):
        ServerConfig(keep_alive_s=0)


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes ``sock`` (None if it stays open ``seconds``), sending
    ``trickle`` one byte every 0.2 s meanwhile."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    for i in range(int(seconds / 0.2)):
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        if trickle:
            try:
                sock.sendall(trickle[i % len(trickle) : i % len(trickle) + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
    return None


def test_a_request_head_trickled_past_the_header_timeout_is_closed() -> None:
    """A client sending headers a byte at a time (each byte resets keep-alive) is cut off after
    ``header_timeout_s``; an idle new connection too; a prompt request is unaffected."""
    s = _start(header_timeout_s=1.0, keep_alive_s=30)
    host, port = s.url.removeprefix("http://").split(":")
    try:
        assert s.server.config.timeout_keep_alive == 30
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
            took = _closed_within(sock, 4.0, trickle=b"X-Slow: aaaaaaaa\r\n")
        assert took is not None and 0.5 < took < 2.5
        with socket.create_connection((host, int(port))) as sock:
            took = _closed_within(sock, 4.0)
        assert took is not None and 0.5 < took < 2.5
        with socket.create_connection((host, int(port))) as sock:  # a whole head in time: answered
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        s.stop()
    with pytest.raises(SpecError, match="header_timeout_s"):
        ServerConfig(header_timeout_s=0)


def test_a_client_leaving_mid_upload_is_no_internal_error(
    srv: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = srv.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100000\r\n\r\n")  # fmt: skip
    with caplog.at_level(logging.INFO):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + b'{"model": "demo-model", "prompt": "' + b"x" * 5000)
            time.sleep(0.3)
        time.sleep(0.5)
        assert httpx.get(srv.url + "/health").status_code == 200
    assert "disconnected while sending" in caplog.text
    assert "internal error" not in caplog.text and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_other_servers_fields_are_taken_at_their_neutral_values(srv: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "repetition_penalty": 1.0,
            "response_format": {"type": "text"}, "min_p": 0, "tool_choice": "none"}  # fmt: skip
    assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 200
