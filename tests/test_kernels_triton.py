"""Run the Triton-vs-reference kernel tests under Triton's CPU interpreter, in fresh processes.

Each file of ``tests/interpreter/`` runs in its own process with ``TRITON_INTERPRET=1`` (the
switch must be set before Triton creates any kernel, which other tests' imports could do first),
two at a time, so the interpreter lane uses both of CI's cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

FILES = sorted((Path(__file__).parent / "interpreter").glob("*_vs_ref.py"))
TIMEOUT = 2400  # seconds per file; CI allows 90 minutes in all


def test_triton_kernels_match_their_torch_twins_under_the_interpreter() -> None:
    import triton  # noqa: F401  (a dev install has triton: its absence is a failure here, not a skip)

    assert FILES, "no interpreter test files found"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    procs = {f.name: subprocess.Popen([*cmd, str(f)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env) for f in FILES}  # fmt: skip
    deadline, failures = time.monotonic() + TIMEOUT, []
    for name, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            failures.append(f"{name}: timed out after {TIMEOUT} s\n{out[-2000:]}")
            continue
        last = out.strip().splitlines()[-1] if out.strip() else ""
        if p.returncode != 0 or " passed" not in last or "skipped" in last:
            failures.append(f"{name}: exit {p.returncode}, {last!r}\n{out[-4000:]}")
    if failures:
        pytest.fail("\n\n".join(failures))
