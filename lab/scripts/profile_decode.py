"""Run the Triton decode attention a few times on one shape, for a profiler (Nsight Compute).

    ncu --clock-control none --kernel-name regex:_stage1 --launch-skip 2 --launch-count 1 \\
        --set full -o prof python lab/scripts/profile_decode.py --batch 8 --len 32768

``--set KEY=VALUE`` overrides ``CONFIG`` entries of the kernel (ints, 0/1 for flags, or strings).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
import oscarkv.kernels.triton.decode_attention as tda
from _harness import config_value
from gpu_check import SINK_RECENT, make_pools

from oscarkv.quant import RowFormat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--len", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], help="CONFIG KEY=VALUE")
    args = ap.parse_args()
    for kv in args.set:
        key, val = kv.split("=", 1)
        if key not in tda.CONFIG:
            raise SystemExit(f"unknown CONFIG key {key!r}; known: {sorted(tda.CONFIG)}")
        tda.CONFIG[key] = config_value(val)
    hq, hkv, d = 32, 8, 128
    fmt = RowFormat(d, 2, d)
    lq = args.len - SINK_RECENT
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=torch.bfloat16)
    pools = make_pools(args.batch, lq, SINK_RECENT, hkv, d, fmt)
    for _ in range(args.runs):
        tda.decode_attention(q, *pools, 1 / math.sqrt(d), fmt, fmt, lens_hint=(lq, SINK_RECENT))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
