"""bf16 ``F.linear`` against the FP8 block-scaled paths at decode and prefill shapes: the Triton
weight-only kernel (``kernels.triton.fp8.fp8_linear``, what the engine runs) and, where the torch
build's cuBLAS runs it on SM90, the block-scaled ``scaled_mm`` (``engine.models.fp8.block_mm``).

Per shape and token count T: microseconds per call as CUDA-graph replays (how decode steps run),
each side's weight bytes over the copy bandwidth (% of that roofline), and the FP8 output's relative
error against fp32 ``x Wᵀ`` with the dequantized weight.

    python lab/fp8_gemm.py [--iters 200] [--tokens 1,4,16,64,256,2048]
    python lab/fp8_gemm.py --sweep      # the best Fp8Tuning per shape and T, dense and experts
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _harness import copy_bandwidth

from oscarkv.engine.models.fp8 import _block_gemm_fails, block_mm, dequantize_blocks, quantize_blocks
from oscarkv.kernels.triton.fp8 import Fp8Tuning, fp8_linear, fp8_moe_experts

# (out, in): a 4096-square projection; GLM-4.5-Air's fused q|k|v, its o_proj, one expert's gate|up and down
SHAPES = {"4096x4096": (4096, 4096), "air qkv": (14336, 4096), "air o": (4096, 12288),
          "air w13": (2816, 4096), "air w2": (4096, 1408)}  # fmt: skip


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
    ap.add_argument("--tokens", default="1,4,16,64,256,2048")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if args.sweep:
        sweep(args.iters)
        return
    cublas = not _block_gemm_fails(0) if torch.cuda.get_device_capability()[0] == 9 else False
    bw = copy_bandwidth("cuda")
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy {bw / 1e9:.0f} GB/s, cuBLAS block-scaled: {cublas}"
    )
    print(
        "| shape | T | bf16 us | fp8 triton us | fp8/bf16 | bf16 % roof | fp8 % roof | cuBLAS fp8 us | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        q, s = quantize_blocks(0.02 * torch.randn(n, k, generator=g))
        w = dequantize_blocks(q, s, torch.bfloat16).cuda()
        wd = dequantize_blocks(q, s, torch.float32).cuda()
        q = q.cuda()
        s_pad = torch.nn.functional.pad(s, (0, -s.shape[1] % 4)).cuda()
        for t in [int(v) for v in args.tokens.split(",")]:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wd.T
            err = float((fp8_linear(x, q, s_pad).float() - ref).norm() / ref.norm())
            b = timed(lambda x=x, w=w: torch.nn.functional.linear(x, w), args.iters, True)
            f = timed(lambda x=x, q=q, s=s_pad: fp8_linear(x, q, s), args.iters, True)
            c = (
                f"{timed(lambda x=x, q=q, s=s_pad: block_mm(x, q, s), args.iters, True):.1f}"
                if cublas
                else "-"
            )
            rb, rf = 2 * n * k / bw * 1e6, (n * k + s_pad.numel() * 4) / bw * 1e6
            print(f"| {name} | {t} | {b:.1f} | {f:.1f} | {f / b:.2f} | {rb / b:.0%} | {rf / f:.0%} | {c} | {err:.4f} |",
                  flush=True)  # fmt: skip


def variants(small: bool) -> dict[str, Fp8Tuning]:
    if small:
        return {f"bn{bn} pps{p} st{st}": Fp8Tuning(bn_small=bn, programs_per_sm=p, stages_small=st)
                for bn in (32, 64, 128) for p in (0, 2, 4) for st in (4,)}  # fmt: skip
    return {f"bm{bm} bn{bn} w{w} st{st}": Fp8Tuning(bm_large=bm, bn_large=bn, warps_large=w, stages_large=st)
            for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for st in (3,)}  # fmt: skip


def sweep(iters: int) -> None:
    """Per (shape, T): the default's us, the best variant and its us, as % of the FP8 weight roofline."""
    bw = copy_bandwidth("cuda")
    print(
        "| shape | T | default us | best | best us | default % roof | best % roof |\n|---|---|---|---|---|---|---|"
    )
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        q, s = quantize_blocks(0.02 * torch.randn(n, k, generator=g))
        q, s = q.cuda(), torch.nn.functional.pad(s, (0, -s.shape[1] % 4)).cuda()
        for t in (1, 16, 64, 256, 2048):
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            res = {
                v: timed(lambda x=x, tu=tu: fp8_linear(x, q, s, tu), iters, True)  # noqa: B023 (called at once)
                for v, tu in variants(t <= 64).items()
            }
            res["default"] = timed(lambda x=x: fp8_linear(x, q, s), iters, True)  # noqa: B023
            _row(name, t, res, (n * k + s.numel() * 4) / bw * 1e6)
    # GLM-4.5-Air's routed experts: 128 experts, hidden 4096, width 1408, top-8
    e, h, i, top = 128, 4096, 1408, 8
    w13, s13 = quantize_blocks(0.02 * torch.randn(e, 2 * i, h, device="cuda"))
    w2, s2 = quantize_blocks(0.02 * torch.randn(e, h, i, device="cuda"))
    s2 = torch.nn.functional.pad(s2, (0, -s2.shape[-1] % 4))
    for t in (1, 4, 16, 64, 256):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda")[:top] for _ in range(t)])
        wts = torch.rand(t, top, device="cuda")
        touched = int(ids.unique().numel())
        args = (x, w13, s13, w2, s2, wts, ids)
        res = {
            v: timed(lambda tu=tu: fp8_moe_experts(*args, tuning=tu), iters, True)  # noqa: B023
            for v, tu in variants(t * top <= 64).items()
        }
        res["default"] = timed(lambda: fp8_moe_experts(*args), iters, True)  # noqa: B023
        _row(f"air experts ({touched} touched)", t, res, touched * 3 * h * i / bw * 1e6)


def _row(name: str, t: int, res: dict[str, float], roof_us: float) -> None:
    best = min((v for v in res if v != "default"), key=res.get)
    d, b = res["default"], res[best]
    print(
        f"| {name} | {t} | {d:.1f} | {best} | {b:.1f} | {roof_us / d:.0%} | {roof_us / b:.0%} |", flush=True
    )


if __name__ == "__main__":
    main()
