"""Side-by-side timing of decode-attention kernel versions and launch configs on one GPU.

Times the package's Triton decode kernel and, with ``--baseline NAME=DIR``, other versions of it
(a directory holding copies of its ``decode_*.py`` modules and ``launch.py``, e.g. from an earlier commit), each
over a grid of ``(block_n, num_warps, num_stages, programs, ...)`` configs (``--programs`` turns
the wave-filling split rule off unless ``--set fill_waves=...`` is given), or with ``--defaults``
each version's own launch defaults (the table then shows the current module's values in the
launch columns) and only the ``--set KEY=V1,V2`` axes, next to the best BF16 SDPA on the same
shapes (Qwen3-8B's 32/8 heads and head dim 128, or ``--heads``), all graph-timed in one run (``--eager``: eager calls too).
Every (version, config) is first checked against the fp32 torch reference.

    python lab/scripts/decode_variants.py --baseline v0=benchmarks/baseline_kernels/v0
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
import oscarkv.kernels.triton.decode_attention as tda
from _harness import config_value, import_kernel_copy, save
from gpu_check import (
    SINK_RECENT,
    bench,
    bench_graph,
    decode_bytes,
    decode_inputs,
    parse_heads,
    rel,
    sdpa_best,
)

from oscarkv.kernels import ref
from oscarkv.quant import RowFormat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", action="append", default=[], help="NAME=DIR of another kernel version")
    ap.add_argument("--shapes", default="1x131072,8x32768,8x131072,32x32768,32x131072")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--programs", default="1024")
    ap.add_argument(
        "--group-tokens", default="262144", help="CONFIG['group_tokens'] values (heads per program)"
    )
    ap.add_argument(
        "--min-split", default="256", help="CONFIG['min_split'] values (tokens per split, at least)"
    )
    ap.add_argument(
        "--token-groups",
        default="0",
        help="CONFIG['token_groups'] values (0,1): the token-group loop for one KV head per program",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="KEY=V1,V2: more CONFIG entries to sweep (ints, then floats, where they parse, else strings)",
    )
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="keep the module's launch defaults (block_n ... token_groups); sweep only --set",
    )
    ap.add_argument("--eager", action="store_true", help="also time eager calls (Python launch included)")
    ap.add_argument(
        "--heads", default="32x8x128", help="QUERYxKVxHEAD_DIM (Qwen3-8B: 32x8x128; Qwen3.5-4B: 16x4x256)"
    )
    ap.add_argument("--name", default="decode_variants")
    args = ap.parse_args()
    versions = {"current": tda}
    for spec in args.baseline:
        name, path = spec.split("=", 1)
        pkg = import_kernel_copy(
            f"dv_{name}", sorted(Path(path).glob("decode_*.py")) + sorted(Path(path).glob("launch.py"))
        )
        versions[name] = importlib.import_module(f"{pkg}.decode_attention")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    if args.defaults:  # one value per launch axis, the module's own (shown in the table)
        c = tda.CONFIG
        args.block_n, args.warps, args.stages = str(c["block_n"]), str(c["num_warps"]), str(c["num_stages"])
        args.programs, args.group_tokens = str(c["programs"]), str(c["group_tokens"])
        args.min_split, args.token_groups = str(c["min_split"]), str(int(c["token_groups"]))
    extra_keys = [kv.split("=", 1)[0] for kv in args.set]
    extra = list(
        itertools.product(*[[config_value(v) for v in kv.split("=", 1)[1].split(",")] for kv in args.set])
    )
    grid = list(
        itertools.product(
            ints(args.block_n),
            ints(args.warps),
            ints(args.stages),
            ints(args.programs),
            ints(args.group_tokens),
            ints(args.min_split),
            ints(args.token_groups),
            extra,
        )
    )
    try:
        hq, hkv, d = parse_heads(args.heads)
    except ValueError as e:
        ap.error(str(e))
    fmt = RowFormat(d, 2, d)
    rows = []
    for shape in args.shapes.split(","):
        b, L, lq, q, pools = decode_inputs(shape, hq, hkv, d, fmt)
        nbytes = decode_bytes(b, hkv, d, lq, SINK_RECENT)
        want = ref.decode_attention(q, *pools, 1 / math.sqrt(d), fmt, fmt) if b * L <= 1 << 20 else None
        for (vname, mod), (bn, w, st, progs, gt, msplit, tg, ex) in itertools.product(versions.items(), grid):
            saved = dict(mod.CONFIG)
            if tg and "token_groups" not in saved:
                continue  # a version without the token-group loop
            # one tile size and one program count for every case (grouped heads, few head groups);
            # versions that lack those keys ignore them
            if not args.defaults:
                mod.CONFIG.update(block_n=bn, block_n_grouped=bn, num_warps=w, num_stages=st, programs=progs,
                                  programs_few=progs, group_tokens=gt, min_split=msplit, token_groups=bool(tg))  # fmt: skip
                if "fill_waves" in mod.CONFIG and "fill_waves" not in extra_keys:
                    mod.CONFIG["fill_waves"] = False  # --programs decides the split count
            mod.CONFIG.update(dict(zip(extra_keys, ex, strict=True)))

            def fn(mod=mod, q=q, pools=pools, lq=lq):
                return mod.decode_attention(
                    q, *pools, 1 / math.sqrt(d), fmt, fmt, lens_hint=(lq, SINK_RECENT)
                )

            row = {
                "batch": b,
                "len": L,
                "version": vname,
                "block_n": bn,
                "warps": w,
                "stages": st,
                "programs": progs,
                "group_tokens": gt,
                "min_split": msplit,
                "token_groups": tg,
                "set": " ".join(f"{k}={v}" for k, v in zip(extra_keys, ex, strict=True)),
                # below CONFIG['small_tokens'] the launch takes the byte planes with their own config
                "path": "bytes" if b * lq < mod.CONFIG.get("small_tokens", 0) else "main",
            }
            # versions with int2_loop name the loop and its tile (the swap loop has its own)
            lp = mod.int2_loop(d, hq // hkv, hkv, b * lq) if hasattr(mod, "int2_loop") else None
            if lp:
                row.update(path=lp.loop, block_n=lp.block_n)
            try:
                err = rel(fn(), want) if want is not None else float("nan")
                ms = bench_graph(fn)
                if args.eager:
                    row["eager_ms"] = bench(fn)
                row.update(
                    ms=ms,
                    TBps=nbytes / ms / 1e9,
                    rel_err=err,
                    hpb=lp.hpb if lp else mod.heads_per_program(hq // hkv, hkv, b * lq),
                )
                if tg:  # groups per tile the launch took (0: the padded loop, e.g. grouped heads)
                    row["groups"] = lp.token_groups if lp else mod.token_groups(hq // hkv, row["hpb"], bn)
            except Exception as e:  # a config that does not compile (registers, shared memory)
                row["error"] = str(e).splitlines()[-1][:120] if str(e) else type(e).__name__
            mod.CONFIG.clear(), mod.CONFIG.update(saved)
            rows.append(row)
            print(row, flush=True)
        del pools
        torch.cuda.empty_cache()
        k = torch.randn(b, hkv, L, d, device="cuda", dtype=torch.bfloat16)
        ms_sdpa, be = sdpa_best(q[:, :, None], k, torch.randn_like(k), bench_graph)
        del k
        torch.cuda.empty_cache()
        for r in rows:
            if (r["batch"], r["len"]) == (b, L):
                r.update(sdpa_ms=ms_sdpa, sdpa_backend=be, speedup=ms_sdpa / r["ms"] if "ms" in r else None)
    md = [f"query heads {hq}, KV heads {hkv}, head dim {d}", "",
          "| batch | length | version | path | block_n | warps | stages | programs | group tokens | min split | set | heads/prog | ms | speedup vs SDPA | TB/s | rel err |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        cfg = f"| {r['batch']} | {r['len']} | {r['version']} | {r['path']} | {r['block_n']} | {r['warps']} | {r['stages']} | {r['programs']} | {r['group_tokens']} | {r['min_split']} | {r['set']} |"
        md.append(cfg + (f" {r['hpb']} | {r['ms']:.4f} | {r['speedup']:.2f}x | {r['TBps']:.2f} | {r['rel_err']:.1e} |"
                         if "ms" in r else f" - | {r['error']} | | | |"))  # fmt: skip
    if args.eager:
        md += ["", "| batch | length | version | set | graph ms | eager ms |", "|---|---|---|---|---|---|"]
        md += [f"| {r['batch']} | {r['len']} | {r['version']} | {r['set']} | {r['ms']:.4f} | {r['eager_ms']:.4f} |"
               for r in rows if "eager_ms" in r]  # fmt: skip
    print("\n".join(md))
    save(args.name, {"rows": rows}, "\n".join(md))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
