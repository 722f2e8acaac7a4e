"""Where the GPU time of one engine decode step goes: torch.profiler over decode-only steps, int2 at
the batch its budget holds vs bf16 at its own (random-weight Qwen3-8B, bench_engine's set-up).

    python lab/s39_step_trace.py OUT_DIR [JOBS_INT2 JOBS_BF16 PROMPT BUDGET_GB STEPS]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_engine import model_dir, random_rotations

import oscarkv.engine.model_runner as mrmod
from oscarkv.config import EngineConfig
from oscarkv.engine import Engine, SamplingParams
from oscarkv.engine import detok as detmod

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
jobs = {
    "int2": int(sys.argv[2]) if len(sys.argv) > 2 else 24,
    "bf16": int(sys.argv[3]) if len(sys.argv) > 3 else 8,
}
plen = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
budget = float(sys.argv[5]) if len(sys.argv) > 5 else 2.25
nsteps = int(sys.argv[6]) if len(sys.argv) > 6 else 20
root = Path(tempfile.mkdtemp())
dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run on the demo shape
mdir = model_dir("qwen3-8b" if dev == "cuda" else "demo", root, plen + 1025)
rot = random_rotations(36, 128, root / "rot") if dev == "cuda" else random_rotations(4, 128, root / "rot")
g = torch.Generator().manual_seed(0)


def timed(owner, name: str, key: str, acc: dict[str, float]):
    fn = getattr(owner, name)

    def wrap(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t

    setattr(owner, name, wrap)
    return wrap


for kv, n in jobs.items():
    cfg = EngineConfig(model=str(mdir), rotations=str(rot) if kv == "int2" else None, kv_dtype=kv, device=dev,
                       kv_budget_gb=budget, load_format="dummy", max_model_len=plen + 1025, max_running=n)  # fmt: skip
    eng = Engine(cfg)
    params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        eng.add_request(torch.randint(3, 2048, (plen,), generator=g).tolist(), params)
    while len(eng.scheduler.running) < n or eng.stats["prefill_tokens"] < n * plen:
        eng.step()
    for _ in range(30):  # graphs captured, steady state
        eng.step()
    ms = []
    for _ in range(64):
        t = time.perf_counter()
        eng.step()
        ms.append(1e3 * (time.perf_counter() - t))
    med = statistics.median(ms)
    slow = [(i, round(m, 1)) for i, m in enumerate(ms) if m > 1.2 * med]
    print(
        f"== {kv}: step ms p50 {med:.2f} mean {statistics.fmean(ms):.2f} max {max(ms):.1f}; slow steps {slow}"
    )
    # host phases: wall time inside each (a phase that syncs includes the GPU wait)
    acc: dict[str, float] = {}
    targets = [
        (eng.scheduler, "schedule", "schedule"),
        (eng.scheduler, "postprocess", "postprocess"),
        (eng.runner, "run", "runner.run (incl. GPU wait)"),
        (mrmod, "plan_decode_host", "  plan_decode_host"),
        (mrmod, "sample", "  sample (launch)"),
        (eng.runner.model, "logits", "  lm head (launch)"),
        (eng, "_output", "outputs"),
        (detmod.IncrementalDetokenizer, "add", "detok add"),
    ]
    if eng.runner.graphs is not None:
        targets.append((eng.runner.graphs, "run", "  graph copy+replay (launch)"))
    saved = [(o, n, getattr(o, n), timed(o, n, key, acc)) for o, n, key in targets]
    t0, k = time.perf_counter(), 32
    for _ in range(k):
        eng.step()
    total = time.perf_counter() - t0
    for o, attr, fn, _ in saved:
        if o is mrmod or isinstance(o, type):
            setattr(o, attr, fn)
    print(f"== {kv}: host phases, ms per step over {k} steps (step total {1e3 * total / k:.2f})")
    for key, v in acc.items():
        print(f"   {key:32s} {1e3 * v / k:7.3f}")
    if dev == "cpu":
        continue
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(nsteps):
            eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
    (out / f"trace_{kv}.txt").write_text(table)
    kern = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    tot = sum(e.self_device_time_total for e in kern) / nsteps / 1e3
    print(f"== {kv}: {n} running, GPU {tot:.2f} ms/step over {nsteps} steps")
    print(table[:6000])
    del eng
    torch.cuda.empty_cache()
