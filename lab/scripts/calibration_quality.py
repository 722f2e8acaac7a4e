"""Per-layer INT2 attention-output error of rotation sets from one calibration pipeline.

Calibrates the same model with several recipes (OSCAR with and without the per-layer clip
search, the softmax value target, per-KV-head rotations, and the Hadamard / identity / KᵀK
ablations), then measures each on held-out sequences with OSCAR's windows (64 sink + 256
recent tokens in 16 bits, the middle INT2). Usage:

    python lab/scripts/calibration_quality.py --model ../shared/models/oscar-ref-qwen3-30m
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
from _harness import save

from oscarkv.calibration import calibrate, token_sequences
from oscarkv.calibration.report import attention_errors
from oscarkv.cli import load_model
from oscarkv.config import CalibrationConfig

RECIPES = {
    "oscar+clip-search": dict(method="oscar", clip_search=True),
    "oscar (global clips)": dict(method="oscar", clip_search=False),
    "oscar softmax-V": dict(method="oscar", v_target="softmax", clip_search=True),
    "oscar kv_head": dict(method="oscar", granularity="kv_head", clip_search=True),
    "ktk_vtv (global clips)": dict(method="ktk_vtv", clip_search=False),
    "hadamard (global clips)": dict(method="hadamard", clip_search=False),
    "identity (global clips)": dict(method="identity", clip_search=False),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--eval-seqs", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--name", default="calibration_quality")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(args.model, args.device, "auto")
    sets, times = {}, {}
    for name, kw in RECIPES.items():
        t0 = time.perf_counter()
        sets[name] = calibrate(model, tok, CalibrationConfig(tokens=args.tokens, **kw))
        times[name] = time.perf_counter() - t0
        print(f"calibrated {name} in {times[name]:.1f} s", flush=True)
    # held-out evaluation text: the eval split of the standard library (disjoint from calibration)
    evals = token_sequences(tok, None, args.eval_seqs, 2048, seed=0, split="eval")
    errs = attention_errors(model, evals, sets)
    layers = sorted(next(iter(errs.values())))
    head = "| recipe | " + " | ".join(f"L{i}" for i in layers) + " | mean | calib s |"
    lines = [head, "|" + "---|" * (len(layers) + 3)]
    for name, e in errs.items():
        mean = sum(e.values()) / len(e)
        cells = " | ".join(f"{e[i]:.2e}" for i in layers)
        lines.append(f"| {name} | {cells} | **{mean:.2e}** | {times[name]:.0f} |")
    md = (
        f"Relative INT2 attention-output error per layer (held-out, {args.eval_seqs}x2048 tokens, "
        f"sink 64 + recent 256 in 16 bits), model `{Path(args.model).name}`, "
        f"{args.tokens} calibration tokens\n\n" + "\n".join(lines)
    )
    print(md)
    save(args.name, {"model": args.model, "tokens": args.tokens, "errors": errs, "calib_seconds": times}, md)


if __name__ == "__main__":
    main()
