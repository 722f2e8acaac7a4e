"""One mixture-of-experts block of the engine (``engine/models/moe.py``) against its rooflines.

Random weights of each model's real MoE layer (bf16, or FP8 128x128 block-scaled with path
``fp8``), random inputs, the engine's router and experts (paths ``fused`` and ``fp8`` take the
fused router up to the backend's ``moe_small_tokens``, as the engine does; ``grouped`` the eager one). Decode sizes (``T`` tokens, each routed to ``k`` experts) run as CUDA-graph replays; the
memory roofline is the bytes of the distinct experts the step's tokens chose (counted from the
routing of that very input), the router and the shared experts, read once, over the device's copy
bandwidth measured in the same run. Prefill sizes run eagerly against the FLOP bound: ``2·T·k·3·H·I``
(+ shared experts) over the bf16 GEMM rate measured in the same run (an 8192³ ``torch.mm``).

    python benchmarks/moe_block.py                       # every shape, both paths
    python benchmarks/moe_block.py --shapes qwen3-30b-a3b --tokens 1,8,64
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import copy_bandwidth, save

from oscarkv.engine.models.fp8 import Fp8Block
from oscarkv.engine.models.layers import SiluAndMul
from oscarkv.engine.models.linear import Linear, Unquantized
from oscarkv.engine.models.moe import DenseMLP, Experts, Routing, SparseMoe, route
from oscarkv.kernels import resolve

#: (hidden, expert width, experts, top-k, shared width, routing)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0, Routing("softmax", 8, True)),
    "glm-4.5-air": (4096, 1408, 128, 8, 1408, Routing("sigmoid", 8, True, scale=1.0, fp32_logits=True)),
    "minimax-m2": (3072, 1536, 256, 8, 0, Routing("sigmoid", 8, True)),
}


def build(shape: str, path: str) -> SparseMoe:
    """The block with random weights: bf16 (paths ``grouped``, ``fused``), or FP8 128x128
    block-scaled experts and shared experts (path ``fp8``, the Triton FP8 kernels)."""
    h, i, e, _, shared, routing = SHAPES[shape]
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    method = Fp8Block() if path == "fp8" else Unquantized()
    ex = Experts(e, h, i, method, names=("gate_proj", "up_proj", "down_proj"), **kw)
    sh = DenseMLP(h, shared, False, method, SiluAndMul(), **kw) if shared else None
    moe = SparseMoe(h, routing, ex, sh, bias_name="bias" if routing.kind == "sigmoid" else None, **kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for n, p in moe.named_parameters():
            if p.dtype != torch.float8_e4m3fn and not n.endswith("weight_scale_inv"):
                p.normal_(0.0, 0.02, generator=g)
        for mod in moe.modules():
            if isinstance(mod, Linear) and path == "fp8":
                mod.method.fill_dummy(mod, g)
                mod.finish(resolve("triton", "cuda"))
    ex.grouped = True
    ops = resolve("triton", "cuda")
    if path == "fused":  # the fused small-batch kernel at every size
        ex.small, ex.small_tokens = ops.moe_experts, 1 << 30
    if path == "fp8":
        ex.fp8 = ops.fp8_moe_experts
    if path != "grouped":  # the fused router where the engine takes it
        moe.fast_route, moe.fast_route_tokens = ops.route_topk, ops.moe_small_tokens
    return moe.eval().requires_grad_(False)


def timed(fn, reps: int) -> float:
    """Median ms of ``reps`` calls (CUDA events)."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def graph_ms(moe: SparseMoe, x: torch.Tensor, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            moe(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        moe(x)
    return timed(g.replay, reps)


def mm_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of an ``n³`` ``torch.mm``."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / (timed(lambda: torch.mm(a, a), 10) * 1e-3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--prefill", default="512,2048,8192")
    ap.add_argument("--paths", default="grouped,fused",
                    help="grouped GEMMs, the fused small-batch kernel, or fp8 (FP8 weights, Triton FP8 kernels)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--name", default="moe_block")
    args = ap.parse_args(argv)
    bw = copy_bandwidth("cuda")
    flops = mm_rate()
    print(f"copy {bw / 1e9:.0f} GB/s (read+write), bf16 mm {flops / 1e12:.0f} TFLOP/s", flush=True)
    rows, payload = [], {"copy_Bps": bw, "mm_flops": flops, "results": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        h, inter, _, k, shared, routing = SHAPES[shape]
        for path in args.paths.split(","):
            moe = build(shape, path)
            nbytes = {n: p.numel() * p.element_size() for n, p in moe.named_parameters()}
            per_expert = (
                sum(b for n, b in nbytes.items() if n.startswith("experts.")) / moe.experts.w13.lead[0]
            )
            fixed = sum(b for n, b in nbytes.items() if not n.startswith("experts."))
            for t in [int(v) for v in args.tokens.split(",")]:
                x = torch.randn(t, h, generator=g, device="cuda", dtype=torch.bfloat16)
                _, ids = route(routing, x, moe.gate, moe.correction)
                touched = int(ids.unique().numel())
                ms = graph_ms(moe, x, args.reps)
                roof = (touched * per_expert + fixed) / bw * 1e3
                r = dict(
                    shape=shape, path=path, tokens=t, experts=touched, ms=ms, roofline_ms=roof, frac=roof / ms
                )
                payload["results"].append(r)
                rows.append(
                    f"| {shape} | {path} | {t} | {touched} | {ms * 1e3:.0f} | {roof * 1e3:.0f} | {roof / ms:.0%} |"
                )
                print(rows[-1], flush=True)
            for t in [int(v) for v in args.prefill.split(",") if v]:
                x = torch.randn(t, h, generator=g, device="cuda", dtype=torch.bfloat16)
                with torch.no_grad():
                    ms = timed(lambda x=x, m=moe: m(x), max(5, args.reps // 5))
                work = 2 * t * (k * 3 * h * inter + 3 * h * shared)
                bound = work / flops * 1e3
                r = dict(shape=shape, path=path, tokens=t, ms=ms, flop_bound_ms=bound, frac=bound / ms,
                         tok_s=t / ms * 1e3)  # fmt: skip
                payload["results"].append(r)
                rows.append(
                    f"| {shape} | {path} | {t} (prefill) | - | {ms * 1e3:.0f} | {bound * 1e3:.0f} (FLOPs) | {bound / ms:.0%} |"
                )
                print(rows[-1], flush=True)
            del moe
            torch.cuda.empty_cache()
    head = (f"One MoE block, {args.paths}, {torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s, bf16 mm "
            f"{flops / 1e12:.0f} TFLOP/s. Decode rows: CUDA-graph replays against the bytes of the distinct "
            f"experts chosen (+ router, shared experts). Prefill rows: eager, against the FLOP bound.")  # fmt: skip
    table = "| shape | path | tokens | experts touched | µs | roofline µs | % of roofline |\n|---|---|---|---|---|---|---|\n"
    save(
        args.name,
        payload,
        head + "\n\n" + table + "\n".join(rows),
        [(f"{r['shape']}/{r['path']}/{r['tokens']}", "frac", r["frac"]) for r in payload["results"]],
    )


if __name__ == "__main__":
    main()
