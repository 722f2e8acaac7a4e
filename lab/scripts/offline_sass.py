"""Compile the Triton decode and quantize kernels of an oscarkv source tree for sm_90 offline (no
GPU: Triton's bundled ptxas and cuobjdump) at the specializations the product launches, and
compare two trees' SASS.

    python lab/scripts/offline_sass.py dump --src /path/to/tree/src --out a.json
    python lab/scripts/offline_sass.py compare a.json b.json

``dump`` runs the tree's launchers (decode, quantize_pack, and the rotations of a decode step's
new rows) on CPU tensors with a launch recorder in place of the launch
(plans made for a 132-SM H200), then compiles every recorded specialization with the CUDA
settings the launcher would pick on the GPU (inline PTX, dependent launches, register caps).
``compare`` matches cases by name and reports registers, spills, instruction counts and whether
the SASS is identical once constant-bank offsets (kernel parameter layout) are masked.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SMS = 132
DECODE = [  # name, batch, Hq, Hkv, d, quantized tokens, 16-bit tokens
    *[(f"qwen8b-b{b}-{L // 1024}k", b, 32, 8, 128, L - 320, 320) for b in (1, 8, 32)
      for L in (4096, 8192, 16384, 32768, 65536, 131072)],
    ("smollm-b8-8k", 8, 9, 3, 64, 8192 - 320, 320),
    ("d256-b8-32k", 8, 16, 8, 256, 32768 - 320, 320),
    ("d256-b32-128k", 32, 16, 8, 256, 131072 - 320, 320),
    ("g8-b32-128k", 32, 64, 8, 128, 131072 - 320, 320),
    ("g3-b16-32k", 16, 12, 4, 128, 32768 - 320, 320),
]  # fmt: skip
QUANT = [("q-d128-c96", 128, 0.96), ("q-d128-c92", 128, 0.92), ("q-d64-c92", 64, 0.92), ("q-d256-c96", 256, 0.96),
         ("q-d128-c0", 128, 0.0)]  # fmt: skip


def _record(launch_mod):
    seen = []

    def call(self, grid, *args, **kwargs):
        seen.append((self.fn, grid, args, dict(kwargs)))

    launch_mod.Launcher.__call__ = call
    return seen


def _sig(fn, args, kwargs):
    import torch

    types = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
             torch.int64: "i64", torch.uint8: "u8", torch.int16: "i16", torch.int8: "i8",
             torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip
    names = fn.arg_names
    nospec = {names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", [])}
    sig, consts, attrs = {}, {}, {}
    params = dict(zip(names, args, strict=False))
    options = {k: v for k, v in kwargs.items() if k not in names}
    for i, name in enumerate(names):
        if name in params:
            v = params[name]
            if isinstance(v, torch.Tensor):
                sig[name] = "*" + types[v.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, bool):
                sig[name] = "i1"
            elif isinstance(v, int):
                if v == 1 and name not in nospec:
                    sig[name], consts[name] = "constexpr", 1
                else:
                    sig[name] = "i32" if -(1 << 31) <= v < 1 << 31 else "i64"
                    if v % 16 == 0 and name not in nospec:
                        attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, float):
                sig[name] = "fp32"
            else:
                raise TypeError(f"{name}: {type(v)}")
        else:
            sig[name] = "constexpr"
            consts[name] = kwargs[name] if name in kwargs else fn.params[i].default
    return sig, consts, attrs, options


def _sass(cubin: bytes) -> list[str]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in out.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            lines.append(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][P]", m.group(1)))
    return lines


def _resources(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and stack bytes (spills) from ``cuobjdump -res-usage``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return int(re.search(r"REG:(\d+)", out).group(1)), int(re.search(r"STACK:(\d+)", out).group(1))


def _compile(fn, args, kwargs, overrides):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = {**kwargs, **overrides}
    sig, consts, attrs, options = _sig(fn, args, kwargs)
    c = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    sass = _sass(c.asm["cubin"])
    ops = collections.Counter(s.split()[0] if not s.startswith("@") else s.split()[1] for s in sass)
    regs, stack = _resources(c.asm["cubin"])
    return {"regs": regs, "spills": stack, "n": len(sass), "sass": sass, "ops": dict(ops),
            "constexprs": {k: repr(v) for k, v in consts.items()}}  # fmt: skip


def dump(src: str, out: str, windows: str = "bf16") -> None:
    sys.path.insert(0, src)
    import torch

    from oscarkv.kernels.triton import launch
    from oscarkv.quant import RowFormat

    seen = _record(launch)
    wdt = torch.float8_e4m3fn if windows == "fp8" else torch.bfloat16  # the window pools' dtype
    try:  # the tuning API
        from oscarkv.kernels.triton import decode as dec

        tuning = dataclasses.replace(dec.DEFAULT_TUNING, sms=SMS)

        def run_decode(q, pools, lists, fmt, lens):
            p = dec.plan(q.shape[0], q.shape[1], pools[4].shape[1], q.shape[2], lens, "cpu", tuning)
            dec.decode_attention(q, *pools, *lists, 0.088, fmt, fmt, lens_hint=lens, plan=p)
    except ImportError:  # the CONFIG dict
        from oscarkv.kernels.triton import decode_attention as dec

        dec.CONFIG["sms"] = SMS

        def run_decode(q, pools, lists, fmt, lens):
            dec.decode_attention(q, *pools, *lists, 0.088, fmt, fmt, lens_hint=lens)

    from oscarkv.kernels.triton import quantize_pack as qp

    results = {}
    for name, b, hq, hkv, d, lq, lh in DECODE:
        fmt = RowFormat(d, 2, d)
        pools = (torch.zeros(8, hkv, d // 4, dtype=torch.uint8), torch.zeros(8, hkv, 1, 2, dtype=torch.float16),
                 torch.zeros(8, hkv, d // 4, dtype=torch.uint8), torch.zeros(8, hkv, 1, 2, dtype=torch.float16),
                 torch.zeros(8, hkv, d, dtype=wdt), torch.zeros(8, hkv, d, dtype=wdt))  # fmt: skip
        lists = (torch.zeros(b + 1, dtype=torch.int32), torch.zeros(8, dtype=torch.int32),
                 torch.zeros(b + 1, dtype=torch.int32), torch.zeros(8, dtype=torch.int32))  # fmt: skip
        seen.clear()
        run_decode(torch.zeros(b, hq, d, dtype=torch.bfloat16), pools, lists, fmt, (lq, lh))
        for (fn, grid, args, kw), kind in zip(seen, ("stage1", "merge"), strict=True):
            over = {"ASM": True, "PDL": True} if kind == "stage1" else {"PDL": True, "launch_pdl": True}
            r = _compile(fn, args, kw, over)
            r["grid"] = list(grid)
            results[f"{name}/{kind}"] = r
            print(name, kind, grid, r["regs"], r["spills"], r["n"], flush=True)
    for name, d, clip in QUANT:
        fmt = RowFormat(d, 2, d, clip=clip)
        seen.clear()
        x = torch.zeros(4096, 8, d, dtype=torch.bfloat16)
        try:
            qp.quantize_pack(x, fmt)
        except TypeError:  # trees whose quantize_pack took a rotation first
            qp.quantize_pack(x, None, fmt)
        ((fn, grid, args, kw),) = seen
        packed = bool(kw["PACKED"])
        tree = (min(d // 8, 8, max(1, 64 * d // (256 * 4))) if packed else min(d // 8, 8)).bit_length() - 1
        over = {"ASM": 1 if packed else 0, "PDL": True, "launch_pdl": True, "TREE": tree}
        if packed and d == 128:
            over["maxnreg"] = 128
        r = _compile(fn, args, kw, over)
        results[name] = r
        print(name, r["regs"], r["spills"], r["n"], flush=True)
    try:  # the rotation kernels (trees that have them): a decode step's new rows, batch 1 and 16
        from oscarkv.kernels.triton import rotate as rot

        for b, d in ((1, 128), (16, 128), (8, 64)):
            seen.clear()
            q, k = torch.zeros(b, 32, d, dtype=torch.bfloat16), torch.zeros(b, 8, d, dtype=torch.bfloat16)
            pool = torch.zeros(64, 8, d, dtype=wdt)
            r = torch.zeros(d, d)
            rot.rotate_new_rows(
                q, k, k.clone(), r, None, pool, pool.clone(), torch.zeros(b, dtype=torch.int64)
            )
            rot.rotate_heads(q, r, inverse=True)
            for i, (fn, grid, args, kw) in enumerate(seen):
                r_ = _compile(fn, args, kw, {})
                r_["grid"] = list(grid)
                results[f"rotate-b{b}-d{d}/{i}"] = r_
                print(f"rotate b{b} d{d} {i}", grid, r_["regs"], r_["spills"], r_["n"], flush=True)
    except ImportError:
        pass
    Path(out).write_text(json.dumps(results))


def compare(a: str, b: str) -> None:
    ra, rb = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    print("| case | regs | spills | SASS instructions | identical (params masked) |\n|---|---|---|---|---|")
    for k in ra:
        x, y = ra[k], rb.get(k)
        if y is None:
            print(f"| {k} | missing in {b} | | | |")
            continue
        same = x["sass"] == y["sass"]
        diff = "" if same else " ".join(
            f"{op}:{x['ops'].get(op, 0)}->{y['ops'].get(op, 0)}"
            for op in sorted(set(x["ops"]) | set(y["ops"])) if x["ops"].get(op, 0) != y["ops"].get(op, 0)
        )  # fmt: skip
        print(f"| {k} | {x['regs']} / {y['regs']} | {x['spills']} / {y['spills']} | {x['n']} / {y['n']} | "
              f"{'yes' if same else 'no ' + diff[:200]} |")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--src", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--windows", choices=("bf16", "fp8"), default="bf16", help="the window pools' dtype")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    dump(args.src, args.out, args.windows) if args.cmd == "dump" else compare(args.a, args.b)
