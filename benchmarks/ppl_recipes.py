"""Continuation-perplexity ratio to BF16 for several calibration recipes and baselines (CPU, fp32).

Calibrates the model four ways (clip search, global clips, per-KV-head, softmax V target), then
scores the 8 evaluation windows of 3072 tokens (``eval_sequences``: one module each; the last 512
tokens in chunks of 32) through each method's cache.

    python benchmarks/ppl_recipes.py --model ../shared/models/oscar-ref-qwen3-30m
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import save

import oscarkv
from oscarkv.calibration.data import eval_sequences
from oscarkv.cli import load_model
from oscarkv.config import CalibrationConfig
from oscarkv.eval.methods import get_method
from oscarkv.eval.tasks.ppl import continuation_nll

RECIPES = {"search": {"clip_search": True}, "global": {}, "kvhead": {"granularity": "kv_head"},
           "softmax": {"v_target": "softmax"}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    model, tok = load_model(args.model, "cpu", "fp32")
    sets = {n: oscarkv.calibrate(model, tok, CalibrationConfig(**kw)) for n, kw in RECIPES.items()}
    seqs = eval_sequences(tok, 8, 3072, seed=0)

    def ppl(method) -> float:
        res = [continuation_nll(model, method, s, 3072 - 512, 32) for s in seqs]
        return math.exp(sum(a for a, _ in res) / sum(b for _, b in res))

    base = ppl(get_method("bf16", None, model.config))
    rows = {"bf16": 1.0}
    for n in ("hadamard-int2", "clip-only", "quarot-int2", "int4"):
        rows[n] = ppl(get_method(n, sets["global"], model.config)) / base
    for n, rs in sets.items():
        rows[f"oscar ({n})"] = ppl(get_method("oscar", rs, model.config)) / base
    md = [
        f"Continuation perplexity / BF16 (BF16 = {base:.3f}), 8 x 512 tokens, context 3072, chunks of 32, "
        f"`{Path(args.model).name}` fp32 on CPU",
        "",
        "| method | ppl / BF16 |",
        "|---|---|",
    ]
    md += [f"| {k} | {v:.4f} |" for k, v in rows.items()]
    print("\n".join(md))
    save("ppl_recipes_cpu", {"bf16_ppl": base, "ratios": rows}, "\n".join(md))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
