"""How fast can the decode kernel's reads go with no compute? (session 10, H200)

A Triton kernel with the swap loop's grid, splits and tiles (one warp, 3 stages) that only loads
what the decode kernel loads per tile: the slot list, the K and V code rows and their
``(scale, zero)`` words, of ``heads`` adjacent KV heads per program, and XORs them together. Timed
(CUDA-graph replay) next to the real decode kernel, on Qwen3-8B's shapes; TB/s on the bytes the
kernel must read (codes, metadata and the 4-byte slot list). Variants: heads per program 1, 2, 8
(32-, 64-, 256-byte code rows), without metadata, without the slot-list indirection.

    python lab/scripts/gather_probe.py --shapes 8x32768,16x32768,8x131072
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
from _harness import save
from oscarkv.kernels.triton.decode_plan import CONFIG, split_size

SWAP_TILE = 128  # tokens per tile at one head per program (the swap loop's default)


@triton.jit
def gather(KC, KM, VC, VM, INDPTR, IDX, OUT, split, HKV: tl.constexpr, D8: tl.constexpr, BLOCK_N: tl.constexpr,
           META: tl.constexpr, VIA_IDX: tl.constexpr, HP: tl.constexpr):  # fmt: skip
    """Program (head group, split, sequence): XOR of the int16 code words and int32 metadata words
    of ``HP`` adjacent KV heads over the split's slots, stored per program (keeps the loads live)."""
    hg = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2)
    lo = tl.load(INDPTR + b) + sp * split
    hi = tl.minimum(lo + split, tl.load(INDPTR + b + 1))
    offs_m = tl.arange(0, D8 * HP)
    offs_p = tl.arange(0, HP)
    acc = tl.zeros([BLOCK_N, D8 * HP], tl.int32)
    macc = tl.zeros([BLOCK_N, HP], tl.int32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < hi
        slot = tl.load(IDX + offs_n, mask=nmask, other=0).to(tl.int64) if VIA_IDX else offs_n.to(tl.int64)
        sh = slot * HKV + hg * HP
        kc = tl.load(KC + sh[:, None] * D8 + offs_m[None, :], mask=nmask[:, None], other=0)
        vc = tl.load(VC + sh[:, None] * D8 + offs_m[None, :], mask=nmask[:, None], other=0)
        acc = acc ^ kc.to(tl.int32) ^ (vc.to(tl.int32) << 16)
        if META:
            km = tl.load(KM + sh[:, None] + offs_p[None, :], mask=nmask[:, None], other=0)
            vm = tl.load(VM + sh[:, None] + offs_p[None, :], mask=nmask[:, None], other=0)
            macc = macc ^ km ^ vm
    pid = (b * tl.num_programs(1) + sp) * tl.num_programs(0) + hg
    tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(macc, 1), 0))


def launch(pools: tuple, hkv: int, d: int, split: int, splits: int, batch: int, heads: int, meta: bool,
           via_idx: bool, block_n: int) -> torch.Tensor:  # fmt: skip
    """Run :func:`gather` over ``pools`` = ``(k_codes u8 [N, hkv, d/4], k_meta [N, hkv, 1, 2] 16-bit,
    v_codes, v_meta, indptr i32 [batch+1], indices i32)``; returns the per-program XORs."""
    kc, km, vc, vm, indptr, idx = pools
    out = torch.empty(batch * splits * (hkv // heads), device=kc.device, dtype=torch.int32)
    gather[(hkv // heads, splits, batch)](
        kc.view(torch.int16), km.view(torch.int32), vc.view(torch.int16), vm.view(torch.int32), indptr, idx, out,
        split, HKV=hkv, D8=d // 8, BLOCK_N=block_n, META=meta, VIA_IDX=via_idx, HP=heads, num_warps=1, num_stages=3,
    )  # fmt: skip
    return out


def time_shape(b: int, lq: int, sms: int) -> list[tuple[str, float, float]]:
    """``(variant, ms, TB/s)`` rows at batch ``b`` with ``lq`` quantized tokens per sequence."""
    from gpu_check import SINK_RECENT, bench_graph, make_pools

    from oscarkv.kernels.triton import decode_attention as tda
    from oscarkv.quant import RowFormat

    hq, hkv, d = 32, 8, 128
    fmt = RowFormat(d, 2, d, clip=0.0)
    kc, km, vc, vm, hk, hv, qi, qx, hi, hx = make_pools(b, lq, SINK_RECENT, hkv, d, fmt)
    nbytes = b * lq * hkv * (2 * d // 4 + 8) + b * lq * 4
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)

    def real() -> torch.Tensor:
        return tda.decode_attention(q, kc, km, vc, vm, hk, hv, qi, qx, hi, hx, d**-0.5, fmt, fmt, lens_hint=(lq, SINK_RECENT))  # fmt: skip

    rows = [("decode kernel (defaults)", bench_graph(real))]
    for heads, meta, via in ((1, 1, 1), (1, 1, 0), (1, 0, 1), (1, 0, 0), (2, 1, 1), (8, 1, 1)):
        block_n = max(16, SWAP_TILE // heads)  # the code bytes of a one-head 128-token tile
        split = split_size(b, hkv // heads, lq, block_n, sms, True, 8, max(1, CONFIG["min_split"] // heads))
        splits = math.ceil(lq / split)
        args = ((kc, km, vc, vm, qi, qx), hkv, d, split, splits, b, heads, meta, via, block_n)
        rows.append((f"gather, {heads} head(s)/program, metadata {meta}, slot list {via}",
                     bench_graph(lambda args=args: launch(*args))))  # fmt: skip
    return [(name, ms, nbytes / ms / 1e9) for name, ms in rows]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x32768,16x32768,8x131072")
    ap.add_argument("--name", default="gather_probe_h200")
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    md = ["| shape | variant | ms | TB/s |", "|---|---|---|---|"]
    for shape in args.shapes.split(","):
        b, lq = (int(x) for x in shape.split("x"))
        rows = time_shape(b, lq, sms)
        md += [f"| {shape} | {name} | {ms:.4f} | {tbps:.2f} |" for name, ms, tbps in rows]
        print("\n".join(md[-len(rows) :]), flush=True)
        torch.cuda.empty_cache()
    save(args.name, {"table": md}, "\n".join(md))


if __name__ == "__main__":
    main()
