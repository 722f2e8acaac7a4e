"""Scoring speed through the server against lm-eval's HF backend (#54 item 3): one loglikelihood
task of long contexts (``--docs`` documents x ``--choices`` choices, ~``--context`` tokens each,
from local text), lm-eval ``local-completions`` against a live ``oscarkv serve`` (int2 with the
given rotations, and/or bf16), then lm-eval's ``hf`` backend on the same task, wall time each,
each side in its own process (one model in memory at a time), on the CPU.

    python lab/scripts/lm_eval_speed.py --model M --rotations R --data FILE [--sides int2,bf16,hf]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_task(d: Path, tok, text: str, docs: int, choices: int, context: int, seed: int) -> str:
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    rows = []
    for _ in range(docs):
        a = rng.randrange(0, len(ids) - context - 64)
        ctx = tok.decode(ids[a : a + context])
        right = tok.decode(ids[a + context : a + context + 8])
        wrong = [tok.decode(ids[(b := rng.randrange(0, len(ids) - 8)) : b + 8]) for _ in range(choices - 1)]
        rows.append({"context": ctx, "choices": [right, *wrong], "gold": 0})
    (d / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = {"task": "speed_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(d / "docs.jsonl")}},
            "test_split": "test", "doc_to_text": "{{context}}", "target_delimiter": "", "metadata": {"version": 1},
            "output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}",
            "metric_list": [{"metric": "acc"}]}  # fmt: skip
    (d / "speed_mc.yaml").write_text(json.dumps(body))
    return "speed_mc"


def run(model: str, args: str, task: str, d: Path) -> tuple[float, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    res = simple_evaluate(model=model, model_args=args, tasks=[task], batch_size=4,
                          task_manager=TaskManager(include_path=str(d)), log_samples=True)  # fmt: skip
    return time.perf_counter() - t0, res


def side(args, task: str, d: Path) -> dict:
    """One side's wall time, accuracy and per-request log-likelihoods."""
    if args.side == "hf":
        s, res = run("hf", f"pretrained={args.model},dtype=float32,device=cpu", task, d)
    else:
        from oscarkv.config import EngineConfig, ServerConfig
        from oscarkv.server.launch import start_server

        name = Path(args.model).name
        cfg = EngineConfig(model=args.model, kv_dtype=args.side, device="cpu",
                           rotations=args.rotations if args.side == "int2" else None)  # fmt: skip
        srv = start_server(cfg, ServerConfig(port=0, served_model_name=name))
        try:
            margs = (f"base_url={srv.url}/v1/completions,model={name},tokenizer={args.model},"
                     "tokenized_requests=True,num_concurrent=1,max_retries=1")  # fmt: skip
            s, res = run("local-completions", margs, task, d)
        finally:
            srv.stop()
    lls = [r[0][0] for x in res["samples"][task] for r in x["resps"]]
    return {"side": args.side, "wall_s": s, "acc": res["results"][task]["acc,none"], "lls": lls}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rotations")
    ap.add_argument("--data", required=True)
    ap.add_argument("--sides", default="int2,bf16,hf")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # one side, in a child process
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--context", type=int, default=1100)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    d = Path(tempfile.mkdtemp())
    task = build_task(d, tok, Path(args.data).read_text(), args.docs, args.choices, args.context, 0)
    if args.side:
        Path(args.out).write_text(json.dumps(side(args, task, d)))
        return
    rows = []
    for sd in args.sides.split(","):
        out = d / f"{sd}.json"
        argv = [a for a in sys.argv[1:]]
        subprocess.run([sys.executable, __file__, *argv, "--side", sd, "--out", str(out)], check=True)
        rows.append(json.loads(out.read_text()))
    ref = next((r for r in rows if r["side"] == "hf"), rows[-1])
    n = args.docs * args.choices
    print(f"{n} requests of ~{args.context} tokens, {torch.get_num_threads()} threads")
    print(f"| run | wall s | / {ref['side']} | acc | largest |ll - {ref['side']}| |\n|---|---|---|---|---|")
    for r in rows:
        diff = max(abs(a - b) for a, b in zip(r["lls"], ref["lls"], strict=True))
        print(
            f"| {r['side']} | {r['wall_s']:.1f} | {r['wall_s'] / ref['wall_s']:.2f} | {r['acc']:.3f} | {diff:.4f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
