"""Experiment: where the MoE block's time goes at 1-8 tokens, and how the fused small-batch
kernel's tiles move it. CUDA-graph replays of (a) the router alone, (b) the fused experts alone
per tuning, (c) the whole block, against the bytes each reads once (``benchmarks/moe_block.py``).

    python lab/moe_small.py --shapes qwen3-30b-a3b,glm-4.5-air --tokens 1,2,4,8
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _harness import copy_bandwidth
from moe_block import SHAPES, build, timed

from oscarkv.engine.models.moe import route
from oscarkv.kernels.triton.moe import MoeTuning, moe_experts


def graph_of(fn, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        fn()
    return timed(g.replay, reps)


def tunings(args: argparse.Namespace) -> list[MoeTuning]:
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    grid = itertools.product(
        ints(args.up_bn), ints(args.down_bn), ints(args.bk), ints(args.down_bk), ints(args.warps)
    )
    return [MoeTuning(up_bn=ub, down_bn=db, bk=bk, down_bk=dk, num_warps=nw) for ub, db, bk, dk, nw in grid]


def measure(moe, w13, w2, routing, x, bw: float, per_expert: int, router: int, args) -> None:
    wts, ids = route(routing, x, moe.gate, moe.correction)
    touched = int(ids.unique().numel())
    r_ms = graph_of(lambda: route(routing, x, moe.gate, moe.correction), args.reps)
    b_ms = graph_of(lambda: moe(x), args.reps)  # the engine's router and experts (moe_block.build)
    roof_e = touched * per_expert / bw * 1e3
    print(f"\n## {x.shape[0]} tokens, {touched} experts: block {b_ms * 1e3:.0f} µs "
          f"(roofline {(roof_e + router / bw * 1e3) * 1e3:.0f}), router {r_ms * 1e3:.0f} µs "
          f"(roofline {router / bw * 1e6:.1f}), experts roofline {roof_e * 1e3:.1f} µs")  # fmt: skip
    res = []
    for tu in tunings(args):
        try:
            ms = graph_of(lambda tu=tu: moe_experts(x, w13, w2, wts, ids, tu), args.reps)
        except Exception as e:  # a tile the compiler refuses
            print(f"  {tu}: {type(e).__name__}")
            continue
        res.append((ms, tu))
    res.sort(key=lambda r: r[0])
    default = next((ms for ms, tu in res if tu == MoeTuning()), float("nan"))
    print(f"experts, default tiles: {default * 1e3:.0f} µs ({roof_e / default:.0%})")
    for ms, tu in res[:6]:
        print(f"  {ms * 1e3:6.1f} µs {roof_e / ms:4.0%}  up_bn {tu.up_bn} down_bn {tu.down_bn} "
              f"bk {tu.bk} down_bk {tu.down_bk} warps {tu.num_warps}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b,glm-4.5-air")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--up-bn", default="8,16,32")
    ap.add_argument("--down-bn", default="4,8,16,32")
    ap.add_argument("--bk", default="64,128,256")
    ap.add_argument("--down-bk", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e9:.0f} GB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        h, _, _, _, _, routing = SHAPES[shape]
        print(f"\n# {shape}")
        moe = build(shape, "fused")
        ex = moe.experts
        w13, w2 = ex.w13.method.stacked(ex.w13), ex.w2.method.stacked(ex.w2)
        per_expert = (w13[0].numel() + w2[0].numel()) * 2
        router = moe.gate.numel() * 2
        for t in ints(args.tokens):
            x = torch.randn(t, h, generator=g, device="cuda", dtype=torch.bfloat16)
            measure(moe, w13, w2, routing, x, bw, per_expert, router, args)
        del moe, w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
