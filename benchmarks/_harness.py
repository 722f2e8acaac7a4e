"""Shared benchmark plumbing: environment stamp, result files and the CSV history (outside the
package)."""

from __future__ import annotations

import csv
import datetime as dt
import importlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# every run's headline figures, one row per figure, appended (never rewritten)
HISTORY = Path(__file__).resolve().parent / "history.csv"
HISTORY_FIELDS = ("date", "commit", "gpu", "python", "torch", "triton", "transformers",
                  "benchmark", "shape", "metric", "value")  # fmt: skip

Figure = tuple[str, str, float]  # (shape, metric, value)


def import_package_copy(src: str | Path, name: str) -> ModuleType:
    """The ``oscarkv`` package of another source tree (``src/`` of an earlier checkout) imported as
    ``name``, beside the installed one, for side-by-side timing (its imports are all relative)."""
    pkg = Path(src) / "oscarkv"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"--baseline: {src} holds no oscarkv package (pass the src/ folder of a checkout)")
    root = Path(tempfile.mkdtemp())
    shutil.copytree(pkg, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


CPU_COPY_CAP = 256 << 20  # bytes: the largest copy timed on a CPU


def copy_bandwidth(device: Any = "cuda", nbytes: int = 4 << 30, reps: int = 20) -> float:
    """The device's copy bandwidth in bytes/s, counting **read + write**: one device-to-device
    ``copy_`` of ``nbytes`` moves ``2 × nbytes``; that over the median time of ``reps`` copies
    (after two warm-up copies; CUDA events on a GPU). On a CPU the buffer is capped at
    ``CPU_COPY_CAP``, so the code path runs there too."""
    import statistics
    import time

    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        nbytes = min(nbytes, CPU_COPY_CAP)
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    if dev.type == "cuda":
        a.normal_()
    else:  # the values do not matter; normal_ is slow on a CPU
        a.fill_(1.0)
    b = torch.empty_like(a)
    times = []
    for i in range(reps + 2):
        if dev.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev[0].record()
            b.copy_(a)
            ev[1].record()
            ev[1].synchronize()
            s = ev[0].elapsed_time(ev[1]) / 1e3
        else:
            t = time.perf_counter()
            b.copy_(a)
            s = time.perf_counter() - t
        if i >= 2:
            times.append(s)
    moved = 2 * a.numel() * a.element_size()
    del a, b
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return moved / statistics.median(times)


def git_commit() -> str:
    # a run on the GPU machine works on a copy of the tree whose .git (if any) may be stale: the
    # run command carries the hash in results/.commit (ignored by git), which then wins
    stamp = Path(__file__).parent / "results" / ".commit"
    if stamp.exists():
        return stamp.read_text().strip()
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def env_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def append_history(benchmark: str, figures: Iterable[Figure], env: dict[str, Any]) -> int:
    """Append one row per ``(shape, metric, value)`` of ``figures`` to ``HISTORY``, stamped with
    ``env`` (``env_info()`` of the run); the header is written when the file is new. Existing rows
    are never rewritten. Returns the number of rows appended."""
    stamp = [env.get(k, "") for k in HISTORY_FIELDS[:7]]
    rows = [[*stamp, benchmark, shape, metric, _figure(value)] for shape, metric, value in figures]
    if not rows:
        return 0
    new = not HISTORY.exists() or HISTORY.stat().st_size == 0
    if not new:
        with HISTORY.open(newline="") as f:
            header = next(csv.reader(f), None)
        if tuple(header or ()) != HISTORY_FIELDS:
            raise ValueError(f"{HISTORY} has the header {header}, expected {list(HISTORY_FIELDS)}")
    HISTORY.parent.mkdir(parents=True, exist_ok=True)
    with HISTORY.open("a", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        if new:
            w.writerow(HISTORY_FIELDS)
        w.writerows(rows)
    return len(rows)


def _figure(value: float) -> str:
    """Integers as they are (byte counts), other numbers to 6 significant digits."""
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def save(
    name: str, payload: dict[str, Any], markdown: str, history: Iterable[Figure] = ()
) -> tuple[Path, Path]:
    """Write ``results/<name>.json`` (payload + env) and ``results/<name>.md``, and append the
    ``(shape, metric, value)`` figures of ``history`` to ``HISTORY`` as benchmark ``name``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = env_info()
    j = RESULTS / f"{name}.json"
    j.write_text(json.dumps({"env": env, **payload}, indent=1, default=str))
    stamp = ", ".join(f"{k}: {v}" for k, v in env.items())
    m = RESULTS / f"{name}.md"
    m.write_text(f"<!-- {stamp} -->\n{markdown}\n\n_{stamp}_\n")
    append_history(name, history, env)
    return j, m
