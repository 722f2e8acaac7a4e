"""Prefix reuse (OSCAR's Fig. 6 setting, engine.md §7.1): multi-turn sessions that share one system
prompt and grow their own history, int2 against bf16 at one KV budget, in one process.

Each session starts from the same ``--system`` tokens; turn ``t`` sends everything the session has
so far (system prompt, earlier user messages and replies) plus ``--user`` new random tokens and
generates ``--gen`` tokens (greedy, ``ignore_eos``). A session's next turn is submitted the moment
its reply ends; ``C`` sessions are open at once (closed loop) and a finished session's place goes
to the next waiting one. Jobs are turns. The prefix cache serves what it holds of each prompt.

``--concurrency auto`` gives each side the most sessions its pools hold at their last turn, the
system prompt stored once (the INT2 side's 16-bit sinks and rings per slot included); ``--sessions
auto`` is twice the INT2 side's, so the jobs are at least 4x the INT2 capacity at ``--turns 4``
(engine.md: one side's ragged last wave must not decide the ratio). A list of concurrencies
(``--concurrency 1,4,auto``) runs each point on the same engine, every point with its own system
prompt, and plots per-GPU throughput (output tok/s of the whole run) against per-user throughput
(median over turns of a turn's generated tokens over its end-to-end time), as OSCAR's figure does.

Reports per side and point: jobs/min, output tok/s, per-user tok/s, TTFT p50/p90, the prefix-hit
ratio (prompt tokens the cache served over all prompt tokens) next to the share a perfect cache
would serve (the tokens earlier turns or sessions sent), preemptions, and the decode-only steps
against their memory roofline (``roofline.py``). ``--graph-capture startup`` (the default) captures
every decode graph before the timed runs, so neither side pays a capture inside them.

    python benchmarks/bench_prefix.py --shape qwen3-8b --system 2048 --turns 4 --user 512 --gen 256
    python benchmarks/bench_prefix.py --shape demo --device cpu --system 48 --turns 2 --user 16 \\
        --gen 8 --sessions 4 --concurrency 2 --kv-budget-gb 0.02   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness
from _harness import copy_bandwidth, save
from bench_engine import (
    SHAPES,
    SIDES,
    StepLog,
    capacity,
    engine_facts,
    free,
    kv_token_bytes,
    model_dir,
    pct,
    random_rotations,
    table,
)
from roofline import ROWS as ROOF_ROWS
from roofline import Roofline, StepBytes, step_figures

from oscarkv.config import EngineConfig, QuantSpec
from oscarkv.engine import Engine, SamplingParams
from oscarkv.engine.kv_pool import GIB, plan_pools


@dataclasses.dataclass(frozen=True)
class Workload:
    """Token counts of one session: ``system`` shared, then ``turns`` of ``user`` + ``gen``."""

    system: int
    turns: int
    user: int
    gen: int

    @property
    def last(self) -> int:
        """Tokens of a session after its last turn."""
        return self.system + self.turns * (self.user + self.gen)


def token_bytes(cfg: EngineConfig, shape: dict[str, Any], budget: int, dtype: torch.dtype) -> float:
    """Bytes one stored token costs in the side's main tier (INT2 rows, or 16-bit pages)."""
    spec = QuantSpec(window_dtype=cfg.window_dtype or "model") if cfg.kv_dtype == "int2" else None
    plan = plan_pools(dataclasses.replace(cfg, max_running=1), spec,
                      shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"], dtype,
                      budget)  # fmt: skip
    return (plan.q_page_bytes if plan.int2 else plan.hp_page_bytes) / plan.page_tokens


def shared_capacity(
    cfg: EngineConfig, shape: dict[str, Any], w: Workload, budget: int, dtype: torch.dtype
) -> int:
    """Sessions a side holds at their last turn with the system prompt stored once: the budget less
    the system prompt's main-tier bytes, over requests of the private tokens (INT2: plus the sink,
    which each slot's 16-bit pages hold)."""
    shared = w.system * token_bytes(cfg, shape, budget, dtype)
    private = w.last - w.system + (QuantSpec().sink_tokens if cfg.kv_dtype == "int2" else 0)
    return capacity(cfg, shape, private, int(budget - shared), dtype)


def default_budget(shape: dict[str, Any], w: Workload, fit: int, elt: int) -> int:
    """The budget where bf16 holds ``fit`` sessions at their last turn, the system prompt once."""
    pages = 1 + -(-w.system // 16) + fit * (-(-(w.last - w.system) // 16) + 1)
    return pages * 16 * kv_token_bytes(shape, elt)


def run_sessions(eng: Engine, rf: Roofline, w: Workload, sessions: int, conc: int, seed: int,
                 vocab: int) -> dict[str, Any]:  # fmt: skip
    """Run ``sessions`` sessions of ``w``, ``conc`` open at once; per-turn and per-step figures."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (w.system,), generator=g).tolist()
    user = [[torch.randint(3, vocab, (w.user,), generator=g).tolist() for _ in range(w.turns)]
            for _ in range(sessions)]  # fmt: skip
    params = SamplingParams(max_tokens=w.gen, temperature=0.0, ignore_eos=True)
    hist = {s: list(system) for s in range(sessions)}
    turn = dict.fromkeys(range(sessions), 0)
    waiting, active = deque(range(sessions)), {}
    seen = 0  # prompt tokens an earlier turn or session sent (what a perfect cache would serve)

    def submit(s: int) -> None:
        nonlocal seen
        seen += len(hist[s]) if turn[s] or s != 0 else 0
        hist[s] = hist[s] + user[s][turn[s]]
        active[eng.add_request(hist[s], params)] = s

    eng.stats.update(steps=0, preemptions=0)
    cuda = str(eng.runner.device).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    turns, log = [], StepLog()
    t0 = time.perf_counter()
    while waiting and len(active) < conc:
        submit(waiting.popleft())
    while eng.has_unfinished():
        for out in log.step(eng, rf):
            if not out.finished:
                continue
            s = active.pop(out.rid)
            turns.append(out)
            hist[s] = hist[s] + list(out.token_ids)
            turn[s] += 1
            if turn[s] < w.turns:
                submit(s)
            elif waiting:
                submit(waiting.popleft())
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    prompt = sum(len(o.prompt_token_ids) for o in turns)
    ntok = sum(len(o.token_ids) for o in turns)
    ttft = [o.ttft_s for o in turns if o.ttft_s is not None]
    user_rate = [len(o.token_ids) / o.e2e_s for o in turns if o.e2e_s]
    return {
        "concurrency": min(conc, sessions),
        "sessions": sessions,
        "jobs": len(turns),
        "wall_s": wall,
        "jobs_per_min": 60 * len(turns) / wall,
        "output_tok_s": ntok / wall,
        "user_tok_s": statistics.median(user_rate) if user_rate else float("nan"),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "hit_ratio": sum(o.num_cached_tokens for o in turns) / prompt,
        "reusable_ratio": seen / prompt,
        "prompt_tokens": prompt,
        "decode_step_p50_ms": pct(log.decode_ms, 50),
        "running_mean": log.running_mean(),
        "preemptions": eng.stats["preemptions"],
        **step_figures(rf, log.snaps or [StepBytes(0, 0)], pct(log.decode_ms, 50), log.timings),
    }


ROWS = (("sessions open at once (concurrency)", "concurrency", "{}"), ("sessions / jobs (turns)", ("sessions", "jobs"), "{}"),
        ("jobs/min", "jobs_per_min", "{:.2f}"), ("output tok/s (per GPU)", "output_tok_s", "{:.0f}"),
        ("per-user tok/s (median turn)", "user_tok_s", "{:.1f}"),
        ("TTFT p50 / p90 s", ("ttft_p50_s", "ttft_p90_s"), "{:.2f}"),
        ("prefix hit ratio / reusable", ("hit_ratio", "reusable_ratio"), "pct"),
        ("decode-only step p50 ms", "decode_step_p50_ms", "{:.1f}"), *ROOF_ROWS,
        ("running mean", "running_mean", "{:.1f}"), ("preemptions", "preemptions", "{}"),
        ("wall s", "wall_s", "{:.1f}"), ("max_running", "max_running", "{}"),
        ("KV pools GiB", "pool_bytes", "gib"))  # fmt: skip


def plot(points: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for kv, pts in points.items():
        pts = sorted(pts, key=lambda r: r["concurrency"])
        ax.plot([r["user_tok_s"] for r in pts], [r["output_tok_s"] for r in pts], "o-", label=kv)
        for r in pts:
            ax.annotate(str(r["concurrency"]), (r["user_tok_s"], r["output_tok_s"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("per-user throughput, tok/s (median turn)")
    ax.set_ylabel("per-GPU throughput, output tok/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--system", type=int, default=2048, help="shared system prompt tokens")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user", type=int, default=512, help="new user tokens per turn")
    ap.add_argument("--gen", type=int, default=256, help="generated tokens per turn")
    ap.add_argument("--sessions", default="auto", help="auto (twice the int2 concurrency) or an integer")
    ap.add_argument(
        "--concurrency", default="auto", help="comma list of integers or auto (each side's capacity)"
    )
    ap.add_argument("--kv-budget-gb", type=float, help="KV budget (default: bf16 holds --bf16-fit sessions)")
    ap.add_argument("--bf16-fit", type=int, default=8)
    ap.add_argument("--kv-dtypes", default="int2,bf16", help=f"comma list of sides: {', '.join(SIDES)}")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--graph-capture", choices=("startup", "lazy"), default="startup",
                    help="startup: every decode graph before the timed runs; lazy: as the runs need them")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--name", help="result name (default: bench_prefix_<shape>)")
    args = ap.parse_args(argv)
    if bad := [k for k in args.kv_dtypes.split(",") if k not in SIDES]:
        ap.error(f"--kv-dtypes: unknown side(s) {', '.join(bad)}; choose from {', '.join(SIDES)}")
    w = Workload(args.system, args.turns, args.user, args.gen)
    if min(w.system, w.turns, w.user, w.gen) < 1:
        raise SystemExit("--system, --turns, --user and --gen must be >= 1")
    shape = SHAPES[args.shape]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    budget = (int(args.kv_budget_gb * GIB) if args.kv_budget_gb
              else default_budget(shape, w, args.bf16_fit, dtype.itemsize))  # fmt: skip
    bw = copy_bandwidth(args.device)
    print(f"device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench_prefix_"))
    vocab = min(int(shape["vocab_size"]), 2048)
    points: dict[str, list[dict]] = {}
    try:
        mdir = model_dir(args.shape, root, w.last + 1)
        rot = random_rotations(shape["num_hidden_layers"], shape["head_dim"], root / "rot")
        base = {kv: EngineConfig(model=str(mdir), rotations=str(rot) if SIDES[kv][0] == "int2" else None,
                                 kv_dtype=SIDES[kv][0], window_dtype=SIDES[kv][1],
                                 device=args.device, backend=args.backend, kv_budget_gb=budget / GIB,
                                 load_format="dummy", max_model_len=w.last + 1,
                                 max_batched_tokens=args.max_batched_tokens, graph_capture=args.graph_capture,
                                 step_timing=True)
                for kv in args.kv_dtypes.split(",")}  # fmt: skip
        cap = {kv: shared_capacity(cfg, shape, w, budget, dtype) for kv, cfg in base.items()}
        conc = {kv: [cap[kv] if c == "auto" else int(c) for c in args.concurrency.split(",")] for kv in base}
        ref = max((c for kv, c in cap.items() if SIDES[kv][0] == "int2"), default=max(cap.values()))
        sessions = 2 * ref if args.sessions == "auto" else int(args.sessions)
        for kv, cfg in base.items():
            eng = Engine(dataclasses.replace(cfg, max_running=max(conc[kv])))
            facts = {"max_running": max(conc[kv]), "capacity": cap[kv]}
            if eng.runner.graphs is not None:
                facts.update(
                    graphs_startup=len(eng.runner.graphs.graphs), graphs_startup_s=eng.runner.graphs.capture_s
                )
            rf = Roofline.of(eng, bw)
            warm = list(range(3, 3 + min(w.system + w.user, vocab - 3)))[::-1]  # compiles; hits nothing later
            eng.add_request(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            while eng.has_unfinished():
                eng.step()
            eng.step_timings()
            for i, c in enumerate(sorted(set(conc[kv]))):
                n = sessions if c == max(conc[kv]) else max(2 * c, 2)
                r = run_sessions(eng, rf, w, n, c, seed=1 + i, vocab=vocab)
                r.update(engine_facts(eng, facts))
                points.setdefault(kv, []).append(r)
                print(f"{kv} C={c}: {r['jobs_per_min']:.1f} jobs/min, {r['output_tok_s']:.0f} tok/s, "
                      f"user {r['user_tok_s']:.1f} tok/s, hit {r['hit_ratio']:.2f}, wall {r['wall_s']:.1f} s",
                      flush=True)  # fmt: skip
            del eng
            free(args.device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    main_pts = {kv: max(p, key=lambda r: r["concurrency"]) for kv, p in points.items()}
    head = (f"**{args.shape}**, prefix reuse: sessions of a shared {w.system}-token system prompt, {w.turns} turns "
            f"of {w.user} new + {w.gen} generated tokens (greedy, ignore_eos), up to {w.last} tokens; KV budget "
            f"{budget / GIB:.3g} GiB for every side; capacity at the last turn: "
            + ", ".join(f"{kv} {c}" for kv, c in cap.items()) + ".")  # fmt: skip
    md = head + "\n\n" + table(main_pts, ROWS)
    ratios: dict[str, float] = {}
    for side in (s for s in main_pts if s != "bf16" and "bf16" in main_pts):
        a, b = main_pts[side], main_pts["bf16"]
        r = {k: a[k] / b[k] for k in ("jobs_per_min", "output_tok_s", "concurrency")}
        ratios.update(r if side == "int2" else {f"{side}_{k}": v for k, v in r.items()})
        md += f"\n\n{side} / bf16: " + ", ".join(f"{k} {v:.2f}×" for k, v in r.items())
    sweep = [r for p in points.values() for r in p if len(p) > 1]
    if sweep:
        md += "\n\nSweep (per-GPU against per-user throughput):\n\n| side | C | output tok/s | per-user tok/s | hit |\n|---|---|---|---|---|\n"
        md += "\n".join(f"| {kv} | {r['concurrency']} | {r['output_tok_s']:.0f} | {r['user_tok_s']:.1f} | "
                        f"{100 * r['hit_ratio']:.0f}% |" for kv, p in points.items() for r in p)  # fmt: skip
    print(md)
    name = args.name or f"bench_prefix_{args.shape}"
    if sweep:
        _harness.RESULTS.mkdir(parents=True, exist_ok=True)
        plot(points, _harness.RESULTS / f"{name}.png",
             f"{args.shape}: shared {w.system}-token prompt, {w.turns} × ({w.user} + {w.gen})")  # fmt: skip
    hist = [(f"{args.shape}-prefix-{kv}", m, float(r[m])) for kv, r in main_pts.items()
            for m in ("jobs_per_min", "output_tok_s", "hit_ratio")]  # fmt: skip
    save(name, {"args": vars(args), "budget_bytes": budget, "copy_bytes_per_s": bw, "results": points,
                "ratios": ratios}, md, hist)  # fmt: skip
    return points


if __name__ == "__main__":
    main()
