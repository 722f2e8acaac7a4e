"""Where a long prompt's prefill goes, INT2 against BF16, inside the engine (#52 item 3): one request
of L prompt tokens (chunked at ``--max-batched-tokens``), one generated token, per side in one
process; prefill tokens/s and torch.profiler's kernel time per kernel kind (exclusive: the part of
a kernel's interval no earlier kernel covers), summed over the whole prefill.

    python lab/prefill_profile.py --shape qwen3-8b --lengths 16384,32768
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import SHAPES, make_engine, model_dir, random_rotations
from s46_profile import short

from oscarkv.engine import SamplingParams

KINDS = ("stage1", "merge", "quantize_pack", "rotate", "dequant", "rms", "rope", "gemm", "nvjet", "sm90", "cutlass",
         "elementwise", "reduce", "index", "copy", "cat", "fmha", "flash", "cudnn", "attention", "silu")  # fmt: skip


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k in KINDS if k in low), short(name))


def prefill_once(eng, prompt: list[int], prof: bool) -> tuple[float, dict, dict]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    ctx = profile(activities=[ProfilerActivity.CUDA]) if prof else None
    t0 = time.perf_counter()
    if ctx:
        ctx.__enter__()
    eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if not ctx:
        return wall, {}, {}
    ctx.__exit__(None, None, None)
    trace = Path(tempfile.mkdtemp()) / "t.json"
    ctx.export_chrome_trace(str(trace))
    ev = sorted((e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"),
                key=lambda e: e["ts"])  # fmt: skip
    excl, cnt, reach = defaultdict(float), defaultdict(int), float("-inf")
    for e in ev:
        s, t = e["ts"], e["ts"] + e["dur"]
        k = kind(e["name"])
        excl[k] += max(0.0, t - max(s, reach))
        cnt[k] += 1
        reach = max(reach, t)
    return wall, dict(excl), dict(cnt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--lengths", default="16384,32768")
    ap.add_argument("--kv-dtypes", default="int2,bf16")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3, help="timed prefills per side and length (median)")
    a = ap.parse_args()
    sh = SHAPES[a.shape]
    lengths = [int(x) for x in a.lengths.split(",")]
    root = Path(tempfile.mkdtemp())
    longest = max(lengths) + 2
    mdir = model_dir(a.shape, root, longest + 1)
    rot = random_rotations(sh["num_hidden_layers"], sh["head_dim"], root / "rot")
    per_tok = 2 * sh["num_hidden_layers"] * sh["num_key_value_heads"] * sh["head_dim"] * 2
    ns = argparse.Namespace(device="cuda", backend="auto", max_batched_tokens=a.max_batched_tokens,
                            graph_capture="lazy", overlap="auto", max_running="1", shape=a.shape)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    res: dict = {}
    for kv in a.kv_dtypes.split(","):
        eng, _ = make_engine(
            ns, kv, mdir, rot if kv == "int2" else None, int(per_tok * longest * 1.2), longest
        )
        for L in lengths:
            prefill_once(eng, torch.randint(3, 2048, (L,), generator=g).tolist(), False)  # compile, warm
            walls = [prefill_once(eng, torch.randint(3, 2048, (L,), generator=g).tolist(), False)[0]
                     for _ in range(a.reps)]  # fmt: skip
            _, excl, cnt = prefill_once(eng, torch.randint(3, 2048, (L,), generator=g).tolist(), True)
            wall = sorted(walls)[len(walls) // 2]
            res[(kv, L)] = {"wall_s": wall, "tok_s": L / wall, "excl_us": excl, "launches": cnt}
            print(f"{kv} L={L}: prefill {wall * 1e3:.1f} ms, {L / wall:.0f} tok/s", flush=True)
        del eng
        torch.cuda.empty_cache()
    for L in lengths:
        a_, b_ = res.get(("int2", L)), res.get(("bf16", L))
        if a_ and b_:
            print(
                f"\n## L={L}: INT2 {a_['tok_s']:.0f} vs BF16 {b_['tok_s']:.0f} tok/s = {a_['tok_s'] / b_['tok_s']:.3f}"
            )
            keys = sorted(set(a_["excl_us"]) | set(b_["excl_us"]), key=lambda k: -a_["excl_us"].get(k, 0))
            print("| kernel | INT2 ms (launches) | BF16 ms (launches) |\n|---|---|---|")
            for k in keys[:16]:
                print(f"| {k} | {a_['excl_us'].get(k, 0) / 1e3:.2f} ({a_['launches'].get(k, 0)}) | "
                      f"{b_['excl_us'].get(k, 0) / 1e3:.2f} ({b_['launches'].get(k, 0)}) |")  # fmt: skip


if __name__ == "__main__":
    main()
