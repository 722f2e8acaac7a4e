"""`oscarkv serve` at start: default flags start and answer on a CPU; what cannot work (a busy
port, a chat template that does not compile, a KV budget beyond the memory, flags that do
nothing or cannot hold) fails at once with one line and exit 2, before the model loads where it
can."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_demo import DEMO, engine_config

import oscarkv.server.launch as launch
from conftest import random_rotation_set
from oscarkv import QuantSpec
from oscarkv.cli import main
from oscarkv.config import ServerConfig
from oscarkv.errors import InputError
from oscarkv.rotation import save_rotations

SERVE = ["serve", "--model", DEMO, "--kv-dtype", "bf16", "--device", "cpu"]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building an engine fails the test: the check must come before the model loads."""

    def refuse(cfg: Any) -> Any:
        raise AssertionError("the model loaded before the start-up check")

    monkeypatch.setattr(launch, "Engine", refuse)


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaching uvicorn fails the test (instead of serving forever)."""

    def refuse(config: Any) -> Any:
        raise AssertionError("the server started")

    monkeypatch.setattr(launch, "_draining_server", refuse)


def _one_error(err: str, *words: str) -> str:
    """The single ``oscarkv serve: error:`` line of ``err`` (plus at most a hint), holding ``words``."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    errors = [ln for ln in lines if ln.startswith("oscarkv serve: error: ")]
    assert len(errors) == 1, err
    assert all(ln == errors[0] or ln.startswith("  hint: ") or "warning" in ln for ln in lines), err
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


def test_a_busy_port_fails_before_the_model_loads(busy_port: int, no_engine: None, capsys) -> None:
    for run in (launch.serve, launch.start_server):
        with pytest.raises(InputError, match=f"cannot listen on 127.0.0.1:{busy_port}") as e:
            run(engine_config(), ServerConfig(port=busy_port))
        assert "--port" in e.value.hint
    assert main([*SERVE, "--port", str(busy_port)]) == 2
    _one_error(capsys.readouterr().err, f"127.0.0.1:{busy_port}", "in use")


def test_a_chat_template_that_does_not_compile_fails_at_start(
    tmp_path: Path, no_engine: None, capsys
) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for x in %}{{ x }}{% endfor %}")
    for run in (launch.serve, launch.start_server):
        with pytest.raises(InputError, match="not a valid Jinja template"):
            run(engine_config(), ServerConfig(port=0, chat_template=str(bad)))
    assert main([*SERVE, "--port", "0", "--chat-template", str(bad)]) == 2
    _one_error(capsys.readouterr().err, str(bad), "line 1", "Expected an expression")


def test_a_template_that_compiles_is_accepted(tmp_path: Path, no_serving: None) -> None:
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% generation %}x{% endgeneration %}{% endfor %}")
    launch._check_chat_template(str(good))  # transformers' own tags compile


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--kv-budget-gb", "1e6"], ["kv_budget_gb=1e+06 is more than", "GiB of memory available"]),
        (["--max-model-len", "1000000000"], ["max_model_len=1000000000", "2048 positions"]),
        (["--prefill-attention", "invariant"], ["prefill_attention", "invariant needs int2"]),
    ],
)
def test_flags_that_cannot_hold_are_one_line_and_exit_2(flags: list[str], words: list[str], no_serving: None,
                                                        capsys) -> None:  # fmt: skip
    assert main([*SERVE, "--port", "0", *flags]) == 2
    _one_error(capsys.readouterr().err, *words)


class _Served:
    """``python -m oscarkv serve ARGS --port 0`` in a subprocess, its URL read from its log."""

    def __init__(self, args: list[str], timeout: float = 120.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "oscarkv", *args, "--port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.stop()
                raise AssertionError(f"no server within {timeout:.0f} s:\n" + "".join(self.log)) from None
            m = re.search(r"Uvicorn running on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return
            if line == "":  # the log ended: the process exited
                raise AssertionError(f"the server exited ({self.proc.wait(10)}):\n" + "".join(self.log))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put("")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def _serve_and_ask(args: list[str]) -> str:
    """Serve ``args`` with default flags otherwise, ask one completion, stop; the start-up log."""
    srv = _Served(args)
    try:
        r = httpx.post(
            srv.url + "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4}, timeout=120
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        code = srv.stop()  # uvicorn drains, then re-raises SIGTERM: -15 after a clean shutdown
    log = "".join(srv.log)
    assert code in (0, -signal.SIGTERM) and "Finished server process" in log, log
    return log


@pytest.mark.parametrize("kv", ["bf16", "int2"])
def test_serve_with_default_flags_starts_and_answers(kv: str, tmp_path: Path) -> None:
    args = ["serve", "--model", DEMO, "--kv-dtype", kv]
    if kv == "int2":
        save_rotations(random_rotation_set(4, 128, QuantSpec()), tmp_path / "rot")
        args += ["--rotations", str(tmp_path / "rot")]
    log = _serve_and_ask(args)
    assert "GiB available" in log  # the start-up line says where the budget came from


@pytest.mark.slow
def test_serve_smollm2_bf16_with_default_flags(smollm2_dir: Path) -> None:
    log = _serve_and_ask(["serve", "--model", str(smollm2_dir), "--kv-dtype", "bf16"])
    assert "max_model_len 8192" in log
