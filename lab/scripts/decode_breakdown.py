"""Where a decode call's time goes at a few shapes: the whole call, stage 1 alone (the merge
skipped), the 16-bit tier left out, ``--hot`` variants and ``CONFIG`` variants, all graph-timed in
one run (TB/s on the bytes each variant must read, as if from DRAM). Session 13's diagnostics
(results/dv_s13_breakdown.md); ``--hot N`` (session 17) points every quantized slot-list entry at
one of the pool's first N slots, so the kernel executes the same instructions but its code and
metadata loads hit in L2: what the kernel would take if its memory latency were hidden.

    python lab/scripts/decode_breakdown.py [--shapes 8x32768,32x8192] [--hot 256] [--set swap_block_n=64,swap_per_sm=10 ...]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
import oscarkv.kernels.triton.decode_attention as tda
from _harness import config_value, save
from gpu_check import SINK_RECENT, bench_graph, decode_bytes, make_pools
from oscarkv.kernels.triton.decode_config import CONFIG

from oscarkv.quant import RowFormat

HQ, HKV, D = 32, 8, 128


def hot_slots(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Slot list ``idx`` (int32) folded onto slots ``0 … n-1``, ``n >= 1`` (the pools keep their size)."""
    return idx % n


def _slots(text: str) -> int:
    """``--hot``'s value: an integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--hot takes a number of slots >= 1; got {text!r}")
    return int(text)


def timed(b: int, lq: int, lh: int, hot: int = 0) -> tuple[float, float]:
    fmt = RowFormat(D, 2, D)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    kc, km, vc, vm, hk, hv, qptr, qidx, hptr, hidx = make_pools(b, lq, lh, HKV, D, fmt)
    if hot:
        qidx = hot_slots(qidx, hot)
    pools = (kc, km, vc, vm, hk, hv, qptr, qidx, hptr, hidx)
    ms = bench_graph(lambda: tda.decode_attention(q, *pools, 1 / math.sqrt(D), fmt, fmt, lens_hint=(lq, lh)))
    return ms, decode_bytes(b, HKV, D, lq, lh) / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x32768,32x8192,32x32768,8x131072")
    ap.add_argument(
        "--hot", action="append", type=_slots, default=[], help="N: a variant whose slot lists use N slots"
    )
    ap.add_argument(
        "--set", action="append", default=[], help="KEY=VALUE[,KEY=VALUE]: one CONFIG variant (repeatable)"
    )
    ap.add_argument("--name", default="", help="also save results/NAME.{json,md}")
    args = ap.parse_args()
    variants = [("default", {}, SINK_RECENT, False, 0), ("stage 1 alone", {}, SINK_RECENT, True, 0),
                ("no 16-bit tier", {}, 0, False, 0)]  # fmt: skip
    variants += [(f"hot {n} slots", {}, SINK_RECENT, False, n) for n in args.hot]
    variants += [(f"hot {n} slots, no 16-bit tier", {}, 0, False, n) for n in args.hot]
    for text in args.set:
        pairs = (kv.split("=", 1) for kv in text.split(","))
        variants.append((text, {k: config_value(v) for k, v in pairs}, SINK_RECENT, False, 0))
    print(torch.cuda.get_device_name(), torch.__version__)
    lines, rows = ["| batch | length | variant | ms | TB/s |", "|---|---|---|---|---|"], []
    print("\n".join(lines))
    saved, merge = dict(CONFIG), tda._MERGE
    for shape in args.shapes.split(","):
        b, length = (int(x) for x in shape.split("x"))
        for name, cfg, lh, skip_merge, hot in variants:
            CONFIG.update(cfg)
            if skip_merge:
                tda._MERGE = lambda *a, **k: None
            try:
                ms, tbs = timed(b, length - SINK_RECENT, lh, hot)
                rows.append({"batch": b, "len": length, "variant": name, "ms": ms, "TBps": tbs})
                lines.append(f"| {b} | {length} | {name} | {ms:.4f} | {tbs:.2f} |")
                print(lines[-1], flush=True)
            finally:
                tda._MERGE = merge
                CONFIG.clear()
                CONFIG.update(saved)
                torch.cuda.empty_cache()
    if args.name:
        save(args.name, {"rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
