"""bf16 ``F.linear`` against the FP8 block-scaled path (``oscarkv.engine.models.fp8.block_mm``) at
decode shapes, on an SM90 GPU: a 4096x4096 projection and a GLM-4.5-Air-like expert (hidden 4096,
expert width 1408: ``w13 [2816, 4096]``, ``w2 [4096, 1408]``).

Per shape and token count T: microseconds per call of bf16, of the whole FP8 path (per-token
activation quantization + ``scaled_mm``) and of ``scaled_mm`` alone on pre-quantized activations,
each timed eagerly and as CUDA-graph replays (how the engine's decode steps run); and the FP8
output's relative error against fp32 ``x Wᵀ`` with the dequantized weight.

    python lab/fp8_gemm.py [--iters 200]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.nn.functional import ScalingType, scaled_mm

from oscarkv.engine.models.fp8 import block_mm, dequantize_blocks, quantize_activations, quantize_blocks

SHAPES = {"4096x4096": (4096, 4096), "air w13": (2816, 4096), "air w2": (4096, 1408)}  # (out, in)
TOKENS = (1, 2, 4, 8, 16, 32, 64)


def timed(fn, iters: int, graph: bool) -> float:
    """Microseconds per call of ``fn()``: eager back to back, or ``iters`` calls captured in one graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    else:

        def run() -> None:
            for _ in range(iters):
                fn()

    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / iters)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("needs an SM90 (Hopper) GPU: cuBLAS's 1x128 by 128x128 block scaling is SM90-only")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    print("us per call (best of 5 x iters); rel err: FP8 output vs fp32 x W^T with the dequantized weight")
    head = f"{'shape':>10} {'T':>3} | {'mode':>5} | {'bf16':>7} {'fp8':>7} {'mm only':>7} {'fp8/bf16':>8} | {'rel err':>7}"
    print(head)
    print("-" * len(head))
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        q, s = quantize_blocks(0.02 * torch.randn(n, k, generator=g))
        w = dequantize_blocks(q, s, torch.bfloat16).cuda()
        wd = dequantize_blocks(q, s, torch.float32).cuda()
        q = q.cuda()
        s_pad = torch.nn.functional.pad(s, (0, -s.shape[1] % 4)).cuda()
        for t in TOKENS:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            for mode, us, err in bench(x, w, wd, q, s_pad, args.iters):
                print(f"{name:>10} {t:>3} | {mode:>5} | {us[0]:7.1f} {us[1]:7.1f} {us[2]:7.1f} "
                      f"{us[1] / us[0]:8.2f} | {err:7.4f}")  # fmt: skip


def bench(x, w, wd, q, s_pad, iters: int) -> list[tuple[str, list[float], float]]:
    """``(mode, [bf16, fp8, mm only] us, rel err)`` for eager and graph timing."""
    xq, xs = quantize_activations(x)
    ref = x.float() @ wd.T
    err = float((block_mm(x, q, s_pad).float() - ref).norm() / ref.norm())
    fns = (
        lambda: torch.nn.functional.linear(x, w),
        lambda: block_mm(x, q, s_pad),
        lambda: scaled_mm(xq, q.t(), xs, ScalingType.BlockWise1x128, s_pad.t(), ScalingType.BlockWise128x128,
                          output_dtype=torch.bfloat16),
    )  # fmt: skip
    return [(mode, [timed(f, iters, mode == "graph") for f in fns], err) for mode in ("eager", "graph")]


if __name__ == "__main__":
    main()
