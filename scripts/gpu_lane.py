"""Run the GPU lane (``tests/test_kernels_gpu.py``) as several pytest processes in parallel on one
GPU, and write a summary.

On a fresh GPU machine every kernel specialization compiles on first use, and compiling is CPU
work: one process took over 10 minutes for the whole lane in session 14 (more than one device
call allows), four processes in parallel 178 s in session 12. The test ids are split into
contiguous shards, so that parametrizations of one test (which share compiled kernels) stay in
one process. Each shard stops at ``--timeout`` seconds, so its partial result still comes back.

    python scripts/gpu_lane.py [--shards 4] [-k EXPR] [--timeout 500] [--out DIR]

Exit status: 0 if every shard passed (skips allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # _harness
from _harness import env_info

LANE = Path(__file__).resolve().parents[1] / "tests" / "test_kernels_gpu.py"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def collect(target: Path, select: str | None) -> list[str]:
    """The test ids of ``target`` (``-k select`` applied), in file order, with the file as an
    absolute path (pytest prints them relative to its rootdir, not to the working directory)."""
    target = target.resolve()
    cmd = [*PYTEST, "--collect-only", str(target)] + (["-k", select] if select else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode not in (0, 5):
        raise SystemExit(f"collecting {target} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return [f"{target}::{line.split('::', 1)[1]}" for line in res.stdout.splitlines() if "::" in line]


def split(ids: list[str], n: int) -> list[list[str]]:
    """``ids`` in at most ``n`` contiguous shards of near-equal size (none empty)."""
    n = max(1, min(n, len(ids)))
    size, extra = divmod(len(ids), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(ids[start:end])
        start = end
    return out


def run(shards: list[list[str]], timeout: float, logs: Path) -> list[dict]:
    """Run the shards in parallel; per shard its pytest summary line, exit status and seconds."""
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    procs = []
    for i, ids in enumerate(shards):
        log = (logs / f"lane_shard_{i}.log").open("w")
        procs.append(
            (subprocess.Popen([*PYTEST, *ids], stdout=log, stderr=subprocess.STDOUT, text=True), log)
        )
    rows = []
    for i, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
            rc = "timed out"
        log.close()
        lines = [ln for ln in (logs / f"lane_shard_{i}.log").read_text().splitlines() if ln.strip()]
        rows.append({"shard": i, "tests": len(shards[i]), "rc": rc, "seconds": round(time.time() - t0),
                     "summary": lines[-1] if lines else "(no output)"})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=4, help="parallel pytest processes")
    ap.add_argument("-k", dest="select", default=None, help="pytest -k expression")
    ap.add_argument(
        "--timeout", type=float, default=500.0, help="seconds before every shard still running is stopped"
    )
    ap.add_argument("--target", default=str(LANE), help="test file (default: the GPU lane)")
    ap.add_argument("--out", default=".", help="directory for gpu_lane.md and the shards' logs")
    args = ap.parse_args(argv)
    if args.shards < 1 or args.timeout <= 0:
        raise SystemExit(f"--shards must be >= 1 and --timeout > 0; got {args.shards}, {args.timeout}")
    ids = collect(Path(args.target), args.select)
    if not ids:
        raise SystemExit(f"no tests collected from {args.target} (-k {args.select!r})")
    out = Path(args.out)
    rows = run(split(ids, args.shards), args.timeout, out)
    ok = all(r["rc"] == 0 for r in rows)
    env = env_info()
    lines = [f"<!-- date: {env['date']}, commit: {env['commit']}, torch: {env['torch']}, "
             f"triton: {env.get('triton')}, gpu: {env.get('gpu')} -->",
             f"# GPU lane: {len(ids)} tests of {Path(args.target).name}"
             + (f" (-k {args.select!r})" if args.select else "")
             + f" in {len(rows)} parallel processes: {'every shard exited 0' if ok else 'NOT every shard exited 0'}", "",
             "| shard | tests | exit | seconds | pytest summary |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['shard']} | {r['tests']} | {r['rc']} | {r['seconds']} | {r['summary']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (out / "gpu_lane.md").write_text(text)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
