"""Run the Triton quantize_pack a few times on one shape, for a profiler (Nsight Compute).

    ncu --clock-control none --kernel-name regex:_quantize_pack --launch-skip 2 --launch-count 1 \\
        --set full -o prof python lab/scripts/profile_quantize.py --rows 65536 --rotate layer

Rows are bf16 ``[rows / 8, 8, 128]`` (Qwen3-8B's KV heads), clip 0.96 unless ``--clip``.
"""

from __future__ import annotations

import argparse

import torch

from oscarkv.kernels.triton import quantize_pack as tqp
from oscarkv.quant import RowFormat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--rotate", choices=("none", "layer"), default="none")
    ap.add_argument("--clip", type=float, default=0.96)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    fmt = RowFormat(128, 2, 128, clip=args.clip)
    x = torch.randn(args.rows // 8, 8, 128, device="cuda").bfloat16()
    r = torch.linalg.qr(torch.randn(128, 128, device="cuda"))[0] if args.rotate == "layer" else None
    for _ in range(args.runs):
        tqp.quantize_pack(x, r, fmt)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
