"""Run the GPU lane (``tests/test_kernels_gpu.py``) as several pytest processes in parallel on one
GPU, and write a summary.

On a fresh GPU machine every kernel specialization compiles on first use, and compiling is CPU
work: one process took over 10 minutes for the whole lane in session 14 (more than one device
call allows), four processes in parallel 178 s in session 12. The test ids are split into
contiguous shards, so that parametrizations of one test (which share compiled kernels) stay in
one process. Each shard stops at ``--timeout`` seconds, so its partial result still comes back.

    python scripts/gpu_lane.py [--shards 4] [-k EXPR] [--timeout 500] [--out DIR]

The lane passes only if every shard exits 0, at least one test passed, and every skip is an
expected one (``--allow-skip``, a regular expression over pytest's skip reasons; by default the
forced-loop cases a shape does not take): a machine without CUDA, or a capability check that
skips, fails it. ``gpu_lane.md`` records the commit, the totals, every skip reason and the verdict.

Exit status: 0 if the lane passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # _harness
from _harness import env_info

LANE = Path(__file__).resolve().parents[1] / "tests" / "test_kernels_gpu.py"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
#: skips the lane expects: a forced loop (``PLANES``) that a shape does not take
EXPECTED_SKIPS = r"this shape takes the \w+ loop"


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


def tally(logs: Path, n_shards: int) -> tuple[dict[str, int], list[str]]:
    """Totals of pytest's outcomes over the shards' logs and every skip reason (one per skipped test)."""
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    reasons = []
    for i in range(n_shards):
        text = (logs / f"lane_shard_{i}.log").read_text()
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", last[0]):
            totals[kind] += int(n)
        for m in re.finditer(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", text, re.M):
            reasons += [m.group(2)] * int(m.group(1))
    return totals, reasons


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=4, help="parallel pytest processes")
    ap.add_argument("-k", dest="select", default=None, help="pytest -k expression")
    ap.add_argument(
        "--timeout", type=float, default=500.0, help="seconds before every shard still running is stopped"
    )
    ap.add_argument("--target", default=str(LANE), help="test file (default: the GPU lane)")
    ap.add_argument("--out", default=".", help="directory for gpu_lane.md and the shards' logs")
    ap.add_argument("--allow-skip", default=EXPECTED_SKIPS, help="regex of the skip reasons the lane expects")
    args = ap.parse_args(argv)
    if args.shards < 1 or args.timeout <= 0:
        raise SystemExit(f"--shards must be >= 1 and --timeout > 0; got {args.shards}, {args.timeout}")
    ids = collect(Path(args.target), args.select)
    if not ids:
        raise SystemExit(f"no tests collected from {args.target} (-k {args.select!r})")
    out = Path(args.out)
    rows = run(split(ids, args.shards), args.timeout, out)
    totals, reasons = tally(out, len(rows))
    unexpected = sorted({r for r in reasons if not re.search(args.allow_skip, r)})
    problems = [f"shard {r['shard']} exited {r['rc']}" for r in rows if r["rc"] != 0]
    problems += ["no test passed"] if totals["passed"] == 0 else []
    problems += [f"unexpected skip: {r}" for r in unexpected]
    env = env_info()
    verdict = "PASSED" if not problems else "FAILED: " + "; ".join(problems)
    expected = sum(r not in unexpected for r in reasons)
    where = f"{len(ids)} tests of {Path(args.target).name}" + (
        f" (-k {args.select!r})" if args.select else ""
    )
    lines = [f"<!-- date: {env['date']}, commit: {env['commit']}, torch: {env['torch']}, "
             f"triton: {env.get('triton')}, gpu: {env.get('gpu')} -->",
             f"# GPU lane at {env['commit']}: {verdict}", "",
             f"{where} in {len(rows)} parallel processes: {totals['passed']} passed, {totals['failed']} failed, "
             f"{totals['error']} errors, {totals['skipped']} skipped ({expected} expected).", "",
             "| shard | tests | exit | seconds | pytest summary |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['shard']} | {r['tests']} | {r['rc']} | {r['seconds']} | {r['summary']} |" for r in rows]
    if reasons:
        counts: dict[str, int] = {}
        for r in reasons:
            counts[r] = counts.get(r, 0) + 1
        lines += ["", "Skips:", ""] + [f"- {n} × {r}" for r, n in sorted(counts.items())]
    text = "\n".join(lines) + "\n"
    (out / "gpu_lane.md").write_text(text)
    print(text, flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
