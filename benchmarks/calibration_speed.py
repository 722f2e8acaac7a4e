"""Calibration time and peak memory at 20K tokens, per recipe: the spec's widths everywhere
(``--max-ppl-increase none``), the default (the 2% held-out perplexity target), and the target's
worst case (a target no count meets: every layer ranked, the bisection up to the ceiling).

CPU: the reference model (``--model``). GPU (``--qwen3-8b``): a random-weight model with Qwen3-8B's
configuration built on the device (speed does not need trained weights), with the tokenizer of
``--tokenizer``. Peak *extra* memory is measured above the loaded model: process RSS high-water
mark on the CPU, ``torch.cuda.max_memory_allocated`` on the GPU.

    python benchmarks/calibration_speed.py --model ../shared/models/oscar-ref-qwen3-30m
    python benchmarks/calibration_speed.py --qwen3-8b --tokenizer PATH   # on the GPU machine
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import save

from oscarkv.calibration import calibrate
from oscarkv.config import CalibrationConfig

QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


#: recipe name -> CalibrationConfig fields over the defaults
RECIPES = {
    "spec widths (--max-ppl-increase none)": {"max_ppl_increase": None},
    "default (2% perplexity target)": {},
    "target's worst case (--max-ppl-increase 1e-9)": {"max_ppl_increase": 1e-9},
}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def headline(payload: dict) -> list[tuple[str, str, float]]:
    """The figures for the CSV history: seconds and peak extra MB per recipe."""
    out = []
    for r in payload["rows"]:
        shape = f"{payload['label']}, {payload['tokens']} tokens, {r['recipe']}"
        out += [(shape, "seconds", r["seconds"]), (shape, "peak_extra_mb", r["peak_extra_mb"])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--qwen3-8b", action="store_true")
    ap.add_argument("--tokenizer", help="tokenizer dir for --qwen3-8b")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    if args.qwen3_8b:
        dev = torch.device("cuda")
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        cfg = Qwen3Config(**QWEN3_8B)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(dev):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
        label = "random-weight Qwen3-8B config, bf16"
    else:
        dev = torch.device("cpu")
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        label = f"{Path(args.model).name}, fp32"
    rows = []
    for recipe, over in RECIPES.items():
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        rss0 = rss_mb()
        t0 = time.perf_counter()
        calibrate(model, tok, dataclasses.replace(CalibrationConfig(tokens=args.tokens), **over))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20 if dev.type == "cuda" else rss_mb() - rss0
        rows.append({"recipe": recipe, "seconds": round(dt, 1), "peak_extra_mb": round(extra)})
        print(rows[-1], flush=True)
    where = "GPU" if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    md = [
        f"Calibration at {args.tokens} tokens (+4096 held-out), {label}, {where}",
        "",
        "| recipe | seconds | peak extra memory (MB) |",
        "|---|---|---|",
    ]
    md += [f"| {r['recipe']} | {r['seconds']} | {r['peak_extra_mb']} |" for r in rows]
    if dev.type != "cuda":
        md += [
            "",
            "CPU memory is the process RSS high-water mark above the loaded model; rows run in order, "
            "so a later row shows only what it added beyond the earlier peak.",
        ]
    name = args.name or ("calibration_speed_gpu" if dev.type == "cuda" else "calibration_speed_cpu")
    payload = {"label": label, "tokens": args.tokens, "rows": rows}
    save(name, payload, "\n".join(md), history=headline(payload))
    print("\n".join(md))


if __name__ == "__main__":
    main()
