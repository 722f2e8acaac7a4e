"""Experiment: bf16 routed experts through the FP8 kernel's gathered GEMM (``_fp8_mm`` with unit
block scales; the kernel widens its weight tile to the activations' dtype, a no-op for bf16), against
the engine's grouped and fused paths, at decode sizes. CUDA-graph replays of the whole MoE block,
against the roofline of ``benchmarks/moe_block.py`` (distinct experts touched + router, read once).

    python lab/moe_bf16_kernel.py --shapes qwen3-30b-a3b --tokens 1,2,4,8,16,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _harness import copy_bandwidth
from moe_block import SHAPES, build, graph_ms

from oscarkv.engine.models.moe import route
from oscarkv.kernels.triton import fp8 as F


def bf16_through_fp8_kernel(moe) -> None:
    """Route the block's bf16 experts through ``fp8_moe_experts`` with unit scales."""
    ex = moe.experts
    w13, w2 = ex.w13.method.stacked(ex.w13).contiguous(), ex.w2.method.stacked(ex.w2).contiguous()
    e = w13.shape[0]
    ones = lambda w: torch.ones(e, -(-w.shape[1] // 128), -(-w.shape[2] // 128), device="cuda")  # noqa: E731
    s13, s2 = ones(w13), ones(w2)
    check = F._check_scales
    F._check_scales = lambda w, s, what: None if w.dtype == torch.bfloat16 else check(w, s, what)
    ex.w13.weight_scale_inv = ex.w2.weight_scale_inv = None  # read by the forward, unused here
    ex.fp8 = lambda x, _a, _sa, _b, _sb, weights, ids: F.fp8_moe_experts(x, w13, s13, w2, s2, weights, ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,2,4,8,16,64")
    ap.add_argument("--paths", default="grouped,fused,kernel")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e9:.0f} GB/s")
    print("| shape | path | tokens | experts | µs | roofline µs | % |\n|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        h, _, _, _, _, routing = SHAPES[shape]
        for path in args.paths.split(","):
            moe = build(shape, "grouped" if path == "kernel" else path)
            if path == "kernel":
                bf16_through_fp8_kernel(moe)
            nbytes = {n: p.numel() * p.element_size() for n, p in moe.named_parameters()}
            per_expert = (
                sum(v for n, v in nbytes.items() if n.startswith("experts.")) / moe.experts.w13.lead[0]
            )
            fixed = sum(v for n, v in nbytes.items() if not n.startswith("experts."))
            for t in [int(v) for v in args.tokens.split(",")]:
                x = torch.randn(t, h, generator=g, device="cuda", dtype=torch.bfloat16)
                _, ids = route(routing, x, moe.gate, moe.correction)
                touched = int(ids.unique().numel())
                ms = graph_ms(moe, x, args.reps)
                roof = (touched * per_expert + fixed) / bw * 1e3
                print(f"| {shape} | {path} | {t} | {touched} | {ms * 1e3:.0f} | {roof * 1e3:.0f} | {roof / ms:.0%} |",
                      flush=True)  # fmt: skip
            del moe
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
