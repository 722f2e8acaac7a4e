"""Where an eager ``model.generate`` decode step spends its time, with OscarCache (and optionally
BF16 DynamicCache): torch.profiler over a few decode steps after a warm-up.

Prints per step: wall time, GPU busy time (sum of kernel durations; one stream), and host time in
oscarkv's own stages (labelled here by wrapping them; the library has no profiler hooks), then the
top ops by host time and by GPU time. Run on the GPU machine:

    python lab/scripts/profile_e2e.py [--batch 16] [--context 32768] [--new 8] [--caches oscar,bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
from _harness import save
from calibration_speed import QWEN3_8B
from e2e_decode import decode, prefill, warm_kernels

from oscarkv.calibration.fit import fixed_layer
from oscarkv.hf import OscarCache
from oscarkv.hf.cache import OscarCacheLayer
from oscarkv.hf.pools import LayerPools
from oscarkv.hf.slots import SlotTable
from oscarkv.rotation import RotationSet

#: oscarkv stages timed on the host: (owner, attribute, label)
STAGES = [
    (OscarCacheLayer, "attend", "oscarkv.attend"),
    (LayerPools, "apply", "oscarkv.pools.apply"),
    (LayerPools, "demote", "oscarkv.pools.demote"),
    (SlotTable, "plan", "oscarkv.plan"),
]


def _labelled(fn, label: str):
    @functools.wraps(fn)
    def run(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    return run


def label_stages(cache: OscarCache) -> list[str]:
    """Wrap oscarkv's stages (and the cache's kernel ops) in profiler ranges; returns the labels."""
    for owner, name, label in STAGES:
        if hasattr(owner, name):  # LayerPools.demote is newer than the other stages
            setattr(owner, name, _labelled(getattr(owner, name), label))
    ops = cache.ops
    # kernel ops that exist in this build (older ones lack the rotations)
    names = [
        n for n in ("decode_attention", "quantize_pack", "rotate_heads", "rotate_new_rows") if hasattr(ops, n)
    ]
    cache.ops = dataclasses.replace(ops, **{n: _labelled(getattr(ops, n), f"oscarkv.{n}") for n in names})
    return [s[2] for s in STAGES if hasattr(s[0], s[1])] + [f"oscarkv.{n}" for n in names]


def profile_steps(model, ids, cache, new: int, labels: list[str], rows: int) -> dict:
    decode(model, ids, cache, 2)  # warm-up: first steps, allocator, kernels
    ids = torch.cat([ids, ids[:, -2:]], 1)  # the two tokens just generated stand in (speed only)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = decode(model, ids, cache, new)
    ev = prof.key_averages()
    # kernels only: the labelled host ranges are mirrored on the device timeline too
    gpu_us = sum(e.self_device_time_total for e in ev if not e.key.startswith("oscarkv."))
    per = {"wall_ms": 1e3 * wall / new, "gpu_busy_ms": gpu_us / 1e3 / new}
    for e in ev:  # a label has a host entry and a device-side mirror (no host time): keep the host one
        if e.key in labels and e.cpu_time_total / 1e3 / new >= per.get(e.key + " host_ms", 0.0):
            per[e.key + " host_ms"] = e.cpu_time_total / 1e3 / new
            per[e.key + " calls"] = e.count / new
    by_cpu = ev.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    by_gpu = ev.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)
    return {"per_step": per, "by_cpu": by_cpu, "by_gpu": by_gpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--caches", default="oscar", help="comma list of oscar, bf16")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**QWEN3_8B)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.context), device="cuda")
    rots = RotationSet({i: fixed_layer("hadamard", 128, 8, "layer") for i in range(cfg.num_hidden_layers)})
    warm_kernels(args.batch, args.context, cfg)
    out, md = {}, [f"# Eager decode step profile: random-weight Qwen3-8B, batch {args.batch}, "
                   f"context {args.context}, {args.new} profiled steps", ""]  # fmt: skip
    for name in args.caches.split(","):
        torch.cuda.empty_cache()
        if name == "bf16":
            cache, labels = DynamicCache(), []
        else:
            cache = OscarCache.from_rotations(model, rots)
            labels = label_stages(cache)
        t0 = time.perf_counter()
        prefill(model, ids, cache, args.chunk)
        torch.cuda.synchronize()
        print(f"{name}: prefill {time.perf_counter() - t0:.1f} s", flush=True)
        r = profile_steps(model, ids, cache, args.new, labels, args.rows)
        out[name] = r["per_step"]
        md += [f"## {name}", "", "| per decode step | value |", "|---|---|"]
        md += [f"| {k} | {v:.3f} |" for k, v in r["per_step"].items()]
        md += ["", "```", r["by_cpu"], "```", "", "```", r["by_gpu"], "```", ""]
        print("\n".join(md[-9 - len(r["per_step"]) :]), flush=True)
        del cache
    save("profile_e2e", {"args": vars(args), "per_step": out}, "\n".join(md))


if __name__ == "__main__":
    main()
