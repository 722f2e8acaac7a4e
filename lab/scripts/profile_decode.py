"""Run the Triton decode attention a few times on one shape, for a profiler (Nsight Compute).

    ncu --clock-control none --kernel-name regex:stage1 --launch-skip 2 --launch-count 1 \\
        --set full -o prof python lab/scripts/profile_decode.py --batch 8 --len 4096

Qwen3-8B's attention (32/8 heads, d 128), contiguous per-sequence slot ranges (``gpu_check``'s
pools); ``--tuning FIELD=VALUE`` overrides fields of ``DecodeTuning`` (ints, floats, True/False).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: gpu_check
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lab/: decode_b1's parse_change
from decode_b1 import parse_change
from gpu_check import SINK_RECENT, make_pools

from oscarkv.kernels.triton import decode as tdec
from oscarkv.quant import RowFormat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tuning", default="default", help="FIELD=VALUE[+FIELD=VALUE...] of DecodeTuning")
    args = ap.parse_args()
    hq, hkv, d = 32, 8, 128
    fmt = RowFormat(d, 2, d)
    lq = args.len - SINK_RECENT
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=torch.bfloat16)
    pools = make_pools(args.batch, lq, SINK_RECENT, hkv, d, fmt)
    tuning = dataclasses.replace(tdec.DEFAULT_TUNING, **parse_change(args.tuning))
    plan = tdec.plan(args.batch, hq, hkv, d, (lq, SINK_RECENT), q.device, tuning)
    print(f"plan: loop {plan.lp.loop}, grid {plan.grid}", flush=True)
    for _ in range(args.runs):
        tdec.decode_attention(q, *pools, 1 / math.sqrt(d), fmt, fmt, lens_hint=(lq, SINK_RECENT), plan=plan)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
