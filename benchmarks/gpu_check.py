"""Check and benchmark the Triton kernels on one GPU in a single run; prints a short table.

1. correctness of decode attention and quantize_pack against the torch twins (fp32 oracle);
2. quantize_pack bandwidth on its input bytes (bf16 rows, the key and value clips);
3. decode attention vs BF16 SDPA (flash / cuDNN / efficient, best taken) on Qwen3-8B shapes
   (32 query heads, 8 KV heads, head dim 128), batch 1/8/32, lengths 4K-128K, with the bytes the
   INT2 kernel must read turned into an effective bandwidth next to a device copy's. Both sides
   are timed replayed from CUDA graphs (device time, as serving engines run decode) and from eager
   Python launches (host overhead included).

``--baseline SRC`` also times the kernels of another checkout (its ``src/`` folder) on the same
inputs, alternating with the current ones, and reports the ratio of the medians: the side-by-side
check every kernel change needs. ``--sweep decode|quantize`` times a small grid of tunings
(``dataclasses.replace`` of the defaults) and reports the best; nothing is changed by it.

    python benchmarks/gpu_check.py [--quick] [--baseline ../old/src] [--sweep decode,quantize]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import math
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import copy_bandwidth, import_package_copy, save

from oscarkv.config import QuantSpec
from oscarkv.kernels import ref, resolve
from oscarkv.kernels.triton import decode as tdec
from oscarkv.kernels.triton import quantize_pack as tqp
from oscarkv.kernels.triton.dequantize import dequantize as tdq
from oscarkv.quant import RowFormat

DEV = torch.device("cuda")
SINK_RECENT = 320
ROUNDS = 3  # alternating rounds per side in a side-by-side timing


def bench(fn, rep=100) -> float:
    """Median ms per call, launched from Python (host overhead included when it dominates)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def bench_graph(fn, rep=100) -> float:
    """Median ms per call replayed from a CUDA graph (device time only, as serving engines run decode)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def make_pools(b: int, lq: int, lh: int, hkv: int, d: int, fmt: RowFormat, dtype=torch.bfloat16):
    """Contiguous per-sequence slot ranges, like the HF cache (quantized rows built directly)."""
    nq, nh = b * lq, b * lh
    kc = torch.randint(0, 256, (nq, hkv, d // 4), dtype=torch.uint8, device=DEV)
    vc = torch.randint(0, 256, (nq, hkv, d // 4), dtype=torch.uint8, device=DEV)
    km = torch.stack(
        [torch.rand(nq, hkv, 1, device=DEV) * 0.5 + 0.1, torch.rand(nq, hkv, 1, device=DEV) * 3], -1
    )
    vm = torch.stack(
        [torch.rand(nq, hkv, 1, device=DEV) * 0.5 + 0.1, torch.rand(nq, hkv, 1, device=DEV) * 3], -1
    )
    hk = torch.randn(nh, hkv, d, device=DEV, dtype=dtype)
    hv = torch.randn(nh, hkv, d, device=DEV, dtype=dtype)
    qi = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * lq
    hi = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * lh
    qx = torch.arange(nq, device=DEV, dtype=torch.int32)
    hx = torch.arange(nh, device=DEV, dtype=torch.int32)
    # do_bench_cudagraph first calls the kernel on a side stream, which does not wait for these
    torch.cuda.synchronize()
    return kc, km.half(), vc, vm.half(), hk, hv, qi, qx, hi, hx


def decode_bytes(b: int, hkv: int, d: int, lq: int, lh: int) -> int:
    """Bytes a decode call must read: per KV head and token, 2-bit K and V codes with a 16-bit
    (scale, zero) pair each for ``lq`` quantized tokens, 16-bit K and V rows for ``lh``."""
    return b * hkv * (lq * 2 * (d // 4 + 4) + lh * 2 * d * 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_decode(quick: bool) -> list[dict]:
    rows = []
    grid = [(1, 32, 8, 128, 1, 1), (3, 32, 8, 128, 100, 7), (8, 64, 8, 128, 4097, 320), (2, 8, 8, 64, 1000, 50),
            (64, 32, 8, 128, 513, 0), (4, 32, 8, 128, 0, 100), (1, 32, 8, 128, 131072 - 320, 320)]  # fmt: skip
    if quick:
        grid = grid[:4]
    for b, hq, hkv, d, lq, lh in grid:
        fmt = RowFormat(d, 2, d, clip=0.0)
        pools = make_pools(b, lq, lh, hkv, d, fmt)
        q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
        out = tdec.decode_attention(q, *pools, 1 / math.sqrt(d), fmt, fmt)
        want = ref.decode_attention(q.float(), *pools[:4], pools[4].float(), pools[5].float(), *pools[6:],
                                    1 / math.sqrt(d), fmt, fmt)  # fmt: skip
        e = rel(out, want)
        rows.append(
            {"check": "decode", "shape": f"B{b} {hq}/{hkv} d{d} q{lq} h{lh}", "rel_err": e, "ok": e < 1e-2}
        )
    return rows


def check_quantize() -> list[dict]:
    rows = []
    for d, clip in ((64, 0.92), (128, 0.96), (256, 0.0)):
        fmt = RowFormat(d, 2, d, clip=clip)
        x = (torch.randn(4096, 8, d, device=DEV) * 2 + 0.2).bfloat16()
        c1, m1 = tqp.quantize_pack(x, fmt)
        c2, m2 = ref.quantize_pack(x, fmt)
        same = float((c1 == c2).float().mean())
        ok = same == 1.0 and torch.equal(m1, m2)
        rows.append({"check": "quantize_pack", "shape": f"d{d} clip{clip}", "codes_equal": same, "ok": ok})
        e = rel(tdq(c2, m2, fmt, torch.float32), ref.dequantize(c2, m2, fmt))
        rows.append({"check": "dequantize", "shape": f"d{d}", "rel_err": e, "ok": e < 1e-6})
    return rows


def _quantize_call(ops):
    """``rows, fmt -> (codes, meta)`` through ``ops.quantize_pack`` (older trees also take a rotation)."""
    import inspect

    if "rotation" in inspect.signature(ops.quantize_pack).parameters:
        return lambda x, fmt: ops.quantize_pack(x, None, fmt)
    return ops.quantize_pack


def side_by_side(fns: dict, timer, rep: int = 100) -> dict:
    """Median ms of each of ``fns`` (name -> callable), over ``ROUNDS`` rounds whose order alternates."""
    times = {k: [] for k in fns}
    for r in range(ROUNDS):
        for k in list(fns)[:: 1 if r % 2 == 0 else -1]:
            times[k].append(timer(fns[k], rep))
    return {k: statistics.median(v) for k, v in times.items()}


def bench_quantize(sides: dict) -> list[dict]:
    """quantize_pack at d 128 over bf16 rows, at the default key and value clips (0.96 / 0.92)."""
    rows = []
    spec = QuantSpec()
    calls = {k: _quantize_call(ops) for k, ops in sides.items()}
    for n_rows, clip in itertools.product((65536, 262144, 1048576), (spec.k_clip, spec.v_clip)):
        fmt = RowFormat(128, 2, 128, clip=clip)
        x = torch.randn(n_rows // 8, 8, 128, device=DEV, dtype=torch.bfloat16)
        fns = {k: (lambda f=f, x=x, fmt=fmt: f(x, fmt)) for k, f in calls.items()}
        ms = side_by_side(fns, bench_graph)  # graph: device time
        ms_eager = bench(fns["current"])  # eager: launch included
        row = {"bench": "quantize_pack", "rows": n_rows, "clip": clip, "ms": ms["current"],
               "input_TBps": x.numel() * 2 / ms["current"] / 1e9, "eager_ms": ms_eager,
               "eager_TBps": x.numel() * 2 / ms_eager / 1e9}  # fmt: skip
        if "baseline" in ms:
            row |= {"baseline_ms": ms["baseline"], "vs_baseline": ms["baseline"] / ms["current"]}
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def sdpa_best(q, k, v, timer=bench) -> tuple[float, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best = (float("inf"), "none")
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip
        try:
            with sdpa_kernel([be]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                torch.cuda.synchronize()
                ms = timer(
                    lambda be=be: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                )
        except RuntimeError:
            continue
        best = min(best, (ms, name))
    return best


def sweep_decode() -> list[dict]:
    """Time a grid of decode tunings around the defaults on five shapes (CUDA-graph timings); report
    the geometric means (the defaults are the first row)."""
    hq, hkv, d = 32, 8, 128
    fmt = RowFormat(d, 2, d)
    cases = []
    for b, L in ((8, 32768), (1, 131072), (1, 8192), (32, 131072), (8, 4096)):
        pools = make_pools(b, L - SINK_RECENT, SINK_RECENT, hkv, d, fmt)
        cases.append(
            (torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16), pools, (L - SINK_RECENT, SINK_RECENT))
        )
    base = tdec.DEFAULT_TUNING
    grid = [{}, {"num_stages": 4}, {"num_stages": 2}, {"programs": 2048}, {"programs_few": 2048}, {"split_cost": 96},
            {"split_cost": 256}, {"taper": 0.0}, {"hp_programs": 0}, {"swap_block_n": 64}]  # fmt: skip
    rows = []
    for change in grid:
        t = dataclasses.replace(base, **change)
        ts = []
        for q, p, h in cases:
            plan = tdec.plan(q.shape[0], hq, hkv, d, h, DEV, t)
            ts.append(bench_graph(lambda q=q, p=p, h=h, plan=plan: tdec.decode_attention(
                q, *p, 0.088, fmt, fmt, lens_hint=h, plan=plan), 30))  # fmt: skip
        rows.append({"change": change, "ms": ts, "score": math.prod(ts) ** (1 / len(ts))})
        print("sweep decode", change, [f"{t:.4f}" for t in ts], flush=True)
    return rows


def sweep_quantize() -> list[dict]:
    """Time rows per program x warps of quantize_pack at 1M rows, clip 0.96 (defaults first)."""
    fmt = RowFormat(128, 2, 128, clip=0.96)
    x = torch.randn(131072, 8, 128, device=DEV, dtype=torch.bfloat16)
    rows = []
    for br, warps in ((64, 4), *((b, w) for b in (16, 32, 64, 128) for w in (2, 4, 8) if (b, w) != (64, 4))):
        t = dataclasses.replace(tqp.DEFAULT_TUNING, block_r=br, num_warps=warps)
        try:
            ms = bench_graph(lambda t=t: tqp.quantize_pack(x, fmt, t), 30)
        except Exception as e:  # a tuning that does not compile (e.g. out of registers)
            rows.append({"block_r": br, "num_warps": warps, "error": str(e)[-200:]})
            continue
        rows.append({"block_r": br, "num_warps": warps, "ms": ms})
        print("sweep quantize", rows[-1], flush=True)
    return rows


def bench_decode(quick: bool, copy_tbps: float, sides: dict) -> list[dict]:
    """INT2 kernel vs the best BF16 SDPA, both timed from CUDA graphs (device time) and eagerly."""
    rows = []
    hq, hkv, d = 32, 8, 128
    fmt = RowFormat(d, 2, d)
    lengths = (4096, 32768, 131072) if quick else (4096, 8192, 16384, 32768, 65536, 131072)
    for b in (1, 8, 32):
        for L in lengths:
            q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
            lq = L - SINK_RECENT
            pools = make_pools(b, lq, SINK_RECENT, hkv, d, fmt)
            hint = (lq, SINK_RECENT)
            fns = {
                k: (
                    lambda ops=ops, q=q, p=pools, h=hint: ops.decode_attention(
                        q, *p, d**-0.5, fmt, fmt, lens_hint=h
                    )
                )
                for k, ops in sides.items()
            }
            ms = side_by_side(fns, bench_graph)
            ms_eager = bench(fns["current"])
            del pools, fns
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            k = torch.randn(b, hkv, L, d, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            ms_sdpa, be = sdpa_best(q[:, :, None], k, v, bench_graph)
            ms_sdpa_eager, _ = sdpa_best(q[:, :, None], k, v, bench)
            del k, v
            torch.cuda.synchronize()
            tbs = decode_bytes(b, hkv, d, lq, SINK_RECENT) / ms["current"] / 1e9
            row = {"bench": "decode", "batch": b, "len": L, "sdpa_ms": ms_sdpa, "sdpa_backend": be,
                   "int2_ms": ms["current"], "speedup": ms_sdpa / ms["current"], "int2_TBps": tbs,
                   "copy_fraction": tbs / copy_tbps, "sdpa_eager_ms": ms_sdpa_eager,
                   "int2_eager_ms": ms_eager, "speedup_eager": ms_sdpa_eager / ms_eager}  # fmt: skip
            if "baseline" in ms:
                row |= {"baseline_ms": ms["baseline"], "vs_baseline": ms["baseline"] / ms["current"]}
            rows.append(row)
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    return rows


def headline(payload: dict) -> list[tuple[str, str, float]]:
    """The figures for the CSV history: per decode shape (``BATCHxLENGTH``) the graph-timed INT2
    and SDPA ms, their ratio and the INT2 kernel's effective TB/s; per quantize_pack case the
    graph-timed ms and input TB/s."""
    out = []
    for r in payload["decode"]:
        shape = f"{r['batch']}x{r['len']}"
        out += [(shape, "decode_int2_ms", r["int2_ms"]), (shape, "decode_sdpa_ms", r["sdpa_ms"]),
                (shape, "decode_speedup", r["speedup"]), (shape, "decode_int2_TBps", r["int2_TBps"])]  # fmt: skip
    for r in payload["quantize"]:
        shape = f"{r['rows']}x128 clip {r['clip']}"
        out += [(shape, "quantize_pack_ms", r["ms"]), (shape, "quantize_pack_TBps", r["input_TBps"])]
    return out


def markdown(payload: dict) -> str:
    base = payload.get("baseline")
    lines = [f"device copy: {payload['copy_TBps']:.2f} TB/s (read+write)", "", "| check | shape | error | ok |",
             "|---|---|---|---|"]  # fmt: skip
    for r in payload["checks"]:
        err = r.get("rel_err", 1 - r.get("codes_equal", 1))
        lines.append(f"| {r['check']} | {r['shape']} | {err:.2e} | {r['ok']} |")
    extra = " | baseline ms | baseline / current |" if base else " |"
    lines += ["", "| quantize_pack rows | clip | ms (graph) | input TB/s (graph) | eager ms | eager TB/s" + extra,
              "|---|---|---|---|---|---|" + ("---|---|" if base else "")]  # fmt: skip
    for r in payload["quantize"]:
        more = f" {r['baseline_ms']:.4f} | {r['vs_baseline']:.3f} |" if base else ""
        lines.append(f"| {r['rows']} | {r['clip']} | {r['ms']:.4f} | {r['input_TBps']:.2f} | {r['eager_ms']:.4f} | "
                     f"{r['eager_TBps']:.2f} |" + more)  # fmt: skip
    lines += ["", "CUDA-graph replay (device time) and, in the eager columns, Python launches"
              + (f"; baseline: the kernels of {base}, timed alternating with the current ones" if base else "") + ":",
              "", "| batch | length | BF16 SDPA ms (backend) | INT2 ms | speedup | INT2 TB/s | of copy "
              "| SDPA eager ms | INT2 eager ms | eager speedup" + extra,
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if base else "")]  # fmt: skip
    for r in payload["decode"]:
        more = f" {r['baseline_ms']:.4f} | {r['vs_baseline']:.3f} |" if base else ""
        lines.append(f"| {r['batch']} | {r['len']} | {r['sdpa_ms']:.3f} ({r['sdpa_backend']}) | {r['int2_ms']:.4f} | "
                     f"{r['speedup']:.2f}x | {r['int2_TBps']:.2f} | {r['copy_fraction']:.0%} | {r['sdpa_eager_ms']:.3f} "
                     f"| {r['int2_eager_ms']:.3f} | {r['speedup_eager']:.2f}x |" + more)  # fmt: skip
    for name, rows in payload["sweep"].items():
        lines += ["", f"sweep {name}:", ""] + [f"- {r}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--baseline", default=None, help="src/ folder of another checkout to time side by side")
    ap.add_argument("--sweep", default="", help="comma list of tuning grids to time: decode, quantize")
    ap.add_argument("--name", default=None, help="results file name (default gpu_check[_quick])")
    args = ap.parse_args(argv)
    sweeps = {"decode": sweep_decode, "quantize": sweep_quantize}
    unknown = set(filter(None, args.sweep.split(","))) - set(sweeps)
    if unknown:
        raise SystemExit(f"--sweep: unknown grid(s) {sorted(unknown)}; choose from decode, quantize")
    torch.manual_seed(0)
    sides = {"current": resolve("triton", DEV)}
    if args.baseline:
        import_package_copy(args.baseline, "oscarkv_baseline")
        sides["baseline"] = importlib.import_module("oscarkv_baseline.kernels").resolve("triton", DEV)
    copy_tbps = copy_bandwidth(DEV) / 1e12  # read + write bytes of a device copy, TB/s
    payload = {
        "copy_TBps": copy_tbps,
        "baseline": args.baseline,
        "tuning": {"decode": dataclasses.asdict(tdec.DEFAULT_TUNING), "quantize": dataclasses.asdict(tqp.DEFAULT_TUNING)},
        "sweep": {k: sweeps[k]() for k in filter(None, args.sweep.split(","))},
        "checks": check_decode(args.quick) + check_quantize(),
        "quantize": bench_quantize(sides),
        "decode": bench_decode(args.quick, copy_tbps, sides),
    }  # fmt: skip
    md = markdown(payload)
    print(md)
    name = args.name or "gpu_check" + ("_quick" if args.quick else "")
    save(name, payload, md, history=headline(payload))


if __name__ == "__main__":
    main()
