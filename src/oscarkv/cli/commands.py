"""Command-line front end: ``oscarkv calibrate | info | demo`` (flags come from config dataclasses)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

__all__ = ["add_dataclass_args", "dataclass_from_args", "main"]

#: ``--dtype`` choices: the keys of :data:`oscarkv.hf.loading.DTYPES`, repeated here so that parsing
#: flags (``--help``, ``info``) does not import transformers (tests/test_cli.py keeps the two equal)
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")


# ---- dataclass <-> argparse ---------------------------------------------------------------
def _scalar_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, group: str | None = None) -> None:
    """Add one ``--field-name`` flag per field of dataclass ``cls`` (default: the field default)."""
    target = parser.add_argument_group(group or cls.__name__) if group != "" else parser
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _scalar_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_ = f.metadata.get("help", "") + f" (default: {default})"
        if tp is bool:
            target.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_,
                dest=f.name,
            )
        else:
            target.add_argument(flag, type=tp, default=default, help=help_, dest=f.name)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build ``cls`` from the flags added by :func:`add_dataclass_args` (validation errors
    surface as the dataclass's own ``ValueError``)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# ---- commands -----------------------------------------------------------------------------
def _cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .rotation import load_rotations

    cfg = None
    if args.model_config:
        import json

        cfg = json.loads(Path(args.model_config).read_text())
    rs = load_rotations(args.path, v_path=args.v_path, model_config=cfg)
    con = Console()
    p, spec = rs.provenance, rs.spec
    ortho = rs.orthogonality_errors()
    t = Table(title=f"rotations: {args.path}", show_header=False)
    t.add_row("source", p.source + (f" ({p.model_name})" if p.model_name else ""))
    t.add_row("layers", f"{len(rs.layer_ids)}: {rs.layer_ids}")
    t.add_row("head dim", str(rs.head_dim))
    gran = rs.granularity + (f" ({rs.num_kv_heads} KV heads)" if rs.num_kv_heads else "")
    t.add_row("granularity", gran)
    t.add_row("spec", ", ".join(f"{k}={v}" for k, v in spec.to_dict().items()))
    worst = max(ortho, key=ortho.__getitem__)
    t.add_row("worst orthogonality", f"{ortho[worst]:.2e} (layer {worst}); max|RᵀR − I|")
    clips = {i: rs.clips(i) for i in rs.layer_ids}
    if any(rs.layers[i].k_clip is not None or rs.layers[i].v_clip is not None for i in clips):
        t.add_row("per-layer clips", "; ".join(f"{i}: {k:.3f}/{v:.3f}" for i, (k, v) in clips.items()))
    bpe = [f"{n // 1024}K: {spec.bits_per_element(n, rs.head_dim):.3f}" for n in (4096, 32768, 131072)]
    t.add_row("bits/element", f"tier {spec.bits_per_element(None, rs.head_dim):.3f}; " + ", ".join(bpe))
    if p.recipe:
        skip = ("clip_search", "rotation_select")
        t.add_row("recipe", ", ".join(f"{k}={v}" for k, v in p.recipe.items() if k not in skip))
        sel = p.recipe.get("rotation_select")
        if isinstance(sel, dict):
            t.add_row("rotation selection", "; ".join(f"{i}: K {c['k']}, V {c['v']}" for i, c in sel.items()))
    if p.config_hash:
        t.add_row("model config hash", p.config_hash)
    if p.library_version:
        t.add_row("written by", f"oscarkv {p.library_version} {p.created}")
    con.print(t)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .calibration import calibrate
    from .calibration.report import summary_rows
    from .config import CalibrationConfig, QuantSpec, SpecError
    from .hf.loading import load_model
    from .rotation import save_oscar_files, save_rotations

    cfg = dataclass_from_args(CalibrationConfig, args)
    spec = dataclass_from_args(QuantSpec, args)
    if args.export_oscar and cfg.granularity != "layer":
        raise SpecError(
            f"--export-oscar needs --granularity layer (got {cfg.granularity}): OSCAR files hold one matrix per layer"
        )
    con = Console()
    model, tok = load_model(args.model, args.device, args.dtype)
    rs = calibrate(model, tok, cfg, spec, data=args.data or None, progress=not args.quiet)
    out = save_rotations(rs, args.out)
    t = Table(title=f"{cfg.method} rotations ({cfg.granularity}, V target {cfg.v_target})")
    cols = ("layer", "K λmax/mean", "V λmax/mean", "K clip", "V clip", "max|RᵀR−I|", "err", "K/V gain")
    for c in cols:
        t.add_column(c, justify="right")
    for r in summary_rows(rs):
        err = f"{r['err_global']:.2e}" if "err_global" in r else "-"
        gain = f"{r['k_gain']:.0%}/{r['v_gain']:.0%}" if "k_gain" in r else "-"
        t.add_row(
            str(r["layer"]),
            f"{r['k_spread']:.1f}",
            f"{r['v_spread']:.1f}",
            f"{r['k_clip']:.2f}",
            f"{r['v_clip']:.2f}",
            f"{r['ortho']:.1e}",
            err,
            gain,
        )
    con.print(t)
    con.print(
        "err: held-out relative attention-output error (INT2, windows) at the global clips; "
        "K/V gain: error reduction from the chosen K / V clip"
    )
    con.print(f"wrote {out}")
    if args.export_oscar:
        k, v = save_oscar_files(rs, out.parent)
        con.print(f"wrote {k} and {v} (OSCAR RotationZoo format)")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import platform
    import time

    from rich.console import Console

    from .config import EvalConfig, SpecError
    from .eval import run_eval, summary_markdown, write_report
    from .hf.loading import load_model
    from .rotation import load_rotations

    cfg = dataclass_from_args(EvalConfig, args)
    con = Console()
    model, tok = load_model(args.model, args.device, args.dtype)
    rots = load_rotations(args.rotations, model_config=model.config) if args.rotations else None
    if rots is None and any(m == "oscar" for m in cfg.method_list):
        raise SpecError("method 'oscar' needs --rotations DIR (from `oscarkv calibrate`)")
    t0 = time.perf_counter()
    rows = run_eval(
        model, tok, rots, cfg, progress=lambda m: con.print(f"[dim]{time.perf_counter() - t0:6.0f}s[/] {m}")
    )
    settings = {
        **dataclasses.asdict(cfg.effective()),
        "model": args.model,
        "rotations": args.rotations,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        # the evaluation text and needle filler are this Python's standard library
        "python": platform.python_version(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    files = write_report(args.out, rows, settings)
    con.print(summary_markdown(rows, settings))
    con.print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from transformers import TextStreamer

    from .hf import OscarCache
    from .hf.loading import load_model
    from .rotation import load_rotations

    model, tok = load_model(args.model, args.device, args.dtype)
    rots = load_rotations(args.rotations, model_config=model.config)
    cache = OscarCache.from_rotations(model, rots, backend=args.backend)
    prompt = Path(args.prompt[1:]).read_text() if args.prompt.startswith("@") else args.prompt
    ids = tok(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    sample = (
        {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
        if args.sample
        else {"do_sample": False}
    )
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=args.max_new_tokens,
            streamer=TextStreamer(tok, skip_prompt=True),
            pad_token_id=getattr(tok, "pad_token_id", None) or 0,
            **sample,
        )
    rep = cache.memory_report()
    Console(stderr=True).print(
        f"\n[dim]KV cache: {rep['total_bytes'] / 2**20:.1f} MiB for {rep['tokens_quantized']} quantized + "
        f"{rep['tokens_hp']} 16-bit tokens ({rep['bits_per_element']:.2f} bits/element; "
        f"{rep['bf16_bytes'] / 2**20:.1f} MiB in BF16)[/]"
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(out=args.out, device=args.device, quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    from .config import CalibrationConfig, EvalConfig, QuantSpec
    from .version import __version__

    ap = argparse.ArgumentParser(
        prog="oscarkv",
        description="2-bit KV caches with near-BF16 quality (OSCAR re-implemented and extended).",
    )
    ap.add_argument("--version", action="version", version=f"oscarkv {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="describe a rotation artifact (ours or OSCAR RotationZoo)")
    p.add_argument("path", help="artifact directory, rotations.safetensors, or an OSCAR k_rotation*.pt")
    p.add_argument("--v-path", help="OSCAR V file when PATH is a K .pt file with no single sibling")
    p.add_argument("--model-config", help="config.json to validate head_dim and layer coverage against")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("calibrate", help="fit K/V rotations and clip ratios for a causal LM")
    p.add_argument("--model", required=True, help="local model directory (or a hub id)")
    p.add_argument("--out", required=True, help="output directory for rotations.safetensors")
    p.add_argument("--data", nargs="*", help="text files, folders or JSONL (default: Python stdlib)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if present)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="model dtype")
    p.add_argument("--export-oscar", action="store_true", help="also write OSCAR-format .pt files")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_dataclass_args(p, CalibrationConfig, "calibration")
    add_dataclass_args(p, QuantSpec, "storage format")
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("eval", help="compare OSCAR with BF16 and the baselines (tables and plots)")
    p.add_argument("--model", required=True, help="local model directory (or a hub id)")
    p.add_argument("--rotations", help="rotation artifact for the 'oscar' method")
    p.add_argument("--out", required=True, help="output directory (results.json, results.md, PNGs)")
    p.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda if present)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="model dtype")
    add_dataclass_args(p, EvalConfig, "evaluation")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("generate", help="generate with an OscarCache, streaming to the terminal")
    p.add_argument("--model", required=True, help="local model directory (or a hub id)")
    p.add_argument("--rotations", required=True, help="rotation artifact (ours or OSCAR RotationZoo files)")
    p.add_argument("--prompt", required=True, help="the prompt, or @FILE to read it from a file")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="kernel backend")
    p.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda if present)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="model dtype")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "demo", help="calibrate + evaluate the bundled demo model (offline, a few CPU minutes)"
    )
    p.add_argument("--out", default="oscarkv-demo", help="output directory (rotations, results, plots)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="smaller budgets (a smoke run)")
    p.set_defaults(func=_cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    from .calibration.capture import UnsupportedModelError
    from .calibration.data import CorpusError
    from .config import SpecError
    from .kernels import BackendError
    from .rotation import RotationFileError

    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "command", None):
        ap.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (RotationFileError, SpecError, CorpusError, UnsupportedModelError, BackendError) as e:
        print(f"oscarkv {args.command}: error: {e}", file=sys.stderr)
        return 2
