"""Check and benchmark the Triton kernels on one GPU in a single run; prints a short table.

1. correctness of decode attention and quantize_pack against the torch twins (fp32 oracle);
2. quantize_pack bandwidth on its input bytes;
3. decode attention vs BF16 SDPA (flash / cuDNN / efficient, best taken) on Qwen3-8B shapes
   (32 query heads, 8 KV heads, head dim 128), batch 1/8/32, lengths 4K-128K, with the bytes the
   INT2 kernel must read turned into an effective bandwidth next to a device copy's. Both sides
   are timed replayed from CUDA graphs (device time, as serving engines run decode) and from eager
   Python launches (host overhead included).

    python benchmarks/gpu_check.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import env_info, save

from oscarkv.config import QuantSpec
from oscarkv.kernels import ref
from oscarkv.kernels.triton import decode_attention as tda
from oscarkv.kernels.triton import quantize_pack as tqp
from oscarkv.kernels.triton.dequantize import dequantize as tdq
from oscarkv.quant import RowFormat

DEV = torch.device("cuda")
SINK_RECENT = 320


def bench(fn, rep=100) -> float:
    """Median ms per call, launched from Python (host overhead included when it dominates)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def bench_graph(fn, rep=100) -> float:
    """Median ms per call replayed from a CUDA graph (device time only, as serving engines run decode)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEV).normal_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * nbytes / ms / 1e9  # read + write, TB/s


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


def parse_heads(text: str) -> tuple[int, int, int]:
    """``QUERYxKVxHEAD_DIM`` (e.g. ``32x8x128``) -> the three ints, checked."""
    try:
        hq, hkv, d = (int(x) for x in text.split("x"))
    except ValueError:
        raise ValueError(f"--heads must be QUERYxKVxHEAD_DIM, e.g. 32x8x128; got {text!r}") from None
    if hq % hkv or d not in (64, 128, 256):
        raise ValueError(
            f"--heads: query heads must be a multiple of KV heads and head dim 64, 128 or 256; got {text}"
        )
    return hq, hkv, d


def decode_inputs(shape: str, hq: int, hkv: int, d: int, fmt: RowFormat):
    """``BATCHxLENGTH`` -> ``(b, L, lq, q, pools)``: bf16 queries and pools of ``L - SINK_RECENT``
    quantized and ``SINK_RECENT`` 16-bit tokens per sequence (``make_pools``)."""
    b, L = (int(x) for x in shape.split("x"))
    lq = L - SINK_RECENT
    q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
    return b, L, lq, q, make_pools(b, lq, SINK_RECENT, hkv, d, fmt)


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
        out = tda.decode_attention(q, *pools, 1 / math.sqrt(d), fmt, fmt)
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
        c1, m1 = tqp.quantize_pack(x, None, fmt)
        c2, m2 = ref.quantize_pack(x, None, fmt)
        same = float((c1 == c2).float().mean())
        rows.append(
            {
                "check": "quantize_pack",
                "shape": f"d{d} clip{clip}",
                "codes_equal": same,
                "meta_equal": bool(torch.equal(m1, m2)),
                "ok": same == 1.0 and torch.equal(m1, m2),
            }
        )
        r = torch.linalg.qr(torch.randn(d, d, device=DEV, dtype=torch.float64))[0].float()
        c1, m1 = tqp.quantize_pack(x, r, fmt)
        deq1 = ref.dequantize(c1, m1, fmt)
        rot = x.float() @ r.bfloat16().float()
        c2, m2 = ref.quantize_pack(rot, None, fmt)
        deq2 = ref.dequantize(c2, m2, fmt)
        e = rel(deq1, deq2)
        rows.append(
            {
                "check": "quantize_pack+R",
                "shape": f"d{d}",
                "codes_equal": float((c1 == c2).float().mean()),
                "rel_err": e,
                "ok": e < 2e-2,
            }
        )
        c = tdq(c2, m2, fmt, torch.float32)
        rows.append(
            {"check": "dequantize", "shape": f"d{d}", "rel_err": rel(c, deq2), "ok": rel(c, deq2) < 1e-6}
        )
    return rows


def bench_quantize() -> list[dict]:
    """quantize_pack at d 128 over bf16 rows, at the default key and value clips (0.96 / 0.92)."""
    rows = []
    spec = QuantSpec()
    for n_rows, clip, rot in itertools.product(
        (65536, 262144, 1048576), (spec.k_clip, spec.v_clip), (False, True)
    ):
        fmt = RowFormat(128, 2, 128, clip=clip)
        x = torch.randn(n_rows // 8, 8, 128, device=DEV, dtype=torch.bfloat16)
        r = torch.linalg.qr(torch.randn(128, 128, device=DEV))[0] if rot else None
        fn = lambda x=x, r=r, fmt=fmt: tqp.quantize_pack(x, r, fmt)  # noqa: E731
        ms, ms_eager = bench_graph(fn), bench(fn)  # graph: device time; eager: launch included
        tbs = x.numel() * 2 / ms / 1e9
        rows.append({"bench": "quantize_pack", "rows": n_rows, "clip": clip, "rotate": rot, "ms": ms,
                     "input_TBps": tbs, "eager_ms": ms_eager, "eager_TBps": x.numel() * 2 / ms_eager / 1e9})  # fmt: skip
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
    """Time the decode kernel's tuning space on four shapes (CUDA-graph timings); keep the best
    geometric mean."""
    hq, hkv, d = 32, 8, 128
    fmt = RowFormat(d, 2, d)
    cases = []
    for b, L in ((8, 32768), (1, 131072), (1, 8192), (32, 131072), (8, 4096)):
        pools = make_pools(b, L - SINK_RECENT, SINK_RECENT, hkv, d, fmt)
        cases.append(
            (torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16), pools, (L - SINK_RECENT, SINK_RECENT))
        )
    # one-warp programs around the module defaults (decode_variants.py sweeps the wider space)
    configs = [dict(block_n=bn, block_n_grouped=bg, num_warps=1, num_stages=st, programs=pr, programs_few=pf)
               for bn, bg, st, pr, pf in ((64, 32, 3, 3072, 1024), (64, 32, 4, 3072, 1024), (64, 32, 3, 2048, 1024),
                                          (64, 32, 3, 3072, 2048), (32, 32, 3, 3072, 1024), (64, 64, 3, 3072, 1024))]  # fmt: skip
    rows = []
    for cfg in configs:
        tda.CONFIG.update(cfg)
        try:
            ts = [bench_graph(lambda q=q, p=p, h=h: tda.decode_attention(q, *p, 0.088, fmt, fmt, lens_hint=h), 30)
                  for q, p, h in cases]  # fmt: skip
        except Exception as e:  # a config that does not compile (e.g. out of shared memory)
            rows.append({"config": dict(tda.CONFIG), "error": str(e)[-300:]})
            print("config failed:", tda.CONFIG, str(e)[-600:], flush=True)
            continue
        rows.append({"config": dict(tda.CONFIG), "ms": ts, "score": math.prod(ts) ** (1 / len(ts))})
        print("sweep", cfg, [f"{t:.4f}" for t in ts], flush=True)
    best = min((r for r in rows if "score" in r), key=lambda r: r["score"])
    tda.CONFIG.update(best["config"])
    print("decode config:", tda.CONFIG, flush=True)
    return rows


def sweep_quantize() -> list[dict]:
    fmt = RowFormat(128, 2, 128, clip=0.96)
    x = torch.randn(131072, 8, 128, device=DEV, dtype=torch.bfloat16)
    r = torch.linalg.qr(torch.randn(128, 128, device=DEV))[0]
    rows, best = [], {}
    for br in (16, 32, 64):
        for warps in (2, 4, 8):
            tqp.BLOCK_R, tqp.NUM_WARPS = br, warps
            try:
                ms = bench(lambda: tqp.quantize_pack(x, None, fmt), 30)
            except Exception as e:
                rows.append({"rotate": False, "block_r": br, "warps": warps, "error": str(e)[:80]})
                continue
            rows.append({"rotate": False, "block_r": br, "warps": warps, "ms": ms})
            if ms < best.get(False, (float("inf"),))[0]:
                best[False] = (ms, br, warps)
    # rotation: rows per program (4 warps per 64 rows), prefetch depth, programs per SM (0: one
    # block per program), register cap
    rot_cfgs = [(64, st, ps, 128) for st in (1, 2, 3) for ps in (2, 3, 4)] + [(64, 2, 3, 0), (128, 2, 2, 128)]
    for cfg in rot_cfgs:
        tqp.BLOCK_R_ROT, tqp.ROT_STAGES, tqp.ROT_PER_SM, tqp.ROT_MAXNREG = cfg
        try:
            ms = bench_graph(lambda: tqp.quantize_pack(x, r, fmt), 30)
        except Exception as e:
            rows.append({"rotate": True, "config": cfg, "error": str(e)[:80]})
            continue
        rows.append({"rotate": True, "config": cfg, "ms": ms})
        if ms < best.get(True, (float("inf"),))[0]:
            best[True] = (ms, cfg)
    tqp.BLOCK_R, tqp.NUM_WARPS = best[False][1], best[False][2]
    tqp.BLOCK_R_ROT, tqp.ROT_STAGES, tqp.ROT_PER_SM, tqp.ROT_MAXNREG = best[True][1]
    return rows


def bench_decode(quick: bool, copy_tbps: float) -> list[dict]:
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
            fn = lambda q=q, pools=pools, hint=hint: tda.decode_attention(  # noqa: E731
                q, *pools, 1 / math.sqrt(d), fmt, fmt, lens_hint=hint
            )
            ms, ms_eager = bench_graph(fn), bench(fn)
            del pools
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            k = torch.randn(b, hkv, L, d, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            ms_sdpa, be = sdpa_best(q[:, :, None], k, v, bench_graph)
            ms_sdpa_eager, _ = sdpa_best(q[:, :, None], k, v, bench)
            del k, v
            torch.cuda.synchronize()
            nbytes = decode_bytes(b, hkv, d, lq, SINK_RECENT)
            tbs = nbytes / ms / 1e9
            rows.append({"bench": "decode", "batch": b, "len": L, "sdpa_ms": ms_sdpa, "sdpa_backend": be,
                         "int2_ms": ms, "speedup": ms_sdpa / ms, "int2_TBps": tbs,
                         "copy_fraction": tbs / copy_tbps, "sdpa_eager_ms": ms_sdpa_eager,
                         "int2_eager_ms": ms_eager, "speedup_eager": ms_sdpa_eager / ms_eager})  # fmt: skip
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
        shape = f"{r['rows']}x128 clip {r['clip']}" + (" rotated" if r["rotate"] else "")
        out += [(shape, "quantize_pack_ms", r["ms"]), (shape, "quantize_pack_TBps", r["input_TBps"])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep (use the module defaults)")
    ap.add_argument("--sweep", default="decode,quantize", help="kernels to sweep: decode, quantize or both")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_tbps = copy_bandwidth()
    sweeps = {"decode": sweep_decode, "quantize": sweep_quantize}
    swept = {} if args.no_sweep else {k: sweeps[k]() for k in args.sweep.split(",") if k}
    checks = check_decode(args.quick) + check_quantize()
    qb = bench_quantize()
    dec = bench_decode(args.quick, copy_tbps)
    lines = [
        f"device copy: {copy_tbps:.2f} TB/s (read+write)",
        "",
        "| check | shape | error | ok |",
        "|---|---|---|---|",
    ]
    for r in checks:
        err = r.get("rel_err", 1 - r.get("codes_equal", 1))
        lines.append(f"| {r['check']} | {r['shape']} | {err:.2e} | {r['ok']} |")
    lines += ["", "| quantize_pack rows | clip | rotate | ms (graph) | input TB/s (graph) | eager ms | eager TB/s |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['rows']} | {r['clip']} | {r['rotate']} | {r['ms']:.4f} | {r['input_TBps']:.2f} | {r['eager_ms']:.4f} | "
              f"{r['eager_TBps']:.2f} |" for r in qb]  # fmt: skip
    lines += ["", "CUDA-graph replay (device time) and, in the last three columns, eager Python launches:", "",
              "| batch | length | BF16 SDPA ms (backend) | INT2 ms | speedup | INT2 TB/s | of copy "
              "| SDPA eager ms | INT2 eager ms | eager speedup |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['batch']} | {r['len']} | {r['sdpa_ms']:.3f} ({r['sdpa_backend']}) | {r['int2_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['int2_TBps']:.2f} | {r['copy_fraction']:.0%} | {r['sdpa_eager_ms']:.3f} "
              f"| {r['int2_eager_ms']:.3f} | {r['speedup_eager']:.2f}x |" for r in dec]  # fmt: skip
    md = "\n".join(lines)
    print(md)
    payload = {
        "copy_TBps": copy_tbps,
        "config": {
            "decode": dict(tda.CONFIG),
            "quantize": [
                tqp.BLOCK_R,
                tqp.NUM_WARPS,
                tqp.BLOCK_R_ROT,
                tqp.ROT_STAGES,
                tqp.ROT_PER_SM,
                tqp.ROT_MAXNREG,
            ],
        },
        "sweep": swept,
        "checks": checks,
        "quantize": qb,
        "decode": dec,
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "gpu_check.json").write_text(json.dumps({"env": env_info(), **payload}, indent=1))
    save("gpu_check" + ("_quick" if args.quick else ""), payload, md, history=headline(payload))


if __name__ == "__main__":
    main()
