"""The BF16 engine's decode attention (16-bit lists only, 16-token pages in shuffled order) against
the best PyTorch SDPA backend on contiguous BF16 K/V, Qwen3-8B heads (32 query, 8 KV, head dim
128), both replayed from CUDA graphs in one run.

1. with ``--sweep``, a sweep of the 16-bit-only tunings (``DecodeTuning.bf16_*``) on four shapes,
   geometric mean;
2. the side-by-side table at batch 1/8/32 and 8K/32K/128K for the default (and the sweep's best).

    python benchmarks/bf16_paged_decode.py [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import save
from gpu_check import bench_graph, sdpa_best

from oscarkv.kernels.triton import decode as tdec
from oscarkv.quant import RowFormat

DEV = "cuda"
HQ, HKV, D, PS = 32, 8, 128, 16
FMT = RowFormat(D, 2, D)


def paged(b: int, n: int, g: torch.Generator) -> tuple:
    """Decode arguments for ``b`` sequences of ``n`` tokens in 16-bit pages of ``PS`` rows, the
    pages of all sequences shuffled through the pool; plus the same K/V contiguous ``[b, Hkv, n, d]``."""
    pages = b * (n // PS)
    hk = torch.randn(pages * PS + PS, HKV, D, device=DEV, dtype=torch.bfloat16, generator=g)
    hv = torch.randn_like(hk)
    order = torch.randperm(pages, device=DEV, generator=g) + 1  # page 0: the dummy
    rows = (order.view(b, -1, 1) * PS + torch.arange(PS, device=DEV)).view(b, n)
    empty_c = torch.zeros(0, HKV, D // 4, dtype=torch.uint8, device=DEV)
    empty_m = torch.zeros(0, HKV, 1, 2, dtype=torch.float16, device=DEV)
    zeros = torch.zeros(b + 1, dtype=torch.int32, device=DEV)
    indptr = torch.arange(b + 1, device=DEV, dtype=torch.int32) * n
    args = (empty_c, empty_m, empty_c, empty_m, hk, hv, zeros, torch.zeros(0, dtype=torch.int32, device=DEV), indptr,
            rows.reshape(-1).to(torch.int32))  # fmt: skip
    k = hk[rows].permute(0, 2, 1, 3).contiguous()
    v = hv[rows].permute(0, 2, 1, 3).contiguous()
    torch.cuda.synchronize()
    return args, k, v


def ours(q, args, n: int, t: tdec.DecodeTuning):
    plan = tdec.plan(q.shape[0], HQ, HKV, D, (0, n), DEV, t)
    return lambda: tdec.decode_attention(q, *args, D**-0.5, FMT, FMT, lens_hint=(0, n), plan=plan)


GRID = [{}] + [
    dict(bf16_block=blk, bf16_stages=st, bf16_warps=w, bf16_per_sm=ps, bf16_min_split=ms)
    for blk in (32, 64)
    for st in (2, 3, 4)
    for w in (4, 8)
    for ps, ms in ((2, 256), (4, 256), (4, 512), (8, 512))
]


def sweep(g: torch.Generator, quick: bool) -> list[dict]:
    cases = []
    for b, n in ((1, 32768), (8, 32768), (32, 8192), (8, 131072)):
        args, _, _ = paged(b, n, g)
        cases.append((torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16, generator=g), args, n))
    rows = []
    for change in GRID[: 9 if quick else None]:
        t = dataclasses.replace(tdec.DEFAULT_TUNING, **change)
        try:
            ms = [bench_graph(ours(q, a, n, t), 30) for q, a, n in cases]
        except Exception as e:  # a tuning that does not compile
            rows.append({"change": change, "error": str(e)[-200:]})
            continue
        rows.append({"change": change, "ms": ms, "score": math.prod(ms) ** (1 / len(ms))})
        print("sweep", change, [f"{m:.4f}" for m in ms], flush=True)
    return rows


def table(g: torch.Generator, tunings: dict[str, tdec.DecodeTuning], quick: bool) -> list[dict]:
    out = []
    for b in (1, 8, 32):
        for n in (8192, 32768) if quick else (8192, 32768, 131072):
            args, k, v = paged(b, n, g)
            q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16, generator=g)
            want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[
                :, :, 0
            ]
            row = {"batch": b, "len": n}
            for name, t in tunings.items():
                fn = ours(q, args, n, t)
                err = float((fn().float() - want.float()).norm() / want.float().norm())
                row[f"{name}_ms"], row[f"{name}_err"] = bench_graph(fn), err
            row["sdpa_ms"], row["sdpa_backend"] = sdpa_best(q[:, :, None], k, v, bench_graph)
            for name in tunings:
                row[f"{name}_of_sdpa"] = row["sdpa_ms"] / row[f"{name}_ms"]
            out.append(row)
            print(row, flush=True)
            del args, k, v
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="sweep DecodeTuning.bf16_* first")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--name", default="bf16_paged_decode")
    args = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    tunings, data, md = {"default": tdec.DEFAULT_TUNING}, {}, []
    if args.sweep:
        rows = sweep(g, args.quick)
        ok = [r for r in rows if "score" in r]
        best = min(ok, key=lambda r: r["score"])
        tunings["best"] = dataclasses.replace(tdec.DEFAULT_TUNING, **best["change"])
        data = {"sweep": rows, "best": best["change"]}
        md = [
            f"Sweep best: {best['change']} (geo-mean {best['score']:.4f} ms vs default {ok[0]['score']:.4f} ms)",
            "",
        ]
    res = table(g, tunings, args.quick)
    md += ["| batch | length | SDPA ms (backend) | " + " | ".join(f"paged {n} ms | of SDPA | err" for n in tunings) + " |",
           "|---|---|---|" + "---|---|---|" * len(tunings)]  # fmt: skip
    for r in res:
        cells = " | ".join(
            f"{r[n + '_ms']:.4f} | {r[n + '_of_sdpa']:.2f}x | {r[n + '_err']:.1e}" for n in tunings
        )
        md.append(f"| {r['batch']} | {r['len']} | {r['sdpa_ms']:.4f} ({r['sdpa_backend']}) | {cells} |")
    text = "\n".join(md)
    print(text)
    last = list(tunings)[-1]
    hist = [(f"{r['batch']}x{r['len']}", "bf16_paged_of_sdpa", r[f"{last}_of_sdpa"]) for r in res]
    save(args.name, {**data, "table": res}, text, hist)


if __name__ == "__main__":
    main()
