"""`oscarkv demo`: the main job on the bundled demo model, offline, in a few CPU minutes.

Calibrates rotations for the tiny trained model shipped in ``oscarkv/assets/demo-model`` (a
Qwen3-architecture code model: head dim 128, 2 query heads per KV head, trained on the Python
standard library's ``calib`` split), then evaluates BF16, OSCAR and two INT2 baselines on the
held-out ``eval`` split — quantization-aware perplexity and per-layer attention and hidden-state
errors — prints the table and saves ``results.json``, ``results.md`` and the per-layer plot. (The
demo model is too small for needle retrieval: even BF16 scores 0 there; those tasks run on real
models with ``oscarkv eval``.)
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

from .config import CalibrationConfig, EvalConfig

__all__ = ["DEMO_EVAL", "DEMO_OUTPUTS", "demo_model_path", "run_demo"]

DEMO_CALIBRATION = CalibrationConfig(tokens=8192, seq_len=1024, holdout_tokens=2048)
DEMO_EVAL = EvalConfig(
    methods="bf16,oscar,hadamard-int2,naive-int2", tasks="ppl,attn-error", context=1024,
    ppl_sequences=4, ppl_continuation=256, ppl_chunk=32, needle_trials=2, needle_depths=3,
    needle_lengths=2, passkey_at_context=20, attn_sequences=2,
)  # fmt: skip


#: what the demo writes into its output directory (rotations/ holds the artifact)
DEMO_OUTPUTS = ("rotations", "results.json", "results.md", "layer_errors.png")


def demo_model_path() -> Path:
    """Directory of the bundled demo model (config, bf16 safetensors, tokenizer)."""
    return Path(str(resources.files("oscarkv") / "assets" / "demo-model"))


def run_demo(
    out: str | Path = "oscarkv-demo", device: str = "cpu", quick: bool = False, overwrite: bool = False
) -> int:
    """Calibrate and evaluate on the demo model; returns a process exit code.

    Refuses an ``out`` that already holds a demo's files unless ``overwrite``.
    """
    import dataclasses

    import torch
    from rich.console import Console

    from .calibration import calibrate
    from .eval import run_eval, summary_markdown, write_report
    from .hf.loading import load_model
    from .rotation import save_rotations
    from .utils.files import check_output_dir

    con = Console()
    out = check_output_dir(out, DEMO_OUTPUTS, overwrite=overwrite)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = load_model(str(demo_model_path()), device, "fp32")
    con.print(
        f"[bold]oscarkv demo[/]: {demo_model_path().name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"params, head_dim {model.config.head_dim}) on {device}"
    )
    cal = (
        dataclasses.replace(DEMO_CALIBRATION, tokens=2048, holdout_tokens=1024) if quick else DEMO_CALIBRATION
    )
    rots = calibrate(model, tok, cal, progress=True)
    save_rotations(rots, out / "rotations", overwrite=overwrite)
    cfg = dataclasses.replace(DEMO_EVAL, quick=quick)
    rows = run_eval(
        model, tok, rots, cfg, progress=lambda m: con.print(f"[dim]{time.perf_counter() - t0:5.0f}s[/] {m}")
    )
    seconds = round(time.perf_counter() - t0, 1)
    settings = {**dataclasses.asdict(cfg.effective()), "model": "oscarkv demo model", "seconds": seconds}
    files = write_report(out, rows, settings)
    con.print(summary_markdown(rows, settings))
    con.print(f"done in {settings['seconds']:.0f}s; wrote " + ", ".join(str(f) for f in files))
    return 0
