#!/usr/bin/env python
"""Markdown table of lab/results/smollm2_keyside_cpu.json (printed; pasted into the .md)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "lab/results/smollm2_keyside_cpu.json"
r = json.loads(path.read_text())
v = r["variants"]
base = v["bf16"]
b_seq = base["seq_nll"]
print(
    "| variant | K tier b/elem | V tier b/elem | bits/elem @128K | ppl | × BF16 | KL/tok | seqs worse than BF16 |"
)
print("|---|---|---|---|---|---|---|---|")
for name, x in v.items():
    worse = sum(a > b + 1e-9 for a, b in zip(x["seq_nll"], b_seq, strict=False))
    print(
        f"| {name} | {x['bits']['k_tier']:.3f} | {x['bits']['v_tier']:.2f} | {x['bits']['at_128k']:.3f} "
        f"| {x['ppl']:.4f} | {x['ppl'] / base['ppl']:.4f} | {x['kl_per_tok']:.4f} | {worse}/{len(b_seq)} |"
    )
for key in ("sens_kl", "sens_attn"):
    if key in r:
        order = sorted(r[key], key=lambda k: -r[key][k])
        print(f"\n{key} (top 10): " + ", ".join(f"L{k} {r[key][k]:.4f}" for k in order[:10]))
