"""quantize_pack: a previous version of the Triton kernel against the current one, side by side.

Same inputs, same machine, same run: the codes and metadata of both must be identical (with
rotation too), then both are timed from CUDA graphs (device time; TB/s on the input bytes, bf16
rows ``[N, 8, 128]``, and ``[N, 8, 256]`` at clip 0.96). ``--sweep layer,none`` also times the tunables of the current kernel
with rotation (rows per program, prefetch depth, programs per SM, register cap, merge levels) and
without (rows per program, warps, register cap), checks each against the default's output, and
reports the best; ``--sweep packed`` the same without rotation for the fp32 and the packed clip
network (``PACKED``) each, the packed one also at every round count (``PACKED_ROUNDS``, timed at
clip 0.92 too).

The previous kernel is a copy of the module at another commit, loaded from a file, e.g.

    git show <rev>:src/oscarkv/kernels/triton/quantize_pack.py > out/qp_old.py
    python lab/scripts/quantize_pack_ab.py --old out/qp_old.py [--sweep layer,none] [--out DIR]

or, with ``--packed``, the current module with the fp32 clip network (``PACKED = False``)
against itself with the packed one (bf16 rows without rotation; other cases run the same kernel):

    python lab/scripts/quantize_pack_ab.py --packed [--sweep packed] [--out DIR]

or, with ``--round-k``, the current module with clip rounds of six values (``ROUND_K = 6``: clip
0.92 takes two rounds, the fp32 network without rotation) against itself with rounds of twelve
(one round, the packed network without rotation; at d=128 clip 0.96 and 0.0 run one kernel):

    python lab/scripts/quantize_pack_ab.py --round-k [--out DIR]

or, with ``--pdl``, the current module launched ordinarily (``PDL = False``) against itself as a
programmatic dependent launch (each call of the CUDA graph waits on the one before it through
``griddepcontrol``, as it would on the kernel that produced its rows; only without rotation: with
it both columns are ordinary launches):

    python lab/scripts/quantize_pack_ab.py --pdl [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/: _harness and co.
from _harness import env_info, import_kernel_copy

from oscarkv.kernels.triton import quantize_pack as new
from oscarkv.quant import RowFormat

DEV = torch.device("cuda")


def load_old(path: str):
    """The previous ``quantize_pack`` module, imported from a copy of its file (with the
    ``quantize_nets.py`` and ``launch.py`` beside it, or the current ones where there are none)."""
    f = Path(path)
    files = [f]
    for name in ("quantize_nets.py", "launch.py"):
        beside = f.with_name(name)
        files.append(beside if beside.exists() else Path(new.__file__).with_name(name))
    return importlib.import_module(f"{import_kernel_copy('qp_old', files)}.{f.stem}")


class Switched:
    """The current module with some tunables set during each call (``PACKED=False``: the fp32 clip
    network; ``ROUND_K=6``: clip rounds of six; ``PDL=False``: ordinary launches), as an "old" kernel; a CUDA graph captures the
    kernel the call launched."""

    def __init__(self, **values):
        self.values = values

    def quantize_pack(self, *args):
        saved = {k: getattr(new, k) for k in self.values}
        for k, v in self.values.items():
            setattr(new, k, v)
        try:
            return new.quantize_pack(*args)
        finally:
            for k, v in saved.items():
                setattr(new, k, v)


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def inputs(n_rows: int, rot: str, d: int = 128):
    g = torch.Generator(device=DEV).manual_seed(n_rows)
    x = (torch.randn(n_rows // 8, 8, d, device=DEV, generator=g) * 2 + 0.2).bfloat16()
    if rot == "none":
        return x, None
    shape = (8, d, d) if rot == "per-head" else (d, d)
    r = torch.linalg.qr(torch.randn(*shape, device=DEV, dtype=torch.float64, generator=g))[0].float()
    return x, r


def compare(old, n_rows: int, clip: float, rot: str, d: int = 128) -> dict:
    fmt = RowFormat(d, 2, d, clip=clip)
    x, r = inputs(n_rows, rot, d)
    c0, m0 = old.quantize_pack(x, r, fmt)
    c1, m1 = new.quantize_pack(x, r, fmt)
    same = torch.equal(c0, c1) and torch.equal(m0, m1)
    t0 = timed(lambda: old.quantize_pack(x, r, fmt))
    t1 = timed(lambda: new.quantize_pack(x, r, fmt))
    tb = x.numel() * 2 / 1e9
    row = {"rows": n_rows, "d": d, "clip": clip, "rotate": rot, "identical": same,
           "codes_equal": float((c0 == c1).float().mean()), "old_ms": t0, "new_ms": t1,
           "old_TBps": tb / t0, "new_TBps": tb / t1}  # fmt: skip
    print(f"| {n_rows} | {clip} | {rot if d == 128 else f'{rot}, d={d}'} | {same} | {t0:.4f} | {t1:.4f} | {tb / t0:.2f} | {tb / t1:.2f} "
          f"| {t0 / t1:.2f}x |", flush=True)  # fmt: skip
    return row


def _rot_configs() -> list[dict]:
    """The rotation path's tunables: rows per program, prefetch depth, programs per SM (0: one
    block per program), register cap, in-thread merge levels of the clip network."""
    keys = ("BLOCK_R_ROT", "ROT_STAGES", "ROT_PER_SM", "ROT_MAXNREG", "ROT_TREE")
    # the row-block loop (ROT_PER_SM > 0) measured slower at every setting (quantize_pack_ab_h200.md)
    cfgs = [(64, 1, 0, mr, tree) for mr in (128, 168, 0) for tree in (0, 1, 2)]
    cfgs += [(64, 2, 3, 128, 0), (128, 1, 0, 128, 0), (128, 1, 0, 0, 0)]
    return [dict(zip(keys, c, strict=True)) for c in cfgs]


def _plain_configs() -> list[dict]:
    """Without rotation: rows per program, warps, register cap (of the fp32 and the packed clip
    network alike)."""
    return [
        {"BLOCK_R": br, "NUM_WARPS": w, "MAXNREG": mr, "PACKED_MAXNREG": mr}
        for br, w, mr in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (0, 128))
        if 8 <= br // w <= 32
    ]


def _packed_configs() -> list[dict]:
    """``_plain_configs`` with the fp32 and with the packed clip network, the latter also at every
    round count (at the default rows per program and warps)."""
    return [
        {**c, "PACKED": packed, "PACKED_ROUNDS": rounds}
        for packed, rounds in ((False, 1), (True, 1), (True, 99))
        for c in _plain_configs()
        if rounds == 1 or (c["BLOCK_R"], c["NUM_WARPS"]) == (new.BLOCK_R, new.NUM_WARPS)
    ]


def sweep(rot: str) -> list[dict]:
    """Time the module's tunables (``rot``: "layer" for the rotation path, "none" without,
    "packed" without for both clip networks) at 64K and 1M rows, clip 0.96 (packed: also 0.92
    at 64K); every config must give the default's codes and metadata."""
    fmt = RowFormat(128, 2, 128, clip=0.96)
    cases = [inputs(n, "none" if rot == "packed" else rot) for n in (65536, 1048576)]
    configs = {"layer": _rot_configs, "none": _plain_configs, "packed": _packed_configs}[rot]()
    if rot == "packed":
        return sweep_packed(configs, cases)
    base = {k: getattr(new, k) for k in configs[0]}
    want = [new.quantize_pack(x, r, fmt) for x, r in cases]
    rows = []
    for cfg in configs:
        for k, v in cfg.items():
            setattr(new, k, v)
        try:
            got = [new.quantize_pack(x, r, fmt) for x, r in cases]
            ts = [timed(lambda x=x, r=r: new.quantize_pack(x, r, fmt)) for x, r in cases]
        except Exception as e:  # e.g. out of shared memory
            rows.append({"config": cfg, "error": str(e)[-300:]})
            print("config failed:", cfg, str(e)[-300:], flush=True)
            continue
        same = all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True)
        )
        tbs = [x.numel() * 2 / 1e9 / t for (x, _), t in zip(cases, ts, strict=True)]
        rows.append({"rotate": rot, "config": cfg, "ms": ts, "TBps": tbs, "identical": same})
        print(f"sweep {rot} {cfg}: 64K {ts[0]:.4f} ms ({tbs[0]:.2f} TB/s), 1M {ts[1]:.4f} ms "
              f"({tbs[1]:.2f} TB/s), identical {same}", flush=True)  # fmt: skip
    ok = [r for r in rows if "ms" in r and r["identical"]]
    best = min(ok, key=lambda r: (r["ms"][0] * r["ms"][1]) ** 0.5)
    print(f"best {rot} (geometric mean of 64K and 1M):", best["config"], "module default:", base, flush=True)
    for k, v in base.items():
        setattr(new, k, v)
    return rows


def sweep_packed(configs: list[dict], cases: list) -> list[dict]:
    """``sweep`` for "packed": configs with different keys, each set on top of the defaults,
    timed at clip 0.96 (64K, 1M rows) and 0.92 (64K)."""
    runs = [(x, r, RowFormat(128, 2, 128, clip=c)) for (x, r), c in ((cases[0], 0.96), (cases[1], 0.96), (cases[0], 0.92))]  # fmt: skip
    want = [new.quantize_pack(x, r, fmt) for x, r, fmt in runs]
    rows = []
    for cfg in configs:
        f = Switched(**cfg)
        got = [f.quantize_pack(x, r, fmt) for x, r, fmt in runs]
        ts = [timed(lambda x=x, r=r, fmt=fmt, f=f: f.quantize_pack(x, r, fmt)) for x, r, fmt in runs]
        same = all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True)
        )
        tbs = [x.numel() * 2 / 1e9 / t for (x, _, _), t in zip(runs, ts, strict=True)]
        rows.append({"rotate": "packed", "config": cfg, "ms": ts, "TBps": tbs, "identical": same})
        print(f"sweep packed {cfg}: 64K {ts[0]:.4f} ms ({tbs[0]:.2f} TB/s), 1M {ts[1]:.4f} ms ({tbs[1]:.2f} "
              f"TB/s), 64K clip 0.92 {ts[2]:.4f} ms ({tbs[2]:.2f} TB/s), identical {same}", flush=True)  # fmt: skip
    for packed in (False, True):
        ok = [r for r in rows if r["identical"] and r["config"]["PACKED"] == packed]
        if not ok:
            print(f"best packed={packed}: no config gave the default's codes and metadata", flush=True)
            continue
        best = min(ok, key=lambda r: (r["ms"][0] * r["ms"][1]) ** 0.5)
        print(
            f"best packed={packed} (geometric mean of 64K and 1M at clip 0.96):", best["config"], flush=True
        )
    return rows


def registers() -> None:
    """Registers and spills of each compiled no-rotation specialization this run launched."""
    for key, (compiled, _) in new._QUANTIZE_PACK._cache.items():
        kw = dict(key[2])
        if kw.get("ROTATE"):
            continue
        keys = ("D", "BLOCK_R", "N_DROP", "ROUNDS", "TOP_K", "TREE", "PACKED", "ASM", "num_warps", "maxnreg")
        tags = {k: kw.get(k) for k in keys}
        print(f"registers {tags}: {getattr(compiled, 'n_regs', '?')} registers, "
              f"{getattr(compiled, 'n_spills', '?')} spills", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    old_kernel = ap.add_mutually_exclusive_group(required=True)
    old_kernel.add_argument("--old", help="file holding the previous quantize_pack.py")
    old_kernel.add_argument(
        "--packed",
        action="store_true",
        help="old: the current module with the fp32 clip network (PACKED off)",
    )
    old_kernel.add_argument(
        "--round-k",
        action="store_true",
        help="old: the current module with clip rounds of six values (ROUND_K = 6)",
    )
    old_kernel.add_argument(
        "--pdl",
        action="store_true",
        help="old: the current module launched ordinarily (PDL off)",
    )
    ap.add_argument(
        "--sweep",
        default="",
        help="also sweep the tunables of: layer (the rotation path), none, packed (none, both clip networks), "
        "comma-separated",
    )
    ap.add_argument("--out", default=None, help="directory for quantize_pack_ab.json")
    args = ap.parse_args()
    t = time.time()
    if args.pdl:
        old = Switched(PDL=False)
    elif args.packed or args.round_k:
        old = Switched(PACKED=False) if args.packed else Switched(ROUND_K=6)
    else:
        old = load_old(args.old)
    print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    print("| rows | clip | rotate | identical | old ms | new ms | old TB/s | new TB/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    # d=128, then d=256 at clip 0.96 (N_DROP = 10 as d=128 at 0.92)
    for n_rows, clip, rot, d in [(n, c, r, 128) for n in (65536, 262144, 1048576) for c in (0.96, 0.92, 0.0)
                                 for r in ("none", "layer")] + [(262144, 0.96, "per-head", 128)] + [
                                 (262144, 0.96, r, 256) for r in ("none", "layer")]:  # fmt: skip
        rows.append(compare(old, n_rows, clip, rot, d))
    kinds = [k for k in args.sweep.split(",") if k]
    if any(k not in ("layer", "none", "packed") for k in kinds):
        raise SystemExit(f"--sweep takes layer, none and packed, comma-separated; got {args.sweep!r}")
    swept = [r for rot in kinds for r in sweep(rot)]
    registers()
    bad = [r for r in rows if not r["identical"]]
    print(f"{len(rows)} cases, {len(bad)} not identical ({time.time() - t:.0f} s)", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        res = {"env": env_info(), "cases": rows, "sweep": swept}
        (out / "quantize_pack_ab.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
