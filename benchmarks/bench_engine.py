"""Job throughput of the engine at a fixed KV budget: ``kv_dtype`` int2 vs bf16, same engine, same
budget, same jobs (engine.md §7.1).

N jobs are submitted at once to one ``Engine`` with random weights of a model's shape
(``load_format="dummy"``; speed needs no trained weights) and random rotations. The budget counts
every KV byte: for int2 the 16-bit sinks and rings of every request slot are paid from it. Unless
``--kv-budget-gb`` is given, the budget is the one where bf16 holds exactly ``--bf16-fit`` jobs at
full length. ``--max-running auto`` gives each side the most jobs that fit at full length (no
preemption); an integer sets it for both.

    python benchmarks/bench_engine.py --shape qwen3-8b --workload decode --jobs 40
    python benchmarks/bench_engine.py --shape demo --device cpu --jobs 4 --prompt-len 32 --gen-len 8 \
        --kv-budget-gb 0.02  # CPU smoke
    python benchmarks/bench_engine.py --shape qwen3-8b --write-model /tmp/m  # for oscarkv serve

Reports jobs/min, output tok/s, TTFT and TPOT p50/p90, mean and peak running requests,
preemptions, bytes per tier and peak GPU memory, and the int2/bf16 ratios; results through
``_harness.save`` as ``bench_engine_<shape>_<workload>``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import save

from oscarkv.config import EngineConfig, QuantSpec
from oscarkv.engine import Engine, SamplingParams
from oscarkv.engine.kv_pool import GIB, plan_pools
from oscarkv.rotation import LayerRotation, RotationSet, save_rotations

DEMO = Path(__file__).resolve().parents[1] / "src" / "oscarkv" / "assets" / "demo-model"
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6,
              attention_bias=False, vocab_size=151936, num_attention_heads=32, num_key_value_heads=8,
              head_dim=128, num_hidden_layers=36, max_position_embeddings=40960, rope_theta=1000000.0,
              bos_token_id=151643, eos_token_id=151645)  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "demo": json.loads((DEMO / "config.json").read_text()),
}
WORKLOADS = {"decode": (1024, 8192), "prefill": (32768, 1024)}  # (prompt, generated) tokens


def model_dir(shape: str, root: Path, positions: int) -> Path:
    """A directory with the shape's config.json and the demo tokenizer (ids beyond its vocabulary
    decode to nothing; the text is not looked at)."""
    d = root / shape
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(SHAPES[shape])
    cfg["max_position_embeddings"] = max(int(cfg["max_position_embeddings"]), positions)
    (d / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, d / f)
    return d


def random_rotations(layers: int, head_dim: int, path: Path, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)

    def orth() -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()

    one = torch.ones(head_dim)
    rs = RotationSet({i: LayerRotation(orth(), orth(), one, one) for i in range(layers)}, spec=QuantSpec())
    return save_rotations(rs, path)


def capacity(cfg: EngineConfig, shape: dict[str, Any], tokens: int, budget: int, dtype: torch.dtype) -> int:
    """Most requests of ``tokens`` tokens that the pools of ``budget`` bytes hold at once."""
    layers, heads, d = shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]
    ps = cfg.page_tokens
    spec = QuantSpec() if cfg.kv_dtype == "int2" else None

    def fits(mr: int) -> int:
        try:
            plan = plan_pools(dataclasses.replace(cfg, max_running=mr), spec, layers, heads, d, dtype, budget)
        except ValueError:
            return 0
        if not plan.int2:
            return (plan.hp_pages - 1) // -(-tokens // ps)
        assert spec is not None
        q_tokens = max(tokens - spec.sink_tokens - spec.recent_tokens, 0)
        return (plan.q_pages - 1) // (-(-q_tokens // ps) + 1)

    best = 0
    for mr in range(1, 4097):
        if fits(mr) >= mr:
            best = mr
        elif best:
            break
    if not best:
        raise SystemExit(
            f"the budget of {budget / GIB:.3g} GiB holds no {cfg.kv_dtype} request of {tokens} tokens"
        )
    return best


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def run_jobs(eng: Engine, prompts: list[list[int]], gen: int, device: str) -> dict[str, Any]:
    """Submit every prompt at once and step to the end; per-request and per-step figures."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params) for p in prompts]
    done: dict[str, Any] = {}
    running: list[int] = []
    decode_ms: list[float] = []  # wall time of the steps that ran decode tokens only
    total = len(prompts) * gen
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tok"),
                  TimeElapsedColumn(), transient=True) as bar:  # fmt: skip
        task = bar.add_task(eng.cfg.kv_dtype, total=total)
        produced = 0
        while eng.has_unfinished():
            running.append(len(eng.scheduler.running))
            pre, t = eng.stats["prefill_tokens"], time.perf_counter()
            for out in eng.step():
                if out.finished:
                    done[out.rid] = out
            if eng.stats["prefill_tokens"] == pre:
                decode_ms.append(1e3 * (time.perf_counter() - t))
            n = sum(len(s.out) for s in eng.scheduler.running) + sum(len(o.token_ids) for o in done.values())
            bar.advance(task, n - produced)
            produced = n
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    outs = [done[r] for r in rids]
    ntok = sum(len(o.token_ids) for o in outs)
    ttft = [o.ttft_s for o in outs if o.ttft_s is not None]
    tpot = [(o.e2e_s - o.ttft_s) / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
    busy = [r for r in running if r]
    return {
        "jobs": len(outs),
        "wall_s": wall,
        "jobs_per_min": 60 * len(outs) / wall,
        "output_tok_s": ntok / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "tpot_p50_ms": 1e3 * pct(tpot, 50),
        "tpot_p90_ms": 1e3 * pct(tpot, 90),
        "decode_step_p50_ms": pct(decode_ms, 50),
        "decode_steps": len(decode_ms),
        "running_mean": statistics.fmean(busy) if busy else 0.0,
        "running_peak": max(running, default=0),
        "steps": eng.stats["steps"],
        "preemptions": eng.stats["preemptions"],
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan"),
    }


def bench_one(
    args, kv_dtype: str, mdir: Path, rot: Path | None, budget: int, prompts: list[list[int]]
) -> dict:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tokens = args.prompt_len + args.gen_len
    base = EngineConfig(model=str(mdir), rotations=str(rot) if rot else None, kv_dtype=kv_dtype,
                        device=args.device, backend=args.backend, kv_budget_gb=budget / GIB,
                        load_format="dummy", max_model_len=tokens + 1,
                        max_batched_tokens=args.max_batched_tokens,
                        graph_capture=args.graph_capture)  # fmt: skip
    mr = (
        capacity(base, SHAPES[args.shape], tokens, budget, dtype)
        if args.max_running == "auto"
        else int(args.max_running)
    )
    cfg = dataclasses.replace(base, max_running=mr)
    t0 = time.perf_counter()
    eng = Engine(cfg)
    start_s = time.perf_counter() - t0
    g = eng.runner.graphs
    n0, s0 = (len(g.graphs), g.capture_s) if g is not None else (0, 0.0)
    # warm-up: one request of the workload's prompt length compiles the kernels, captures the
    # decode graph of its context bucket (captures are lazy) and fills the allocator's cache; its
    # tokens reversed, so that no job's prompt hits the prefix cache
    warm = prompts[0][::-1]
    eng.add_request(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.stats.update(steps=0, preemptions=0)
    if args.profile:  # the host's share of each step, by function (the GPU shows as waits in a sync)
        prof = cProfile.Profile()
        res = prof.runcall(run_jobs, eng, prompts, args.gen_len, args.device)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        path = Path(__file__).parent / "results" / f"{args.name or 'bench_engine'}_{kv_dtype}.profile.txt"
        path.write_text(out.getvalue())
        print(out.getvalue()[:4000])
    else:
        res = run_jobs(eng, prompts, args.gen_len, args.device)
    rep = eng.memory_report()
    if g is not None:  # graphs captured at start-up, and lazily (warm-up and timed run)
        res.update(graphs_startup=n0, graphs_startup_s=s0, graphs_lazy=len(g.graphs) - n0,
                   graphs_lazy_s=g.capture_s - s0)  # fmt: skip
    res.update(engine_start_s=start_s)
    res.update(max_running=mr, pool_bytes=rep["total_bytes"], int2_bytes=rep["int2_bytes"],
               hp_paged_bytes=rep["hp_paged_bytes"], ring_bytes=rep["ring_bytes"],
               backend=eng.runner.ops.backend.value)  # fmt: skip
    del eng
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


ROWS = (("jobs/min", "jobs_per_min", "{:.2f}"), ("output tok/s", "output_tok_s", "{:.0f}"),
        ("TTFT p50 / p90 s", ("ttft_p50_s", "ttft_p90_s"), "{:.2f}"),
        ("TPOT p50 / p90 ms", ("tpot_p50_ms", "tpot_p90_ms"), "{:.1f}"),
        ("decode-only step p50 ms", "decode_step_p50_ms", "{:.1f}"), ("decode-only steps", "decode_steps", "{}"),
        ("running mean / peak", ("running_mean", "running_peak"), "{:.1f}"),
        ("max_running", "max_running", "{}"), ("preemptions", "preemptions", "{}"), ("steps", "steps", "{}"),
        ("KV pools GiB", "pool_bytes", "gib"), ("  INT2 pages GiB", "int2_bytes", "gib"),
        ("  16-bit pages GiB", "hp_paged_bytes", "gib"), ("  rings GiB", "ring_bytes", "gib"),
        ("peak GPU GiB", "peak_gpu_gib", "{:.1f}"), ("wall s", "wall_s", "{:.1f}"),
        ("engine start s", "engine_start_s", "{:.1f}"),
        ("graphs at start-up (s)", ("graphs_startup", "graphs_startup_s"), "{:.4g}"),
        ("graphs captured later (s)", ("graphs_lazy", "graphs_lazy_s"), "{:.4g}"))  # fmt: skip


def _cell(r: dict, key, fmt: str) -> str:
    keys = key if isinstance(key, tuple) else (key,)
    if fmt == "gib":
        return " / ".join(f"{r[k] / GIB:.2f}" for k in keys)
    return " / ".join(fmt.format(r[k]) if k in r else "-" for k in keys)


def table(res: dict[str, dict]) -> str:
    names = list(res)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(_cell(res[n], k, f) for n in names) + " |" for label, k, f in ROWS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="decode")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default: the workload's)")
    ap.add_argument("--gen-len", type=int, help="generated tokens (default: the workload's)")
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--kv-budget-gb", type=float, help="KV budget (default: bf16 fits --bf16-fit jobs)")
    ap.add_argument("--bf16-fit", type=int, default=8)
    ap.add_argument("--max-running", default="auto", help="auto (each side's capacity) or an integer")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-dtypes", default="int2,bf16")
    ap.add_argument("--graph-capture", choices=("startup", "lazy"), default="startup",
                    help="startup: every decode graph before the timed run (steady state); lazy: as the run needs them")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--name", help="result name (default: bench_engine_<shape>_<workload>)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the timed runs; write each side's top N functions by own time")  # fmt: skip
    ap.add_argument(
        "--write-model",
        metavar="DIR",
        help="only write DIR/<shape> (config, tokenizer) and DIR/<shape>-rot (rotations), for serve",
    )
    args = ap.parse_args(argv)
    if args.write_model:  # DIR/<shape> (config + tokenizer) and DIR/<shape>-rot (random rotations)
        sh, root = SHAPES[args.shape], Path(args.write_model)
        model_dir(args.shape, root, int(sh["max_position_embeddings"]))
        random_rotations(sh["num_hidden_layers"], sh["head_dim"], root / f"{args.shape}-rot")
        return {}
    p, g = WORKLOADS[args.workload]
    args.prompt_len, args.gen_len = args.prompt_len or p, args.gen_len or g
    shape = SHAPES[args.shape]
    tokens = args.prompt_len + args.gen_len
    root = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    try:
        mdir = model_dir(args.shape, root, tokens + 1)
        layers, heads, d = shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]
        elt = 2 if args.device == "cuda" else 4
        if args.kv_budget_gb:
            budget = int(args.kv_budget_gb * GIB)
        else:  # the dummy page plus bf16-fit jobs of full length
            pages = 1 + args.bf16_fit * -(-tokens // 16)
            budget = pages * 16 * 2 * layers * heads * d * elt
        g = torch.Generator().manual_seed(0)
        vocab = min(int(shape["vocab_size"]), 2048)
        prompts = [
            torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.jobs)
        ]
        res: dict[str, dict] = {}
        for kv in args.kv_dtypes.split(","):
            rot = None
            if kv == "int2":
                rot = root / "rot"
                if not rot.exists():
                    random_rotations(layers, d, rot)
            res[kv] = bench_one(args, kv, mdir, rot, budget, prompts)
            print(f"{kv}: {res[kv]['jobs_per_min']:.2f} jobs/min, {res[kv]['output_tok_s']:.0f} tok/s, "
                  f"max_running {res[kv]['max_running']}, wall {res[kv]['wall_s']:.1f} s", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    head = (f"**{args.shape}**, {args.workload}: {args.jobs} jobs of {args.prompt_len} prompt + {args.gen_len} "
            f"generated tokens (greedy, ignore_eos), KV budget {budget / GIB:.2f} GiB for every side.")  # fmt: skip
    md = head + "\n\n" + table(res)
    if "int2" in res and "bf16" in res:
        a, b = res["int2"], res["bf16"]
        ratios = {k: a[k] / b[k] for k in ("jobs_per_min", "output_tok_s", "max_running")}
        md += "\n\nint2 / bf16: " + ", ".join(f"{k} {v:.2f}×" for k, v in ratios.items())
    print(md)
    name = args.name or f"bench_engine_{args.shape}_{args.workload}"
    hist = [(f"{args.shape}-{args.workload}-{kv}", m, float(r[m])) for kv, r in res.items()
            for m in ("jobs_per_min", "output_tok_s", "tpot_p50_ms")]  # fmt: skip
    save(name, {"args": vars(args), "budget_bytes": budget, "results": res}, md, hist)
    return res


if __name__ == "__main__":
    main()
