"""Scoring speed through the server against lm-eval's HF backend (#54 item 3): one loglikelihood
task of long contexts (``--docs`` documents x ``--choices`` choices, ~``--context`` tokens each,
from local text), lm-eval ``local-completions`` against a live ``oscarkv serve`` (int2 with the
given rotations, and/or bf16), then lm-eval's ``hf`` backend on the same task, wall time each,
in one process on the CPU.

    python lab/scripts/lm_eval_speed.py --model M --rotations R --data FILE [--kv int2,bf16]
"""

from __future__ import annotations

import argparse
import json
import random
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rotations")
    ap.add_argument("--data", required=True)
    ap.add_argument("--kv", default="int2,bf16")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--context", type=int, default=1100)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from oscarkv.config import EngineConfig, ServerConfig
    from oscarkv.server.launch import start_server

    tok = AutoTokenizer.from_pretrained(args.model)
    d = Path(tempfile.mkdtemp())
    task = build_task(d, tok, Path(args.data).read_text(), args.docs, args.choices, args.context, 0)
    name = Path(args.model).name
    rows, lls = [], {}
    for kv in args.kv.split(","):
        cfg = EngineConfig(model=args.model, kv_dtype=kv, device="cpu",
                           rotations=args.rotations if kv == "int2" else None)  # fmt: skip
        srv = start_server(cfg, ServerConfig(port=0, served_model_name=name))
        try:
            margs = (f"base_url={srv.url}/v1/completions,model={name},tokenizer={args.model},"
                     "tokenized_requests=True,num_concurrent=1,max_retries=1")  # fmt: skip
            s, res = run("local-completions", margs, task, d)
        finally:
            srv.stop()
        lls[kv] = [r[0][0] for x in res["samples"][task] for r in x["resps"]]
        rows.append((f"server {kv}", s, res["results"][task]["acc,none"]))
    s, res = run("hf", f"pretrained={args.model},dtype=float32,device=cpu", task, d)
    lls["hf"] = [r[0][0] for x in res["samples"][task] for r in x["resps"]]
    rows.append(("hf backend", s, res["results"][task]["acc,none"]))
    n = args.docs * args.choices
    print(f"{n} requests of ~{args.context} tokens, {torch.get_num_threads()} threads")
    print("| run | wall s | / hf | acc |\n|---|---|---|---|")
    for r, s, acc in rows:
        print(f"| {r} | {s:.1f} | {s / rows[-1][1]:.2f} | {acc:.3f} |")
    for kv in lls:
        if kv != "hf":
            diff = max(abs(a - b) for a, b in zip(lls[kv], lls["hf"], strict=True))
            print(f"{kv}: largest |loglikelihood - hf| {diff:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "lls": lls}, indent=1))


if __name__ == "__main__":
    main()
