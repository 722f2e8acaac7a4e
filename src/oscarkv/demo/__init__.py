"""`oscarkv demo`: what oscarkv is for, on the bundled demo model, offline, in about 30 s on two
quiet CPU cores.

1. Calibrate rotations for the tiny trained model shipped in ``oscarkv/assets/demo-model`` (a
   Qwen3-architecture code model: head dim 128, trained on 1K-token windows of the Python standard
   library's ``calib`` split), with 16-token windows so that a 1K context is mostly INT2, under a
   budget of 3.0 bits per element at 1K: the layer whose held-out loss suffers most from 2-bit
   keys stores 4-bit keys.
2. Quality: BF16, OSCAR and two INT2 baselines on the held-out ``eval`` split at 1K tokens
   (perplexity over 16 modules, bits per element, per-layer errors).
3. Serving: the engine in INT2 and in BF16 at one KV budget (BF16 holds two 1K requests), on the
   same prompts: requests held at once, KV bytes per request, greedy agreement, speed on this CPU.
4. Tables for the terminal, ``results.json``/``results.md``/``serving.json`` and three plots:
   memory per request against context, quality against bits, per-layer errors.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

from ..config import CalibrationConfig, EvalConfig, QuantSpec
from .report import compare_serving, demo_plots, example_table, quality_table, serving_table

__all__ = ["DEMO_EVAL", "DEMO_OUTPUTS", "DEMO_SPEC", "demo_model_path", "run_demo"]

#: the demo's storage format: 16-token sink and recent windows (the default 64 + 256 would be a
#: third of a 1K context; a real model's long contexts amortize them)
DEMO_SPEC = QuantSpec(sink_tokens=16, recent_tokens=16)
#: the context the demo model was trained at: its config allows 2048 positions, but past 1024 its
#: BF16 predictions degrade (perplexity of the same scored tokens about 6x higher at 2K), so
#: quality measured there would compare against a broken baseline
DEMO_CONTEXT = 1024
#: a fixed budget of 3.0 bits per element at the demo's context, windows and metadata counted
DEMO_CALIBRATION = CalibrationConfig(
    tokens=8192, seq_len=DEMO_CONTEXT, holdout_tokens=4096, bits_per_element=3.0, budget_context=DEMO_CONTEXT
)
DEMO_EVAL = EvalConfig(
    methods="bf16,oscar,hadamard-int2,naive-int2", tasks="ppl,attn-error", context=DEMO_CONTEXT,
    ppl_sequences=16, ppl_continuation=256, ppl_chunk=64, needle_trials=2, needle_depths=3,
    needle_lengths=2, passkey_at_context=20, attn_sequences=2,
)  # fmt: skip
#: the serving comparison: prompts, tokens generated per prompt, and BF16's requests at the budget
DEMO_PROMPTS, DEMO_GEN, DEMO_BF16_HELD = 10, 32, 2

#: what the demo writes into its output directory (rotations/ holds the artifact)
DEMO_OUTPUTS = ("rotations", "results.json", "results.md", "layer_errors.png", "serving.json", "memory.png",
                "quality.png")  # fmt: skip


def demo_model_path() -> Path:
    """Directory of the bundled demo model (config, bf16 safetensors, tokenizer)."""
    return Path(str(resources.files("oscarkv") / "assets" / "demo-model"))


def run_demo(
    out: str | Path = "oscarkv-demo", device: str = "cpu", quick: bool = False, overwrite: bool = False
) -> int:
    """Calibrate, evaluate and serve on the demo model; returns a process exit code.

    Refuses an ``out`` that already holds a demo's files unless ``overwrite``.
    """
    import dataclasses

    import torch
    from rich.console import Console

    from ..calibration import calibrate, token_sequences
    from ..eval import run_eval, write_report
    from ..eval.report import high_key_layers, summary
    from ..hf.loading import load_model
    from ..rotation import save_rotations
    from ..utils.files import atomic_write_text, check_output_dir

    con = Console()
    out = check_output_dir(out, DEMO_OUTPUTS, overwrite=overwrite)
    torch.manual_seed(0)
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        con.print(f"[dim]{time.perf_counter() - t0:5.0f}s[/] {msg}")

    model, tok = load_model(str(demo_model_path()), device, "fp32")
    con.print(
        f"[bold]oscarkv demo[/]: {demo_model_path().name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"params, head_dim {model.config.head_dim}) on {device}"
    )
    cal = (
        dataclasses.replace(DEMO_CALIBRATION, tokens=2048, holdout_tokens=1024) if quick else DEMO_CALIBRATION
    )
    rots = calibrate(model, tok, cal, DEMO_SPEC, progress=True)
    save_rotations(rots, out / "rotations", overwrite=overwrite)
    context, gen, n_prompts = (DEMO_CONTEXT, 16, 4) if quick else (DEMO_CONTEXT, DEMO_GEN, DEMO_PROMPTS)
    cfg = dataclasses.replace(DEMO_EVAL, quick=quick, context=context)
    rows = run_eval(model, tok, rots, cfg, progress=say)
    summ = {s["method"]: s for s in summary(rows)}

    say("serving: the engine in BF16 and in INT2 at one KV budget")
    prompts = [s.tolist() for s in token_sequences(tok, None, n_prompts, context - gen, seed=1)]
    serving = compare_serving(str(demo_model_path()), str(out / "rotations"), prompts, rots, context, gen,
                              DEMO_BF16_HELD)  # fmt: skip
    seconds = round(time.perf_counter() - t0, 1)
    settings = {**dataclasses.asdict(cfg.effective()), "model": "oscarkv demo model", "seconds": seconds,
                "wide_key_layers": high_key_layers(rots)}  # fmt: skip
    files = write_report(out, rows, settings)
    atomic_write_text(out / "serving.json", json.dumps(serving, indent=1))
    files += [out / "serving.json", *demo_plots(out, summ, serving, rots)]
    con.print(quality_table(summ, context))
    con.print(serving_table(serving))
    con.print(example_table(serving))
    con.print(
        "[dim]Speed here is a 2.9M-parameter model on this CPU (the torch kernels); the speed-ups INT2 "
        "buys are measured on GPUs: see the README's results table.[/]"
    )
    con.print(f"done in {seconds:.0f}s; wrote " + ", ".join(str(f) for f in files))
    return 0
