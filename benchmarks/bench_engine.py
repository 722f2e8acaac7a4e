"""Job throughput and steady-state decode of the engine at a fixed KV budget: ``kv_dtype`` int2 vs
bf16, same engine, same budget, same jobs (engine.md §7.1), each against its memory roofline.

N jobs are submitted at once to one ``Engine`` with random weights of a model's shape
(``load_format="dummy"``; speed needs no trained weights) and random rotations. The budget counts
every KV byte: for int2 the 16-bit sinks and rings of every request slot are paid from it. Unless
``--kv-budget-gb`` is given, the budget is the one where bf16 holds exactly ``--bf16-fit`` jobs at
full length. ``--max-running auto`` gives each side the most jobs that fit at full length (no
preemption); an integer sets it for both. ``--kv-dtypes int2,int2-fp8w,bf16`` adds int2 with fp8
e4m3 windows (``EngineConfig.window_dtype``) as a third side.

    python benchmarks/bench_engine.py --shape qwen3-8b --workload decode-1k --jobs 24
    python benchmarks/bench_engine.py --shape demo --device cpu --jobs 4 --prompt-len 32 --gen-len 8 \
        --kv-budget-gb 0.02  # CPU smoke
    python benchmarks/bench_engine.py --shape qwen3-8b --write-model /tmp/m  # for oscarkv serve

Workloads (``--workload``, each ``(prompt, generated)`` tokens, overridable by ``--prompt-len`` /
``--gen-len``): ``reasoning`` 1K + 8K, ``decode-1k`` 1K + 1K, ``decode-2k`` 1K + 2K, ``long-16k``
16K + 512, ``long-32k`` 32K + 1K.

Reports jobs/min, output tok/s, TTFT and TPOT p50/p90, the share of the wall time spent in steps
that prefill (prompt tokens, alone or with decodes), mean and peak running requests,
preemptions, bytes per tier and peak GPU memory, and the int2/bf16 ratios; results through
``_harness.save`` as ``bench_engine_<shape>_<workload>``.

**Steady state** (``--steady L``): each side holds its capacity of requests (``max_running`` =
the most requests of ``L + max_tokens`` tokens its pools hold, unless ``--max-running`` sets it),
one prompt of ``L`` random tokens each (distinct: no prefix-cache hits), ``max_tokens = --steps +
--warmup + 2``, ``ignore_eos``. It steps until every request decodes, runs ``--warmup`` decode
steps, then times ``--steps`` decode steps: decode tok/s (tokens decoded ÷ wall), the step time,
and the int2/bf16 tok/s ratio next to the capacity ratio. Unless ``--kv-budget-gb`` is given, bf16
holds ``--bf16-fit`` such requests. Results as ``bench_engine_<shape>_steady_<L>``.

    python benchmarks/bench_engine.py --shape qwen3-8b --steady 4096 --steps 64

**Roofline** (both modes, ``roofline.py``): a decode step must read every weight once (of the
embedding only the rows looked up, unless tied to the LM head) and every stored KV byte of the
requests it decodes, per tier. Those bytes over the device's copy bandwidth (read + write bytes of
a device-to-device copy over its time, ``_harness.copy_bandwidth``, measured in the same run) are
the roofline step time, reported next to the measured step time (wall), the device time per step,
the host time per step and its share on the critical path (the device's idle gap before a step),
all medians over the decode steps (job mode: the decode-only steps, each step's roofline from the
requests decoding in it; steady mode: the roofline of the timed window's middle step), and the
fraction roofline ÷ wall ("% of roofline"). Timings come from ``EngineConfig(step_timing=True)``;
off CUDA there is no device time or gap ("-"). ``--overlap`` sets ``EngineConfig.overlap``.
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
from _harness import copy_bandwidth, save
from roofline import ROWS as ROOF_ROWS
from roofline import Roofline, StepBytes, cell, step_figures

from oscarkv.config import EngineConfig, QuantSpec
from oscarkv.engine import Engine, SamplingParams
from oscarkv.engine.kv_pool import GIB, plan_pools
from oscarkv.rotation import LayerRotation, RotationSet, load_rotations, save_rotations

DEMO = Path(__file__).resolve().parents[1] / "src" / "oscarkv" / "assets" / "demo-model"
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6,
              attention_bias=False, vocab_size=151936, num_attention_heads=32, num_key_value_heads=8,
              head_dim=128, num_hidden_layers=36, max_position_embeddings=40960, rope_theta=1000000.0,
              bos_token_id=151643, eos_token_id=151645)  # fmt: skip
_GLM_AIR_FP8 = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_act="silu",
                    rms_norm_eps=1e-5, vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                    moe_intermediate_size=1408, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                    num_hidden_layers=46, first_k_dense_replace=1, n_routed_experts=128, n_shared_experts=1,
                    num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
                    routed_scaling_factor=1.0, partial_rotary_factor=0.5, attention_bias=True,
                    use_qk_norm=False, num_nextn_predict_layers=1, max_position_embeddings=131072,
                    rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151329,
                    eos_token_id=151329,
                    quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128],
                                             activation_scheme="dynamic"))  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "qwen3-1.7b": {
        **_QWEN3,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
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
    # mixture of experts (random weights of the real per-layer shapes)
    "qwen3-30b-a3b": {
        **_QWEN3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_hidden_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
    # GLM-4.5-Air (the architecture of GLM-4.7) with FP8 128x128 block-scaled weights, as its FP8
    # checkpoint ships: 46 layers (about 110 GB) fit one H200; 20 of them one H100
    "glm-4.5-air-fp8": _GLM_AIR_FP8,
    "glm-4.5-air-fp8-20l": {**_GLM_AIR_FP8, "num_hidden_layers": 20},
    # MiniMax-M2's layers (62 in the model; 6 here fit one GPU in bf16)
    "minimax-m2-6l": dict(
        architectures=["MiniMaxM2ForCausalLM"],
        model_type="minimax_m2",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=256,
        num_experts_per_tok=8,
        rotary_dim=64,
        max_position_embeddings=196608,
        rope_theta=5000000.0,
        tie_word_embeddings=False,
        bos_token_id=200034,
        eos_token_id=200020,
    ),
}
#: (prompt, generated) tokens of the workloads a user runs: reasoning (OSCAR's own evaluation
#: generates 32K), decode-heavy chat, long context (prefill share reported)
WORKLOADS = {
    "reasoning": (1024, 8192),
    "decode-1k": (1024, 1024),
    "decode-2k": (1024, 2048),
    "long-16k": (16384, 512),
    "long-32k": (32768, 1024),
}


#: the sides a run may compare (``--kv-dtypes``): name -> (EngineConfig.kv_dtype, .window_dtype)
SIDES = {"int2": ("int2", None), "int2-fp8w": ("int2", "fp8_e4m3"), "bf16": ("bf16", None)}


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


def random_rotations(layers: int, head_dim: int, path: Path, seed: int = 0, high_layers: int = 0) -> Path:
    """Random orthogonal K/V rotations of every layer, saved at ``path``; the first
    ``high_layers`` layers store 4-bit keys (a mixed recipe's cost)."""
    g = torch.Generator().manual_seed(seed)

    def orth() -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()

    one = torch.ones(head_dim)
    rs = RotationSet({i: LayerRotation(orth(), orth(), one, one, key_bits=4 if i < high_layers else None)
                      for i in range(layers)}, spec=QuantSpec())  # fmt: skip
    return save_rotations(rs, path)


def capacity(cfg: EngineConfig, shape: dict[str, Any], tokens: int, budget: int, dtype: torch.dtype) -> int:
    """Most requests of ``tokens`` tokens that the pools of ``budget`` bytes hold at once (INT2:
    at the rotations' per-layer key widths)."""
    layers, heads, d = shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]
    ps = cfg.page_tokens
    spec = QuantSpec(window_dtype=cfg.window_dtype or "model") if cfg.kv_dtype == "int2" else None
    fmts = None
    if spec is not None and cfg.rotations:
        rs = load_rotations(cfg.rotations)
        fmts = [rs.formats(i) for i in rs.layer_ids]

    def fits(mr: int) -> int:
        try:
            plan = plan_pools(
                dataclasses.replace(cfg, max_running=mr), spec, layers, heads, d, dtype, budget, fmts
            )
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


def kv_token_bytes(shape: dict[str, Any], elt: int) -> int:
    """Bytes of one token's K and V over every layer at ``elt`` bytes per element (bf16: 2)."""
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * elt


def default_budget(shape: dict[str, Any], tokens: int, fit: int, elt: int) -> int:
    """The budget where bf16 holds ``fit`` requests of ``tokens`` tokens (plus the dummy page)."""
    return (1 + fit * -(-tokens // 16)) * 16 * kv_token_bytes(shape, elt)


@dataclasses.dataclass
class StepLog:
    """Per-step figures of an engine run: requests running before each step, the wall time of the
    steps that ran decode tokens only with what each reads (the roofline's snapshots), the wall
    time of the steps that ran prompt tokens, and the engine's step timings."""

    running: list[int] = dataclasses.field(default_factory=list)
    decode_ms: list[float] = dataclasses.field(default_factory=list)
    snaps: list[StepBytes] = dataclasses.field(default_factory=list)
    prefill_s: float = 0.0
    timings: list[Any] = dataclasses.field(default_factory=list)

    def step(self, eng: Engine, rf: Roofline) -> list[Any]:
        """One ``eng.step()``, logged; returns its outputs."""
        self.running.append(len(eng.scheduler.running))
        snap = rf.snapshot(eng.scheduler.running)
        pre, dec, t = eng.stats["prefill_tokens"], eng.stats["decode_tokens"], time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if eng.stats["prefill_tokens"] == pre and eng.stats["decode_tokens"] > dec:
            self.decode_ms.append(1e3 * dt)
            self.snaps.append(snap)
        elif eng.stats["prefill_tokens"] > pre:
            self.prefill_s += dt
        self.timings += eng.step_timings()
        return outs

    def running_mean(self) -> float:
        busy = [r for r in self.running if r]
        return statistics.fmean(busy) if busy else 0.0


def run_jobs(eng: Engine, prompts: list[list[int]], gen: int, device: str, rf: Roofline) -> dict[str, Any]:
    """Submit every prompt at once and step to the end; per-request and per-step figures."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params) for p in prompts]
    done: dict[str, Any] = {}
    log = StepLog()
    total = len(prompts) * gen
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tok"),
                  TimeElapsedColumn(), transient=True) as bar:  # fmt: skip
        task = bar.add_task(eng.cfg.kv_dtype, total=total)
        produced = 0
        while eng.has_unfinished():
            for out in log.step(eng, rf):
                if out.finished:
                    done[out.rid] = out
            n = sum(len(s.out) for s in eng.scheduler.running) + sum(len(o.token_ids) for o in done.values())
            bar.advance(task, n - produced)
            produced = n
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    log.timings += eng.step_timings()
    outs = [done[r] for r in rids]
    ntok = sum(len(o.token_ids) for o in outs)
    ttft = [o.ttft_s for o in outs if o.ttft_s is not None]
    tpot = [(o.e2e_s - o.ttft_s) / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
    return {
        "jobs": len(outs),
        "wall_s": wall,
        "jobs_per_min": 60 * len(outs) / wall,
        "output_tok_s": ntok / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "prefill_share": log.prefill_s / wall,
        "tpot_p50_ms": 1e3 * pct(tpot, 50),
        "tpot_p90_ms": 1e3 * pct(tpot, 90),
        "decode_step_p50_ms": pct(log.decode_ms, 50),
        "decode_steps": len(log.decode_ms),
        "running_mean": log.running_mean(),
        "running_peak": max(log.running, default=0),
        "steps": eng.stats["steps"],
        "preemptions": eng.stats["preemptions"],
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan"),
        **step_figures(rf, log.snaps, pct(log.decode_ms, 50), log.timings),
    }


def steady_tokens(steps: int, warmup: int) -> int:
    """``max_tokens`` of a steady-state request: the timed and warm-up steps, the first token
    (sampled by the prefill) and one spare step."""
    return steps + warmup + 2


def run_steady(eng: Engine, prompts: list[list[int]], warmup: int, steps: int, device: str,
               rf: Roofline) -> dict[str, Any]:  # fmt: skip
    """Fill every slot with one prompt each, step until all of them decode, run ``warmup`` decode
    steps, then time ``steps`` decode steps (steady state: the same batch throughout)."""
    n, sched, st = len(prompts), eng.scheduler, eng.stats
    params = SamplingParams(max_tokens=steady_tokens(steps, warmup), temperature=0.0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, d0 = time.perf_counter(), st["decode_tokens"]
    while (held := rf.snapshot(sched.running).batch) < n:  # prefill has priority: no decode in between
        if not eng.has_unfinished() or st["decode_tokens"] > d0:
            raise SystemExit(
                f"{eng.cfg.kv_dtype}: only {held} of {n} requests decode at once; lower --max-running"
            )
        eng.step()
    fill_s = time.perf_counter() - t0
    while st["decode_tokens"] - d0 < warmup * n:
        eng.step()
    eng.step_timings()  # drop the fill's and the warm-up's
    first, s0 = rf.snapshot(sched.running), dict(st)
    t0 = time.perf_counter()
    while st["steps"] - s0["steps"] < steps:
        eng.step()
    wall = time.perf_counter() - t0
    last = rf.snapshot(sched.running)
    if device == "cuda":
        torch.cuda.synchronize()
    timings = eng.step_timings()
    d = {k: st[k] - s0[k] for k in ("steps", "decode_tokens", "prefill_tokens")}
    while eng.has_unfinished():
        eng.step()
    step_ms = 1e3 * wall / d["steps"]
    return {
        "requests": n,
        "batch": min(first.batch, last.batch),
        "fill_s": fill_s,
        "wall_s": wall,
        "steps": d["steps"],
        "decode_tokens": d["decode_tokens"],
        "decode_tok_s": d["decode_tokens"] / wall,
        "prefill_tokens_in_window": d["prefill_tokens"],
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan"),
        # the window's middle step: KV grows by one token per request per step
        **step_figures(rf, [first, last], step_ms, timings),
    }


def make_engine(
    args, side: str, mdir: Path, rot: Path | None, budget: int, tokens: int
) -> tuple[Engine, dict]:
    """An engine of ``max_running`` = the side's capacity at ``tokens`` (or ``--max-running``),
    timing its steps; and the facts of its start. ``side``: a key of ``SIDES``."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    kv_dtype, window_dtype = SIDES[side]
    base = EngineConfig(model=str(mdir), rotations=str(rot) if rot else None, kv_dtype=kv_dtype,
                        window_dtype=window_dtype,
                        device=args.device, backend=args.backend, kv_budget_gb=budget / GIB,
                        load_format="dummy", max_model_len=tokens + 1,
                        max_batched_tokens=args.max_batched_tokens, graph_capture=args.graph_capture,
                        overlap=args.overlap, step_timing=True)  # fmt: skip
    mr = (
        capacity(base, SHAPES[args.shape], tokens, budget, dtype)
        if args.max_running == "auto"
        else int(args.max_running)
    )
    t0 = time.perf_counter()
    eng = Engine(dataclasses.replace(base, max_running=mr))
    g = eng.runner.graphs
    facts = {"max_running": mr, "engine_start_s": time.perf_counter() - t0, "overlap": args.overlap}
    if g is not None:  # graphs captured at start-up (any later ones: see engine_facts)
        facts.update(graphs_startup=len(g.graphs), graphs_startup_s=g.capture_s)
    return eng, facts


def engine_facts(eng: Engine, facts: dict) -> dict[str, Any]:
    """``facts`` with the pool bytes per tier, the backend and the graphs captured after start-up."""
    rep, g = eng.memory_report(), eng.runner.graphs
    out = dict(facts, pool_bytes=rep["total_bytes"], int2_bytes=rep["int2_bytes"],
               hp_paged_bytes=rep["hp_paged_bytes"], ring_bytes=rep["ring_bytes"],
               backend=eng.runner.ops.backend.value)  # fmt: skip
    rs = eng.runner.rotations
    if rs is not None:  # what the stored K/V cost: the quality an artifact of these widths measured
        out["bits_per_element_128k"] = rs.with_spec(eng.runner.spec).bits_per_element(131072)
    if g is not None:
        out.update(graphs_lazy=len(g.graphs) - facts["graphs_startup"],
                   graphs_lazy_s=g.capture_s - facts["graphs_startup_s"])  # fmt: skip
    return out


def free(device: str) -> None:
    """Give the memory of a dropped engine back (before the next side's starts)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def bench_one(args, kv_dtype: str, mdir: Path, rot: Path | None, budget: int, prompts: list[list[int]],
              bw: float) -> dict:  # fmt: skip
    eng, facts = make_engine(args, kv_dtype, mdir, rot, budget, args.prompt_len + args.gen_len)
    rf = Roofline.of(eng, bw)
    # warm-up: one request of the workload's prompt length compiles the kernels, captures the
    # decode graph of its context bucket (captures are lazy) and fills the allocator's cache; its
    # tokens reversed, so that no job's prompt hits the prefix cache
    warm = prompts[0][::-1]
    eng.add_request(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.step_timings()
    eng.stats.update(steps=0, preemptions=0)
    if args.profile:  # the host's share of each step, by function (the GPU shows as waits in a sync)
        prof = cProfile.Profile()
        res = prof.runcall(run_jobs, eng, prompts, args.gen_len, args.device, rf)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        path = Path(__file__).parent / "results" / f"{args.name or 'bench_engine'}_{kv_dtype}.profile.txt"
        path.write_text(out.getvalue())
        print(out.getvalue()[:4000])
    else:
        res = run_jobs(eng, prompts, args.gen_len, args.device, rf)
    res.update(engine_facts(eng, facts))
    del eng
    free(args.device)
    return res


def bench_steady(args, kv_dtype: str, mdir: Path, rot: Path | None, budget: int, bw: float) -> dict:
    eng, facts = make_engine(
        args, kv_dtype, mdir, rot, budget, args.steady + steady_tokens(args.steps, args.warmup)
    )
    g = torch.Generator().manual_seed(0)  # the same prompts on both sides, as far as both go
    vocab = min(int(SHAPES[args.shape]["vocab_size"]), 2048)
    prompts = [
        torch.randint(3, vocab, (args.steady,), generator=g).tolist() for _ in range(facts["max_running"])
    ]
    res = run_steady(eng, prompts, args.warmup, args.steps, args.device, Roofline.of(eng, bw))
    res.update(engine_facts(eng, facts), context=args.steady)
    del eng
    free(args.device)
    return res


_TAIL = (("max_running", "max_running", "{}"), ("bits per K/V element at 128K", "bits_per_element_128k", "{:.2f}"),
         ("KV pools GiB", "pool_bytes", "gib"),
         ("  INT2 pages GiB", "int2_bytes", "gib"), ("  16-bit pages GiB", "hp_paged_bytes", "gib"),
         ("  rings GiB", "ring_bytes", "gib"), ("peak GPU GiB", "peak_gpu_gib", "{:.1f}"),
         ("wall s", "wall_s", "{:.1f}"), ("engine start s", "engine_start_s", "{:.1f}"),
         ("graphs at start-up (s)", ("graphs_startup", "graphs_startup_s"), "{:.4g}"),
         ("graphs captured later (s)", ("graphs_lazy", "graphs_lazy_s"), "{:.4g}"))  # fmt: skip
ROWS = (("jobs/min", "jobs_per_min", "{:.2f}"), ("output tok/s", "output_tok_s", "{:.0f}"),
        ("TTFT p50 / p90 s", ("ttft_p50_s", "ttft_p90_s"), "{:.2f}"),
        ("wall in prefill steps", "prefill_share", "pct"),
        ("TPOT p50 / p90 ms", ("tpot_p50_ms", "tpot_p90_ms"), "{:.1f}"),
        ("decode-only step p50 ms", "decode_step_p50_ms", "{:.1f}"), ("decode-only steps", "decode_steps", "{}"),
        *ROOF_ROWS, ("running mean / peak", ("running_mean", "running_peak"), "{:.1f}"),
        ("preemptions", "preemptions", "{}"), ("steps", "steps", "{}"), *_TAIL)  # fmt: skip
STEADY_ROWS = (("requests held (decoding at once)", ("requests", "batch"), "{}"),
               ("decode tok/s", "decode_tok_s", "{:.0f}"), ("decode steps timed", "steps", "{}"),
               *ROOF_ROWS, ("fill (prefill) s", "fill_s", "{:.1f}"), *_TAIL)  # fmt: skip


def table(res: dict[str, dict], rows: tuple = ROWS) -> str:
    names = list(res)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, key, fmt in rows:
        keys = key if isinstance(key, tuple) else (key,)
        cells = [" / ".join(cell(res[n].get(k), fmt) for k in keys) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="decode-1k")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default: the workload's)")
    ap.add_argument("--gen-len", type=int, help="generated tokens (default: the workload's)")
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--steady", type=int, metavar="L", help="steady-state decode at context L (no jobs)")
    ap.add_argument("--steps", type=int, default=64, help="--steady: decode steps timed")
    ap.add_argument("--warmup", type=int, default=8, help="--steady: decode steps before the timed ones")
    ap.add_argument("--kv-budget-gb", type=float, help="KV budget (default: bf16 fits --bf16-fit jobs)")
    ap.add_argument("--bf16-fit", type=int, default=8)
    ap.add_argument("--max-running", default="auto", help="auto (each side's capacity) or an integer")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-dtypes", default="int2,bf16",
                    help=f"comma list of sides: {', '.join(SIDES)} (int2 with fp8 e4m3 windows)")  # fmt: skip
    ap.add_argument("--key-bits-layers", type=int, default=0, metavar="N",
                    help="int2: N layers store 4-bit keys (a mixed recipe's bits and capacity)")  # fmt: skip
    ap.add_argument("--graph-capture", choices=("startup", "lazy"), default="startup",
                    help="startup: every decode graph before the timed run (steady state); lazy: as the run needs them")  # fmt: skip
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="overlapped scheduling (EngineConfig.overlap)")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--name", help="result name (default: bench_engine_<shape>_<workload> or _steady_<L>)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the timed runs (job mode); write each side's top N functions by own time")  # fmt: skip
    ap.add_argument(
        "--write-model",
        metavar="DIR",
        help="only write DIR/<shape> (config, tokenizer) and DIR/<shape>-rot (rotations), for serve",
    )
    args = ap.parse_args(argv)
    if bad := [k for k in args.kv_dtypes.split(",") if k not in SIDES]:
        ap.error(f"--kv-dtypes: unknown side(s) {', '.join(bad)}; choose from {', '.join(SIDES)}")
    if args.write_model:  # DIR/<shape> (config + tokenizer) and DIR/<shape>-rot (random rotations)
        sh, root = SHAPES[args.shape], Path(args.write_model)
        model_dir(args.shape, root, int(sh["max_position_embeddings"]))
        random_rotations(sh["num_hidden_layers"], sh["head_dim"], root / f"{args.shape}-rot")
        return {}
    steady = args.steady is not None
    if steady:
        if args.steady < 1 or args.steps < 1 or args.warmup < 0:
            raise SystemExit("--steady and --steps must be >= 1, --warmup >= 0")
        tokens = args.steady + steady_tokens(args.steps, args.warmup)
    else:
        p, g = WORKLOADS[args.workload]
        args.prompt_len, args.gen_len = args.prompt_len or p, args.gen_len or g
        tokens = args.prompt_len + args.gen_len
    shape = SHAPES[args.shape]
    budget = (int(args.kv_budget_gb * GIB) if args.kv_budget_gb
              else default_budget(shape, tokens, args.bf16_fit, 2 if args.device == "cuda" else 4))  # fmt: skip
    bw = copy_bandwidth(args.device)  # before any engine holds the device's memory
    print(f"device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    try:
        mdir = model_dir(args.shape, root, tokens + 1)
        layers, d = shape["num_hidden_layers"], shape["head_dim"]
        g = torch.Generator().manual_seed(0)
        vocab = min(int(shape["vocab_size"]), 2048)
        prompts = [] if steady else [
            torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.jobs)
        ]  # fmt: skip
        res: dict[str, dict] = {}
        for kv in args.kv_dtypes.split(","):
            rot = None
            if SIDES[kv][0] == "int2":
                rot = root / "rot"
                if not rot.exists():
                    random_rotations(layers, d, rot, high_layers=args.key_bits_layers)
            if steady:
                r = res[kv] = bench_steady(args, kv, mdir, rot, budget, bw)
                print(f"{kv}: {r['decode_tok_s']:.0f} decode tok/s at batch {r['batch']}, step {r['step_ms']:.2f} ms, "
                      f"roofline {r['roofline_ms']:.2f} ms", flush=True)  # fmt: skip
            else:
                r = res[kv] = bench_one(args, kv, mdir, rot, budget, prompts, bw)
                print(f"{kv}: {r['jobs_per_min']:.2f} jobs/min, {r['output_tok_s']:.0f} tok/s, "
                      f"max_running {r['max_running']}, wall {r['wall_s']:.1f} s", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if steady:
        head = (f"**{args.shape}**, steady state: every slot holds a request at context {args.steady}, "
                f"{args.steps} decode steps timed after {args.warmup} warm-up steps, overlap {args.overlap}, "
                f"KV budget {budget / GIB:.3g} GiB for every side.")  # fmt: skip
        keys = ("decode_tok_s", "max_running")
    else:
        head = (f"**{args.shape}**, {args.workload}: {args.jobs} jobs of {args.prompt_len} prompt + {args.gen_len} "
                f"generated tokens (greedy, ignore_eos), overlap {args.overlap}, KV budget {budget / GIB:.3g} GiB "
                "for every side.")  # fmt: skip
        keys = ("jobs_per_min", "output_tok_s", "max_running")
    md = head + "\n\n" + table(res, STEADY_ROWS if steady else ROWS)
    ratios: dict[str, float] = {}
    for side in (s for s in res if s != "bf16" and "bf16" in res):
        a, b = res[side], res["bf16"]
        r = {k: a[k] / b[k] for k in keys}
        ratios.update(r if side == "int2" else {f"{side}_{k}": v for k, v in r.items()})
        md += f"\n\n{side} / bf16: " + ", ".join(f"{k} {v:.2f}×" for k, v in r.items())
        if steady:
            md += f" (decode tok/s next to capacity: max_running {a['max_running']} / {b['max_running']})"
    print(md)
    mode = f"steady_{args.steady}" if steady else args.workload
    name = args.name or f"bench_engine_{args.shape}_{mode}"
    metrics = (
        ("decode_tok_s", "step_ms", "roofline_frac")
        if steady
        else ("jobs_per_min", "output_tok_s", "tpot_p50_ms")
    )
    hist = [(f"{args.shape}-{mode}-{kv}", m, float(r[m])) for kv, r in res.items() for m in metrics]
    payload = {
        "args": vars(args),
        "budget_bytes": budget,
        "copy_bytes_per_s": bw,
        "results": res,
        "ratios": ratios,
    }
    save(name, payload, md, hist)
    return res


if __name__ == "__main__":
    main()
