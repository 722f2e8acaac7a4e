"""INT2 decode at few requests against what a plain read of the same bytes reaches (#52 item 1).

For each (batch, context) shape of Qwen3's attention (32/8 heads, d 128) this times, replayed from
CUDA graphs: the decode call at a grid of ``DecodeTuning`` changes (defaults first), a streaming
read of the same byte count in one launch (int32 loads summed, the best of a few program sizes),
and a device copy of that many bytes. It reports µs, TB/s and the share of the copy rate, so the
decode's gap splits into what any one-launch read of that size loses and what the kernel adds.

    python lab/decode_b1.py [--shapes 1x65536,8x4096] [--changes default,programs_few=512,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _harness import copy_bandwidth, save
from gpu_check import SINK_RECENT, bench_graph, decode_bytes, make_pools

from oscarkv.kernels.triton import decode as tdec
from oscarkv.quant import RowFormat

CHANGES = ("default,programs_few=256,programs_few=512,programs_few=2048,num_stages=4,num_stages=5,"
           "swap_block_n=64,swap_pair_tokens=1073741824,programs_few=512+num_stages=4,pdl=False")  # fmt: skip


@triton.jit
def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_floor(nbytes: int) -> tuple[float, str]:
    """Best µs of one launch that reads ``nbytes`` (int32 loads), over a few program sizes."""
    n = nbytes // 4
    x = torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device="cuda")
    best = (float("inf"), "")
    for block, iters, warps in ((1024, 4, 4), (1024, 8, 4), (2048, 8, 8), (4096, 4, 8), (1024, 16, 4)):
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, dtype=torch.int32, device="cuda")
        us = 1e3 * bench_graph(
            lambda g=grid, o=out, b=block, i=iters, w=warps: _read[(g,)](
                x, o, n, BLOCK=b, ITERS=i, num_warps=w
            ),
            50,
        )
        best = min(best, (us, f"{block}x{iters}/{warps}w, {grid} programs"))
    return best


def parse_change(s: str) -> dict:
    if s == "default":
        return {}
    out = {}
    for kv in s.split("+"):
        k, v = kv.split("=")
        out[k] = (
            {"True": True, "False": False}.get(v)
            if v in ("True", "False")
            else (float(v) if "." in v else int(v))
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x32768,1x65536,1x131072,8x4096,8x16384")
    ap.add_argument("--changes", default=CHANGES)
    ap.add_argument("--name", default="decode_b1")
    args = ap.parse_args(argv)
    hq, hkv, d, dev = 32, 8, 128, torch.device("cuda")
    fmt = RowFormat(d, 2, d)
    bw = copy_bandwidth("cuda")
    changes = [parse_change(c) for c in args.changes.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        b, L = (int(x) for x in shape.split("x"))
        lq, lh = L - SINK_RECENT, SINK_RECENT
        pools = make_pools(b, lq, lh, hkv, d, fmt)
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
        nbytes = decode_bytes(b, hkv, d, lq, lh)
        floor_us, floor_cfg = read_floor(nbytes)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_us = 1e3 * bench_graph(
            lambda dst=dst, src=src: dst.copy_(src), 50
        )  # moves nbytes (read + write)
        row = {"shape": shape, "bytes": nbytes, "read_floor_us": floor_us, "read_floor_cfg": floor_cfg,
               "copy_same_bytes_us": copy_us, "decode": {}}  # fmt: skip
        for ch in changes:
            t = dataclasses.replace(tdec.DEFAULT_TUNING, **ch)
            plan = tdec.plan(b, hq, hkv, d, (lq, lh), dev, t)
            us = 1e3 * bench_graph(lambda plan=plan, q=q, pools=pools, h=(lq, lh): tdec.decode_attention(
                q, *pools, 0.088, fmt, fmt, lens_hint=h, plan=plan), 50)  # fmt: skip
            key = "+".join(f"{k}={v}" for k, v in ch.items()) or "default"
            row["decode"][key] = {"us": us, "grid": list(plan.grid)}
            print(f"{shape} {key}: {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s) grid {plan.grid}", flush=True)
        rows.append(row)
    keys = list(rows[0]["decode"])
    md = [f"device copy {bw / 1e12:.2f} TB/s (read + write, 4 GiB). µs per call, CUDA-graph replay; "
          "in brackets the share of the copy rate the bytes read reach.", "",
          "| shape | MB | read floor µs | copy of the bytes µs | " + " | ".join(keys) + " |",
          "|---" * (4 + len(keys)) + "|"]  # fmt: skip
    for r in rows:
        share = lambda us, r=r: f"{us:.1f} ({100 * r['bytes'] / us / 1e6 / (bw / 1e12):.0f}%)"  # noqa: E731
        md.append(f"| {r['shape']} | {r['bytes'] / 1e6:.1f} | {share(r['read_floor_us'])} | {r['copy_same_bytes_us']:.1f} | "
                  + " | ".join(share(r["decode"][k]["us"]) for k in keys) + " |")  # fmt: skip
    text = "\n".join(md)
    print(text)
    save(args.name, {"copy_bytes_per_s": bw, "rows": rows}, text)


if __name__ == "__main__":
    main()
