"""Where does a decode call's time go? Per-program timelines from ``%globaltimer`` (H200).

Loads a copy of the package's decode kernel modules in which ``_stage1`` and ``_merge`` read the
GPU's global timer and SM id at their start and end and store them per program (the copy is made
by text edits that must each match once; the package itself is not changed). The call is replayed
from a CUDA graph, and the last replay's timeline is summarised next to the graph-timed median:
when the INT2 and the 16-bit programs start and end, how many INT2 programs start late (after the
first slot frees up), the gap between stage 1's last program and the merge, the merge's length.
``%globaltimer`` ticks in steps of about 32 ns on recent GPUs, and reading it is not ordered with
the program's memory traffic, so the times within one replay are good to a fraction of a
microsecond; ``outside`` compares that one replay with the graph-timed median, and replays vary
by several percent (down to -46 µs at batch 32 / 32K), so read it only as a rough check.

    python lab/scripts/trace_decode.py --shapes 8x32768,8x65536,32x32768
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
import oscarkv.kernels.triton.decode_attention as tda
from _harness import config_value, save
from gpu_check import SINK_RECENT, bench_graph, decode_inputs, parse_heads

from oscarkv.quant import RowFormat

KDIR = Path(tda.__file__).parent

_TIMER = """
@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _sm():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pid():
    return tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))


@triton.jit
def _start(TR):
    tl.store(TR + _pid() * 4, _now())  # stored at once: a live timer would cost registers


@triton.jit
def _record(TR, kind):
    pid = _pid()
    tl.store(TR + pid * 4 + 1, _now())
    tl.store(TR + pid * 4 + 2, _sm().to(tl.int64))
    tl.store(TR + pid * 4 + 3, kind)

"""

# (old, new) text edits of decode_attention.py; each must match exactly once
_EDITS = [
    (
        '\n\n@triton.jit(do_not_specialize=["split_q"',
        "\n" + _TIMER + '\n@triton.jit(do_not_specialize=["split_q"',
    ),
    ("def _stage1(Q, KC,", "def _stage1(TR, Q, KC,"),
    ("    hg = tl.program_id(0)\n", "    _start(TR)\n    hg = tl.program_id(0)\n"),
    (
        '\n\n\n@triton.jit(do_not_specialize=["total"])\ndef _merge(\n    O,',  # the function after _stage1
        "\n    _record(TR, (sp < n_q_splits).to(tl.int64))\n\n\n"
        '@triton.jit(do_not_specialize=["total"])\ndef _merge(\n    TRM, O,',
    ),
    (
        "    row = tl.program_id(0)  # b * Hq + hq\n",
        "    _start(TRM)\n    row = tl.program_id(0)  # b * Hq + hq\n",
    ),
    (
        "(acc / tl.where(den > 0, den, 1.0)).to(OUT.dtype.element_ty))\n",
        "(acc / tl.where(den > 0, den, 1.0)).to(OUT.dtype.element_ty))\n    _record(TRM, 2)\n",
    ),
    (
        "    _STAGE1(\n        grid, q,",
        "    TRACE[0] = _trace_buf(grid, q.device)\n    _STAGE1(\n        grid, TRACE[0], q,",
    ),
    (
        "    _MERGE(\n        (bsz * hq, d // db), o_part,",
        "    TRACE[1] = _trace_buf((bsz * hq, d // db), q.device)\n    _MERGE(\n        (bsz * hq, d // db), TRACE[1], o_part,",
    ),
]
_TAIL = '''

TRACE = [None, None]
_BUFS = {}


def _trace_buf(grid, device):
    """One int64 [programs, 4] buffer per grid (kept, so that a captured graph writes into it)."""
    n = math.prod(grid)
    if grid not in _BUFS:
        _BUFS[grid] = torch.zeros(n, 4, dtype=torch.int64, device=device)
    return _BUFS[grid]
'''


def traced_module():
    """The decode kernel modules copied to a temporary package, ``_stage1``/``_merge`` traced."""
    root = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    pkg = root / "traced_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for f in KDIR.glob("*.py"):
        text = f.read_text().replace("from ...quant", "from oscarkv.quant")
        if f.name == "decode_attention.py":
            for old, new in _EDITS:
                if text.count(old) != 1:
                    raise RuntimeError(
                        f"trace_decode: decode_attention.py no longer has exactly one {old[:50]!r}; "
                        "update _EDITS to the kernel's current text"
                    )
                text = text.replace(old, new)
            text += _TAIL
        (pkg / f.name).write_text(text)
    sys.path.insert(0, str(root))
    return importlib.import_module("traced_kernels.decode_attention")


def pct(x: torch.Tensor, qs=(0.0, 0.5, 0.9, 1.0)) -> list[float]:
    x = x.double().sort().values
    return [float(x[min(len(x) - 1, round(q * (len(x) - 1)))]) for q in qs]


def summarise(mod, ms: float) -> dict:
    s1 = mod.TRACE[0].cpu()
    mg = mod.TRACE[1].cpu()
    t_origin = int(s1[:, 0].min())
    us = lambda t: (t - t_origin) / 1e3  # noqa: E731  ns -> µs from stage 1's first program
    q, h = s1[s1[:, 3] == 1], s1[s1[:, 3] == 0]
    out = {"graph_ms": ms, "int2_programs": len(q), "hp_programs": len(h), "merge_programs": len(mg)}
    for name, t in (("int2", q), ("hp", h), ("merge", mg)):
        if len(t):
            out[f"{name}_start_us"] = [round(us(v), 2) for v in pct(t[:, 0])]
            out[f"{name}_end_us"] = [round(us(v), 2) for v in pct(t[:, 1])]
            out[f"{name}_dur_us"] = [round(v / 1e3, 2) for v in pct(t[:, 1] - t[:, 0])]
    first_free = int(s1[:, 1].min())
    out["int2_late"] = int((q[:, 0] > first_free).sum())
    ends = [int(s1[s1[:, 2] == sm, 1].max()) for sm in s1[:, 2].unique()]
    out["sm_end_us"] = [round(us(v), 2) for v in pct(torch.tensor(ends))]
    out["sms"] = len(ends)
    # per SM: its INT2 and 16-bit programs and when its last program ended, grouped by the
    # number of INT2 programs it ran ("n: SMs, mean end µs, hp programs per SM")
    per_sm: dict[int, list] = {}
    for sm in s1[:, 2].unique():
        on = s1[s1[:, 2] == sm]
        n_q = int((on[:, 3] == 1).sum())
        per_sm.setdefault(n_q, []).append((us(int(on[:, 1].max())), int((on[:, 3] == 0).sum())))
    out["by_int2_per_sm"] = "; ".join(
        f"{k}: {len(v)} SMs, {sum(e for e, _ in v) / len(v):.1f} µs, {sum(h for _, h in v) / len(v):.1f} hp"
        for k, v in sorted(per_sm.items())
    )
    out["stage1_span_us"] = round(us(int(s1[:, 1].max())), 2)
    out["merge_gap_us"] = round(us(int(mg[:, 0].min())) - out["stage1_span_us"], 2)
    out["kernel_span_us"] = round(us(int(mg[:, 1].max())), 2)
    out["outside_us"] = round(ms * 1e3 - out["kernel_span_us"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x32768,8x65536,8x131072,32x32768")
    ap.add_argument("--heads", default="32x8x128", help="QUERYxKVxHEAD_DIM")
    ap.add_argument("--set", action="append", default=[], help="KEY=V1,V2: CONFIG entries to compare")
    ap.add_argument("--name", default="trace_decode")
    ap.add_argument("--raw", default="", help="directory for the raw [programs, 4] timelines (torch.save)")
    args = ap.parse_args()
    mod = traced_module()
    try:
        hq, hkv, d = parse_heads(args.heads)
    except ValueError as e:
        ap.error(str(e))
    fmt = RowFormat(d, 2, d)
    keys = [kv.split("=", 1)[0] for kv in args.set]
    combos = [[]]
    for kv in args.set:
        combos = [[*c, config_value(v)] for c in combos for v in kv.split("=", 1)[1].split(",")]
    rows = []
    for shape in args.shapes.split(","):
        b, L, lq, q, pools = decode_inputs(shape, hq, hkv, d, fmt)
        for combo in combos:
            saved = dict(mod.CONFIG)
            mod.CONFIG.update(dict(zip(keys, combo, strict=True)))
            tda.CONFIG.update(dict(zip(keys, combo, strict=True)))
            call = (q, *pools, 1 / math.sqrt(d), fmt, fmt)

            def fn(m=mod, call=call, hint=(lq, SINK_RECENT)):
                return m.decode_attention(*call, lens_hint=hint)

            seen = set(tda._STAGE1._cache)
            traced = bench_graph(fn)
            ref_ms = bench_graph(lambda f=fn: f(tda))  # the untraced kernel, same config
            # registers and spills of the untraced stage 1 this config compiled (or reused)
            new = [k for k in tda._STAGE1._cache if k not in seen] or list(tda._STAGE1._cache)[-1:]
            regs = "/".join(f"{c.n_regs}r{c.n_spills}s" for c, _ in (tda._STAGE1._cache[k] for k in new))
            g = torch.cuda.CUDAGraph()
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                fn()
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            lp = mod.int2_loop(d, hq // hkv, hkv, b * lq)
            if args.raw:
                Path(args.raw).mkdir(parents=True, exist_ok=True)
                tag = f"{b}x{L}" + "".join(f"_{k}{v}" for k, v in zip(keys, combo, strict=True))
                torch.save([t.cpu() for t in mod.TRACE], Path(args.raw) / f"trace_{tag}.pt")
            row = {"batch": b, "len": L, "set": " ".join(f"{k}={v}" for k, v in zip(keys, combo, strict=True)),
                   "loop": lp.loop, "hpb": lp.hpb, "regs": regs, "untraced_ms": ref_ms, **summarise(mod, traced)}  # fmt: skip
            mod.CONFIG.clear(), mod.CONFIG.update(saved)
            tda.CONFIG.clear(), tda.CONFIG.update(saved)
            rows.append(row)
            print(row, flush=True)
            del g
        del pools, call
        torch.cuda.empty_cache()
    fmt_l = lambda v: "/".join(f"{x:.1f}" for x in v) if isinstance(v, list) else str(v)  # noqa: E731
    cols = ["batch", "len", "set", "loop", "hpb", "regs", "untraced_ms", "graph_ms", "int2_programs", "hp_programs",
            "int2_late", "int2_start_us", "int2_end_us", "int2_dur_us", "hp_end_us", "hp_dur_us", "sm_end_us",
            "stage1_span_us", "merge_gap_us", "merge_dur_us", "kernel_span_us", "outside_us", "by_int2_per_sm"]  # fmt: skip
    md = [
        "Per-program timelines (µs from stage 1's first program start); lists are min/median/p90/max.",
        "`outside`: graph-timed ms minus the span from stage 1's first start to the merge's last end.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        md.append("| " + " | ".join(fmt_l(r.get(c)) if not isinstance(r.get(c), float) else f"{r[c]:.4f}"
                                    for c in cols) + " |")  # fmt: skip
    print("\n".join(md))
    save(args.name, {"rows": rows}, "\n".join(md))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
