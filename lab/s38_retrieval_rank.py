"""Does a retrieval-sensitive layer ranking pick better layers for 4-bit keys than the held-out NLL?

SmolLM2 (bf16, GPU). Retrieval prompts built like `oscarkv eval`'s chat retrieval but from another
seed (disjoint from the eval's), the queried value appended; the objective is the NLL of the value's
tokens with the cache fake-quantized (the prompt exact, as prefilled). Per layer: that layer alone
quantized ("alone"), and everything quantized but that layer's keys raised to 4 bits ("gain").
Writes rotation artifacts with the top-n layers of each ranking raised, for `oscarkv eval`.

    python lab/s38_retrieval_rank.py MODEL ROT_AUTO OUT_DIR [PROMPTS [CONTEXT]]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oscarkv.calibration.held_out import held_out_nll
from oscarkv.eval.tasks.needle import filler_lines
from oscarkv.eval.tasks.retrieval import build_retrieval_cases
from oscarkv.rotation import RotationSet, load_rotations, save_rotations

model_dir, rot_dir, out = sys.argv[1:4]
prompts = int(sys.argv[4]) if len(sys.argv) > 4 else 48
ctx = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
dev = "cuda" if torch.cuda.is_available() else "cpu"
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()
rs = load_rotations(rot_dir)
spec, d, layers = rs.spec, rs.head_dim, rs.layer_ids
cases = build_retrieval_cases(tok, ctx, prompts, 4, filler_lines(), seed=777)
ans = [tok(c.answer, add_special_tokens=False)["input_ids"] for c in cases]
n_ans = len(ans[0])
assert all(len(a) == n_ans for a in ans), "answers of different token lengths"
rows = [torch.tensor(list(c.ids) + a) for c, a in zip(cases, ans, strict=True)]
batches = [torch.stack(rows[i : i + 8]) for i in range(0, len(rows), 8)]


def nll(rots: dict) -> float:
    with torch.no_grad():
        return held_out_nll(model, rots, spec, d, batches, n_score=n_ans)


def k4(lr, clip=0.0):
    return dataclasses.replace(lr, key_bits=4, k_clip=clip)


t0 = time.time()
base = {
    "bf16": nll({}),
    "all_k2": nll(dict(rs.layers)),
    "all_k4": nll({i: k4(lr) for i, lr in rs.layers.items()}),
}
print(json.dumps(base), f"{time.time() - t0:.1f}s", flush=True)
alone = {i: nll({i: rs.layers[i]}) for i in layers}
print("alone done", f"{time.time() - t0:.1f}s", flush=True)
gain = {}
for i in layers:
    r = dict(rs.layers)
    r[i] = k4(r[i])
    gain[i] = base["all_k2"] - nll(r)
print("gain done", f"{time.time() - t0:.1f}s", flush=True)
rank_alone = sorted(layers, key=lambda i: -alone[i])
rank_gain = sorted(layers, key=lambda i: -gain[i])
rec = {"base": base, "alone": alone, "gain": gain, "rank_alone": rank_alone, "rank_gain": rank_gain,
       "prompts": prompts, "answer_tokens": n_ans}  # fmt: skip
for name, rank in (("ra", rank_alone), ("rg", rank_gain)):
    for n, tag in ((2, "26"), (14, "30")):
        chosen = sorted(rank[:n])
        new = {i: (k4(lr) if i in chosen else lr) for i, lr in rs.layers.items()}
        rec[f"{name}{tag}"] = {"layers": chosen, "nll": nll(new)}
        prov = dataclasses.replace(
            rs.provenance, recipe={**rs.provenance.recipe, "lab_rank": name, "layers": chosen}
        )
        save_rotations(RotationSet(new, spec, rs.granularity, prov), f"{out}/rot-{name}{tag}", overwrite=True)
k4all = {i: k4(lr) for i, lr in rs.layers.items()}
save_rotations(RotationSet(k4all, spec, rs.granularity, rs.provenance), f"{out}/rot-k4all", overwrite=True)
v4 = dataclasses.replace(spec, value_bits=4)
save_rotations(
    RotationSet(dict(rs.layers), v4, rs.granularity, rs.provenance), f"{out}/rot-v4", overwrite=True
)
save_rotations(RotationSet(k4all, v4, rs.granularity, rs.provenance), f"{out}/rot-k4v4", overwrite=True)
print(json.dumps({k: v for k, v in rec.items() if k not in ("alone", "gain")}), flush=True)
Path(f"{out}/rank.json").write_text(json.dumps(rec, indent=1))
print(f"total {time.time() - t0:.1f}s")
