"""How fp8 e4m3 windows would hold a model's rotated K and V rows: the largest |value|, the share
of elements past ±448 (saturated by a write), below fp8's smallest normal 2^-6 (fewer mantissa
bits) or below 2^-10 (stored as 0), and the relative RMS error of the fp8 rounding.

The rows are what the windows store: post-RoPE keys times R_K and values times R_V, minus the
artifact's channel offsets, in the model dtype, on the perplexity sequences of ``oscarkv eval``
(the same draw: ``text_sequences`` with the same data, count, length and seed). Every stored row
passes through fp8 (a window row is fp8; an INT2 row is quantized from its fp8 value), so "all"
counts every position; "sink" the first 64 positions (the attention sink, where outliers live).

    python lab/scripts/fp8_window_saturation.py --model /work/models/smollm2 \\
        --rotations /work/models/smollm2-cal --data /usr/lib/node_modules/npm/lib --out OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from oscarkv.eval.runner import text_sequences
from oscarkv.hf.loading import load_model
from oscarkv.quant.window import FP8_MAX, to_window
from oscarkv.rotation import load_rotations, rotate_heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rotations", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, tok = load_model(args.model, "cpu", "auto")
    rs = load_rotations(args.rotations)
    seqs = text_sequences(tok, [args.data], args.sequences, args.context, args.seed)
    sink = rs.spec.sink_tokens
    keys = ("n", "max_abs", "over_448", "below_normal", "to_zero", "err2", "sum2")
    stats = {f"{kind}_{part}": dict.fromkeys(keys, 0.0) for kind in "kv" for part in ("all", "sink")}
    per_layer: dict[str, list[float]] = {
        "k_max_abs": [0.0] * len(rs.layer_ids),
        "v_max_abs": [0.0] * len(rs.layer_ids),
    }

    def add(s: dict, x: torch.Tensor) -> None:
        a = x.abs()
        y = to_window(x, torch.float8_e4m3fn).float()
        s["n"] += x.numel()
        s["max_abs"] = max(s["max_abs"], float(a.max()))
        s["over_448"] += int((a > FP8_MAX).sum())
        s["below_normal"] += int(((a < 2**-6) & (a > 0)).sum())
        s["to_zero"] += int(((y == 0) & (x != 0)).sum())
        s["err2"] += float(((y - x.float()) ** 2).sum())
        s["sum2"] += float((x.float() ** 2).sum())

    with torch.inference_mode():
        for seq in seqs:
            out = model(input_ids=seq[None], use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            for i in rs.layer_ids:
                lr, layer = rs.layers[i], cache.layers[i]
                for kind, x, r, off in (
                    ("k", layer.keys, lr.k, lr.k_offset),
                    ("v", layer.values, lr.v, lr.v_offset),
                ):
                    c = 0.0 if off is None else off.float()[None, :, None, :]
                    rows = (rotate_heads(x.float(), r.float()) - c).to(x.dtype)  # [1, Hkv, T, d]
                    add(stats[f"{kind}_all"], rows)
                    add(stats[f"{kind}_sink"], rows[:, :, :sink])
                    per_layer[f"{kind}_max_abs"][i] = max(
                        per_layer[f"{kind}_max_abs"][i], float(rows.abs().max())
                    )
    report = {}
    for name, s in stats.items():
        n = s["n"]
        report[name] = {
            "elements": int(n),
            "max_abs": s["max_abs"],
            "saturated_fraction": s["over_448"] / n,
            "below_2^-6_fraction": s["below_normal"] / n,
            "stored_as_zero_fraction": s["to_zero"] / n,
            "relative_rms_error": (s["err2"] / s["sum2"]) ** 0.5,
        }
    result = {
        "model": args.model,
        "rotations": args.rotations,
        "data": args.data,
        "context": args.context,
        "sequences": args.sequences,
        "seed": args.seed,
        "model_dtype": str(next(model.parameters()).dtype),
        "stats": report,
        "per_layer": per_layer,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for name, r in report.items():
        print(name, {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
