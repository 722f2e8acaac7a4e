"""The server's edges, each found by a load and fault-injection run (live server, demo model, CPU):
text that is not text, JSON nested past the parser, a 500 that ends its connection visibly, bodies
that are not JSON, requests from web pages (Host and Origin on a loopback bind), and API keys
kept out of the access log."""

from __future__ import annotations

import contextlib
import json
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
from serve_demo import MODEL, closed_within, engine_config, serve_with_template, slow_long_prompts

from oscarkv.config import ServerConfig
from oscarkv.config.base import SpecError
from oscarkv.server.launch import RedactQuery, RunningServer, access_log_config, start_server

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = serve_with_template(tmp_path_factory.mktemp("tpl"), "{% for m in messages %}{{ m.content }}\n{% endfor %}",
                            engine_config(max_running=2, check_invariants=False))  # fmt: skip
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
    for field in ('"stop": "a\\ud800"', '"stop": ["ok", "\\udfff"]', '"user": "\\ud800x"'):
        r = _post(
            srv, "/v1/completions", '{"model": "demo-model", "prompt": "hi", "max_tokens": 2, ' + field + "}"
        )
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], (field, r.text)
        assert r.json()["error"]["param"] == field.split('"')[1]
    r = _post(srv, "/v1/completions", '{"model": "demo-model", "prompt": "hi", "logit_bias": {"\\ud800": 1}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"  # the key is quoted, escaped
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
@contextlib.contextmanager
def _long_prompts_in_flight(s: RunningServer, n: int, settle_s: float) -> Iterator[list[Future]]:
    """``n`` long-prompt requests posted from threads, ``settle_s`` seconds after they were sent."""
    long = {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 1}
    with ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(httpx.post, s.url + "/v1/completions", json=long, timeout=60) for _ in range(n)]
        time.sleep(settle_s)
        yield futs


def _start(**server: Any) -> RunningServer:
    cfg = engine_config(max_running=2, check_invariants=False)
    return start_server(cfg, ServerConfig(port=0, **server))


def test_prompts_over_the_byte_cap_are_refused_before_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    slow_long_prompts(monkeypatch, 30.0)  # a tokenized prompt would time the test out
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
    slow_long_prompts(monkeypatch, 3.0)
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
    slow_long_prompts(monkeypatch, 3.0)
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


def test_a_request_head_trickled_past_the_header_timeout_is_closed() -> None:
    """A client sending headers a byte at a time (each byte resets keep-alive) is cut off after
    ``header_timeout_s``; an idle new connection too; a prompt request is unaffected."""
    s = _start(header_timeout_s=1.0, keep_alive_s=30)
    host, port = s.url.removeprefix("http://").split(":")
    try:
        assert s.server.config.timeout_keep_alive == 30
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
            took, _ = closed_within(sock, 4.0, trickle=b"X-Slow: aaaaaaaa\r\n")
        assert took is not None and 0.5 < took < 2.5
        with socket.create_connection((host, int(port))) as sock:
            took, _ = closed_within(sock, 4.0)
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


def _head(s: RunningServer, length: int) -> tuple[str, int, bytes]:
    host, port = s.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n")  # fmt: skip
    return host, int(port), head.encode()


def test_a_body_not_sent_in_time_is_answered_408_and_health_stays_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A POST head whose body never comes, or comes a byte at a time, holds its connection only
    until ``body_timeout_s`` after the head: 408 (OpenAI's error shape) and the connection
    closed. Meanwhile connections stuck so fill ``max_connections`` (uvicorn counts the new
    one too), and /health still answers."""
    s = _start(body_timeout_s=1.0, header_timeout_s=10.0, keep_alive_s=30, max_connections=4)
    host, port, head = _head(s, 100)
    try:
        with caplog.at_level(logging.INFO, logger="oscarkv.server"):
            stuck = [socket.create_connection((host, port)) for _ in range(3)]
            for sock in stuck:
                sock.sendall(head)
            time.sleep(0.3)
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200  # over the cap, still served
            for sock in stuck:
                took, got = closed_within(sock, 5.0)
                assert took is not None and took < 3.0
                status, _, body = got.partition(b"\r\n\r\n")
                assert status.startswith(b"HTTP/1.1 408") and b"connection: close" in status.lower()
                assert json.loads(body)["error"]["code"] == "request_timeout"
                sock.close()
            with socket.create_connection((host, port)) as sock:  # trickled: cut off at the deadline too
                sock.sendall(head)
                took, _ = closed_within(sock, 5.0, trickle=b'{"model": "demo-model", "prompt": "hi"}')
            assert took is not None and 0.5 < took < 3.0
        assert "408" in caplog.text and "disconnected while sending" not in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200  # a body sent whole is unaffected
    finally:
        s.stop()
    assert ServerConfig().body_timeout_s == 30.0
    with pytest.raises(SpecError, match="body_timeout_s"):
        ServerConfig(body_timeout_s=0)


def test_over_max_connections_the_503_is_openai_shaped_with_retry_after() -> None:
    s = _start(max_connections=2, header_timeout_s=10.0)
    host, port, _ = _head(s, 0)
    try:
        with socket.create_connection((host, port)), socket.create_connection((host, port)):
            time.sleep(0.2)  # two idle connections: the cap is reached
            r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_connections" and r.headers["connection"] == "close"
            assert httpx.get(s.url + "/health").status_code == 200
        time.sleep(0.2)
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        s.stop()


def test_sigterm_while_a_prompt_is_tokenized_is_503_not_500(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A request still being tokenized when the server drains gets 503 with Retry-After at once,
    not uvicorn's plain-text 500 (and a logged CancelledError) at the end of the grace period."""
    slow_long_prompts(monkeypatch, 6.0)
    s = _start(shutdown_grace_s=2.0)
    res: dict[str, Any] = {}
    long = {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 1}
    t = threading.Thread(
        target=lambda: res.update(r=httpx.post(s.url + "/v1/completions", json=long, timeout=60))
    )
    with caplog.at_level(logging.INFO):
        t.start()
        time.sleep(0.5)  # being tokenized
        t0 = time.monotonic()
        s.stop()
        t.join(30)
    r = res["r"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "shutting_down" and time.monotonic() - t0 < 10
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text


def test_the_servers_own_log_lines_are_printed(capsys: pytest.CaptureFixture[str]) -> None:
    """`oscarkv serve` logs through uvicorn's configuration; the server's own INFO lines (a client
    gone mid-body, a 408) have a handler there and are printed, not dropped."""
    log = logging.getLogger("oscarkv.server")
    try:
        logging.config.dictConfig(access_log_config())
        log.info("client disconnected while sending a request to /v1/completions")
        assert "client disconnected while sending" in capsys.readouterr().err
    finally:
        log.handlers.clear()
        log.setLevel(logging.NOTSET)
        log.propagate = True


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
