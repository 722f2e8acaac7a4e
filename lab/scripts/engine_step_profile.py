"""Where an engine decode step goes: N requests decoding at once on random Qwen3-8B-shape weights,
time per phase (schedule, runner.run split into plan and the rest, postprocess+detok) with CUDA
syncs, then torch.profiler over a few steps (top ops by self CPU and by CUDA time).

    PYTHONPATH=src python lab/scripts/engine_step_profile.py [--kv int2] [--running 44] [--ctx 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_engine import SHAPES, model_dir, random_rotations

from oscarkv.config import EngineConfig
from oscarkv.engine import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="int2")
    ap.add_argument("--running", type=int, default=44)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    shape = SHAPES["qwen3-8b"]
    root = Path(tempfile.mkdtemp())
    mdir = model_dir("qwen3-8b", root, args.ctx + 512)
    rot = (
        random_rotations(shape["num_hidden_layers"], shape["head_dim"], root / "rot")
        if args.kv == "int2"
        else None
    )
    cfg = EngineConfig(model=str(mdir), rotations=str(rot) if rot else None, kv_dtype=args.kv, device="cuda",
                       load_format="dummy", max_model_len=args.ctx + 512, max_running=args.running,
                       kv_budget_gb=20)  # fmt: skip
    eng = Engine(cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(args.running):
        p = torch.randint(3, 2048, (args.ctx,), generator=g).tolist()
        eng.add_request(p, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    while eng.scheduler.waiting or any(len(s.out) == 0 for s in eng.scheduler.running):
        eng.step()
    for _ in range(10):
        eng.step()
    runner, sched = eng.runner, eng.scheduler
    t_sched, t_run, t_post, t_all = [], [], [], []
    orig_run = runner.run
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        toks = orig_run(batch)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        sched.postprocess(batch, toks)
        t3 = time.perf_counter()
        t_sched.append(t1 - t0)
        t_run.append(t2 - t1)
        t_post.append(t3 - t2)
    # a full engine step, unsynced inside (as the benchmark runs it)
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        t_all.append(time.perf_counter() - t0)
    # the graph replay alone
    ms = lambda xs: f"{1e3 * statistics.median(xs):.2f} ms"  # noqa: E731
    print(f"{args.kv} running {len(sched.running)} ctx ~{args.ctx}: schedule {ms(t_sched)}, runner.run {ms(t_run)}, "
          f"postprocess {ms(t_post)}, engine.step {ms(t_all)}")  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    print(ka.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
