"""Continuation-perplexity ratio to BF16 for several calibration recipes and baselines (CPU, fp32).

Calibrates the model six ways (clip search, global clips, per-KV-head, softmax V target, and the
per-layer / per-KV-head OSCAR-or-Hadamard selection), then scores the 8 evaluation windows of 3072
tokens (``eval_sequences``: one module each; the last 512 tokens in chunks of 32) through each
method's cache. Next to each ratio: the mean per-layer relative INT2 attention-output error on 4
held-out eval-split sequences of 2048 tokens (`calibration_quality.py`'s measure).

    python lab/scripts/ppl_recipes.py --model ../shared/models/oscar-ref-qwen3-30m
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
from _harness import save

import oscarkv
from oscarkv.calibration import token_sequences
from oscarkv.calibration.data import eval_sequences
from oscarkv.calibration.report import attention_errors
from oscarkv.cli import load_model
from oscarkv.config import CalibrationConfig
from oscarkv.eval.methods import get_method
from oscarkv.eval.tasks.ppl import continuation_nll

RECIPES = {"search": {"clip_search": True}, "global": {}, "kvhead": {"granularity": "kv_head"},
           "softmax": {"v_target": "softmax"}, "select": {"rotation_select": True},
           "select-kvhead": {"granularity": "kv_head", "rotation_select": True},
           # clip search by the held-out loss of the fake-quantized model (not the eval text)
           "nll": {"clip_search": True, "clip_objective": "nll"},
           "nll-kvhead": {"granularity": "kv_head", "clip_search": True, "clip_objective": "nll"},
           "kl-kvhead": {"granularity": "kv_head", "clip_search": True, "clip_objective": "kl"},
           "nll-kvhead-layer": {"granularity": "kv_head", "clip_search": True, "clip_objective": "nll",
                                "clip_per_layer": True}}  # fmt: skip
DEFAULT_RECIPES = "search,global,kvhead,softmax,select,select-kvhead"


def _names(c: str | list[str]) -> str:
    return c if isinstance(c, str) else ",".join(c)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", default="ppl_recipes_cpu", help="results file name")
    ap.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma-separated subset of RECIPES")
    ap.add_argument("--baselines", default="hadamard-int2,clip-only,quarot-int2,int4")
    ap.add_argument("--holdout-tokens", type=int, default=None, help="override for every recipe")
    args = ap.parse_args()
    model, tok = load_model(args.model, "cpu", "fp32")
    over = {} if args.holdout_tokens is None else {"holdout_tokens": args.holdout_tokens}
    want = [n for n in args.recipes.split(",") if n]
    sets = {n: oscarkv.calibrate(model, tok, CalibrationConfig(**RECIPES[n], **over)) for n in want}
    # the hadamard-int2 baseline's rotations and clips (for its attention error)
    had = oscarkv.calibrate(model, tok, CalibrationConfig(method="hadamard"))
    evals = token_sequences(tok, None, 4, 2048, seed=0, split="eval")
    errs = attention_errors(
        model, evals, {"hadamard-int2": had, **{f"oscar ({n})": rs for n, rs in sets.items()}}
    )
    mean_err = {n: sum(e.values()) / len(e) for n, e in errs.items()}
    selected = {n: rs.provenance.recipe["rotation_select"] for n, rs in sets.items() if "select" in n}
    clip_loss = {
        n: rs.provenance.recipe["clip_loss"] for n, rs in sets.items() if "clip_loss" in rs.provenance.recipe
    }
    clips = {n: {i: list(rs.clips(i)) for i in rs.layer_ids} for n, rs in sets.items() if n in clip_loss}
    seqs = eval_sequences(tok, 8, 3072, seed=0)

    def ppl(method) -> float:
        res = [continuation_nll(model, method, s, 3072 - 512, 32) for s in seqs]
        return math.exp(sum(a for a, _ in res) / sum(b for _, b in res))

    base = ppl(get_method("bf16", None, model.config))
    rows = {"bf16": 1.0}
    for n in [b for b in args.baselines.split(",") if b]:  # spec (clips, windows) of any recipe
        rows[n] = ppl(get_method(n, next(iter(sets.values())), model.config)) / base
    for n, rs in sets.items():
        rows[f"oscar ({n})"] = ppl(get_method("oscar", rs, model.config)) / base
    md = [
        f"Continuation perplexity / BF16 (BF16 = {base:.3f}), 8 x 512 tokens, context 3072, chunks of 32, "
        f"`{Path(args.model).name}` fp32 on CPU"
        + (f", {args.holdout_tokens} held-out calibration tokens" if over else ""),
        "",
        "",
        "attn err: mean over layers of the relative INT2 attention-output error, 4 x 2048 held-out",
        "eval-split tokens (sink 64 + recent 256 exact)",
        "",
        "| method | ppl / BF16 | attn err |",
        "|---|---|---|",
    ]
    md += [f"| {k} | {v:.4f} | {f'{mean_err[k]:.3e}' if k in mean_err else '-'} |" for k, v in rows.items()]
    for n, sel in selected.items():
        md += [
            "",
            f"`{n}` choices (K, V) per layer: "
            + "; ".join(f"L{i} {_names(c['k'])}/{_names(c['v'])}" for i, c in sel.items()),
        ]
    for n, rep in clip_loss.items():
        md += [
            "",
            f"`{n}` held-out {rep['objective']} ({rep['scored_tokens']} tokens): exact {rep['exact']:.4f}, "
            f"spec clips {rep['spec']:.4f}, chosen {rep.get('per_layer', rep['global']):.4f}; (K, V) clips: "
            + "; ".join(f"L{i} {k:g}/{v:g}" for i, (k, v) in clips[n].items()),
        ]
    print("\n".join(md))
    payload = {
        "bf16_ppl": base,
        "ratios": rows,
        "attn_err_mean": mean_err,
        "attn_err": errs,
        "selection": selected,
        "clip_loss": clip_loss,
        "clips": clips,
    }
    save(args.name, payload, "\n".join(md))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
