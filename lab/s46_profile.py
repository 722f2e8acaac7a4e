"""Where a steady-state decode step's GPU time goes, per kernel, inside the engine (CUDA graphs,
as served): torch.profiler's kernel records over K decode steps, summed per kernel name, with each
kernel's *exclusive* time (the part of its interval no earlier kernel covers: a merge launched as a
programmatic dependent waits inside stage 1's interval, so its plain duration overstates it), the
union of kernel intervals (device busy) and the step's wall time, next to its memory roofline.

    python lab/s46_profile.py SHAPE L BATCH KV [--no-pdl] [--steps K] [--tuning FIELD=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _harness import copy_bandwidth
from bench_engine import SHAPES, make_engine, model_dir, random_rotations, steady_tokens
from roofline import Roofline

from oscarkv.engine import SamplingParams
from oscarkv.kernels.triton.decode import planner


def short(name: str) -> str:
    for key in ("stage1", "merge", "quantize_pack", "rotate", "rms", "rope", "gemm", "gemv", "nvjet", "sm90",
                "elementwise", "reduce", "index", "copy", "cat", "softmax", "argmax", "fmha", "flash"):  # fmt: skip
        if key in name.lower():
            return key
    return name[:40]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("L", type=int)
    ap.add_argument("batch", type=int)
    ap.add_argument("kv")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--budget-gb", type=float, default=0)
    ap.add_argument(
        "--tuning", nargs="*", default=[], help="DecodeTuning fields for every plan, e.g. programs_few=2048"
    )
    a = ap.parse_args()
    if a.tuning:
        over = {k: type(getattr(planner.DEFAULT_TUNING, k))(v) for k, v in (x.split("=") for x in a.tuning)}
        inner = planner._plan
        planner._plan = lambda *args, **kw: inner(
            *args[:8], dataclasses.replace(args[8], **over), *args[9:], **kw
        )
    if a.no_pdl:
        facts = planner.device_facts
        planner.device_facts = lambda d: (facts(d)[0], False)
    bw = copy_bandwidth("cuda")
    root = Path(tempfile.mkdtemp())
    sh = SHAPES[a.shape]
    tokens = a.L + steady_tokens(a.steps, 4)
    mdir = model_dir(a.shape, root, tokens + 1)
    rot = random_rotations(sh["num_hidden_layers"], sh["head_dim"], root / "rot") if a.kv == "int2" else None
    ns = argparse.Namespace(device="cuda", backend="auto", max_batched_tokens=8192, graph_capture="lazy",
                            overlap="auto", max_running=str(a.batch), shape=a.shape)  # fmt: skip
    per_tok = 2 * sh["num_hidden_layers"] * sh["num_key_value_heads"] * sh["head_dim"] * 2
    budget = int(a.budget_gb * 2**30) or int(per_tok * tokens * a.batch * (1.15 if a.kv == "bf16" else 0.4))
    eng, _ = make_engine(ns, a.kv, mdir, rot, budget, tokens)
    rf = Roofline.of(eng, bw)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steady_tokens(a.steps, 4), temperature=0.0, ignore_eos=True)
    for _ in range(a.batch):
        eng.add_request(torch.randint(3, 2048, (a.L,), generator=g).tolist(), params)
    while rf.snapshot(eng.scheduler.running).batch < a.batch:
        eng.step()
    for _ in range(4):
        eng.step()
    torch.cuda.synchronize()
    snap = rf.snapshot(eng.scheduler.running)
    roof_ms = 1e3 * (rf.weights + snap.batch * rf.embed_row + snap.kv) / bw
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            eng.step()
        torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0) / a.steps
    trace = root / "t.json"
    prof.export_chrome_trace(str(trace))
    ev = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    ev.sort(key=lambda e: e["ts"])
    dur, excl, cnt = defaultdict(float), defaultdict(float), defaultdict(int)
    busy, reach = 0.0, float("-inf")
    for e in ev:
        s, t = e["ts"], e["ts"] + e["dur"]
        k = short(e["name"])
        dur[k] += e["dur"]
        cnt[k] += 1
        x = max(0.0, t - max(s, reach))
        excl[k] += x
        busy += x
        reach = max(reach, t)
    n = a.steps
    print(f"## {a.shape} L={a.L} batch={snap.batch} {a.kv} pdl={'off' if a.no_pdl else 'on'} {' '.join(a.tuning)}: wall {wall:.3f} ms/step, "
          f"device busy {busy / n / 1e3:.3f} ms, roofline {roof_ms:.3f} ms ({100 * roof_ms / wall:.0f}% of wall), "
          f"copy {bw / 1e9:.0f} GB/s")  # fmt: skip
    print("| kernel | launches/step | us/step (duration) | us/step (exclusive) | us per launch (excl) |")
    print("|---|---|---|---|---|")
    for k in sorted(excl, key=lambda k: -excl[k])[:14]:
        print(f"| {k} | {cnt[k] / n:.0f} | {dur[k] / n:.0f} | {excl[k] / n:.0f} | {excl[k] / cnt[k]:.1f} |")


if __name__ == "__main__":
    main()
