"""Which part of the INT2 cache costs passkey accuracy? OSCAR (per-KV-head rotations) with storage
variants, side by side on the same prompts: ppl ratio, passkey at 3K (n prompts, paired Δ vs
BF16) and mean attention-output error.

    python lab/scripts/passkey_diag.py --model ../shared/models/oscar-ref-qwen3-30m --n 400
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
from _harness import save

import oscarkv
from oscarkv.calibration.data import eval_sequences
from oscarkv.cli import load_model
from oscarkv.config import CalibrationConfig, EvalConfig
from oscarkv.eval.methods import RECIPES, CacheMethod, get_method
from oscarkv.eval.report import paired_difference
from oscarkv.eval.runner import passkey_at_context_cases
from oscarkv.eval.tasks.attn_error import attention_metrics
from oscarkv.eval.tasks.needle import run_cases
from oscarkv.eval.tasks.ppl import batched_nll, perplexity
from oscarkv.hf import OscarCache

VARIANTS = {
    "oscar": {},
    "oscar lloyd_max": {"codebook": "lloyd_max"},
    "oscar K4 V2": {"key_bits": 4},
    "oscar K2 V4": {"value_bits": 4},
    "oscar v_clip 0.96": {"v_clip": 0.96},
    "oscar no K clip": {"k_clip": 0.0},
    "oscar K3 V3": {"key_bits": 3, "value_bits": 3},
    "oscar K4 V4": {"key_bits": 4, "value_bits": 4},
    "16-bit passthrough": {"_quantize": False},
    "hadamard lloyd_max": {"codebook": "lloyd_max", "_rot": "hadamard"},
    "hadamard": {"_rot": "hadamard"},
}


class Variant(CacheMethod):
    def __init__(self, name, rs, cfg, backend, quantize=True):
        super().__init__(name, RECIPES["oscar"], rs, cfg)
        self.backend, self.quantize = backend, quantize

    def make_cache(self, model):
        return OscarCache.from_rotations(model, self.rotations, backend=self.backend, quantize=self.quantize)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seqs", type=int, default=24, help="ppl sequences")
    ap.add_argument("--name", default="passkey_diag_gpu")
    args = ap.parse_args()
    model, tok = load_model(args.model, "cuda" if torch.cuda.is_available() else "cpu", "auto")
    cfg = model.config
    rots = {"oscar": oscarkv.calibrate(model, tok, CalibrationConfig(granularity="kv_head")),
            "hadamard": oscarkv.calibrate(model, tok, CalibrationConfig(method="hadamard"))}  # fmt: skip
    ecfg = EvalConfig(passkey_at_context=args.n)
    cases = passkey_at_context_cases(tok, ecfg)
    seqs = eval_sequences(tok, args.seqs, 3072, 0)
    errseqs = eval_sequences(tok, 4, 2048, 1)

    def ppl(m) -> float:
        return perplexity(*batched_nll(model, m, seqs, 3072 - 512, 32, 16))

    bf16 = get_method("bf16", None, cfg)
    base, ref = ppl(bf16), run_cases(model, tok, bf16, cases, 16)
    rows = [{"variant": "bf16", "ppl_ratio": 1.0, "passkey": sum(ref) / len(ref)}]
    print(f"bf16 passkey {rows[0]['passkey']:.3f}", flush=True)
    for name in args.variants.split(","):
        over = dict(VARIANTS[name])
        rs = rots[over.pop("_rot", "oscar")]
        quantize = over.pop("_quantize", True)
        spec = dataclasses.replace(rs.spec, **over)
        backend = (
            "torch" if spec.codebook != "uniform" or spec.key_bits != 2 or spec.value_bits != 2 else "auto"
        )
        m = Variant(name, rs.with_spec(spec), cfg, backend, quantize)
        t = time.time()
        hits = run_cases(model, tok, m, cases, 16)
        d, se = paired_difference([int(h) for h in hits], [int(h) for h in ref])
        err = attention_metrics(model, {name: m}, errseqs)[name] if quantize else {0: {"attn_out_err": 0.0}}
        row = {"variant": name, "ppl_ratio": ppl(m) / base, "passkey": sum(hits) / len(hits), "delta": d,
               "se": se, "attn_out_err": sum(v["attn_out_err"] for v in err.values()) / len(err),
               "backend": backend, "bpe": spec.bits_per_element(3072, 128) if quantize else 16.0}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), f"{time.time() - t:.0f}s", flush=True)
    md = [f"OSCAR storage variants, `{Path(args.model).name}`, passkey n = {args.n} at 3072 tokens, "
          f"{args.seqs} ppl sequences; Δ = paired difference to BF16 on the same prompts", "",
          "| variant | bits/elem | ppl / BF16 | passkey | Δ vs BF16 (± SE) | attn out err |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        md.append(f"| {r['variant']} | {r.get('bpe', 16):.2f} | {r['ppl_ratio']:.4f} | {r['passkey']:.3f} | "
                  + (f"{r['delta']:+.3f} ± {r['se']:.3f} | {r['attn_out_err']:.2e} |" if "delta" in r else "- | - |"))  # fmt: skip
    print("\n".join(md))
    save(args.name, {"rows": rows, "n": args.n}, "\n".join(md))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
