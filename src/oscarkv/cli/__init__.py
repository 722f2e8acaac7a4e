"""Command-line front end: ``oscarkv calibrate | info | eval | generate | serve | demo``.

Flags come from the frozen config dataclasses. A user error (any
:class:`~oscarkv.errors.OscarkvError`) prints one ``oscarkv CMD: error: …`` line, an optional
``hint:`` line, and exits with code 2; ``--debug`` shows the traceback instead. Library warnings
meant for users print as one ``warning:`` line.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from .args import DTYPE_CHOICES, OneLineParser, add_dataclass_args, dataclass_from_args

__all__ = ["DTYPE_CHOICES", "add_dataclass_args", "build_parser", "dataclass_from_args", "main"]


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for errors")
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local model directory (or a hub id)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if present)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="model dtype")


def _strict(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse rotations recorded for another model config (default: a warning)",
    )


def _overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite", action="store_true", help="replace this command's files from an earlier run in --out"
    )


def build_parser() -> argparse.ArgumentParser:
    from ..config import CalibrationConfig, EngineConfig, EvalConfig, GenerateConfig, QuantSpec
    from ..version import __version__
    from . import commands as c
    from .engine_cmd import ENGINE_SKIP

    ap = OneLineParser(
        prog="oscarkv",
        description="2-bit KV caches with near-BF16 quality (OSCAR re-implemented and extended).",
    )
    ap.add_argument("--version", action="version", version=f"oscarkv {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    common = [_common()]

    p = sub.add_parser(
        "info", parents=common, help="describe a rotation artifact (ours or OSCAR RotationZoo)"
    )
    p.add_argument("path", help="artifact directory, rotations.safetensors, or an OSCAR k_rotation*.pt")
    p.add_argument("--v-path", help="OSCAR V file when PATH is a K .pt file with no single sibling")
    p.add_argument("--model-config", help="config.json to check head_dim, layers and fingerprint against")
    _strict(p)
    p.set_defaults(func=c.cmd_info)

    p = sub.add_parser("calibrate", parents=common, help="fit K/V rotations and clip ratios for a causal LM")
    _model_flags(p)
    p.add_argument("--out", required=True, help="output directory for rotations.safetensors")
    p.add_argument("--data", nargs="+", help="UTF-8 text files, folders or JSONL (default: Python stdlib)")
    p.add_argument("--export-oscar", action="store_true", help="also write OSCAR-format .pt files")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _overwrite(p)
    add_dataclass_args(p, CalibrationConfig, "calibration")
    add_dataclass_args(p, QuantSpec, "storage format")
    p.set_defaults(func=c.cmd_calibrate)

    p = sub.add_parser(
        "eval", parents=common, help="compare OSCAR with BF16 and the baselines (tables and plots)"
    )
    _model_flags(p)
    p.add_argument("--rotations", help="rotation artifact for the 'oscar' method")
    p.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another rotation artifact, evaluated as method oscar:NAME on the same sequences (repeatable)",
    )
    p.add_argument("--out", required=True, help="output directory (results.json, results.md, PNGs)")
    p.add_argument(
        "--data",
        nargs="+",
        help="UTF-8 text files, folders or JSONL to score (default: Python stdlib eval split)",
    )
    _overwrite(p)
    _strict(p)
    add_dataclass_args(p, EvalConfig, "evaluation")
    p.set_defaults(func=c.cmd_eval)

    p = sub.add_parser(
        "generate",
        parents=common,
        help="generate: one prompt streamed (with --rotations the 2-bit OscarCache, without it the 16-bit cache), or a batch with --engine",
    )
    _model_flags(p)
    p.add_argument(
        "--rotations",
        help="rotation artifact (ours or OSCAR RotationZoo files); without it: the 16-bit cache",
    )
    p.add_argument("--prompt", help="the prompt; @FILE reads a UTF-8 file, @@text is the literal @text")
    p.add_argument(
        "--prompts",
        help='with --engine: a JSONL file, one request per line: {"prompt": text}, '
        '{"prompt_token_ids": [...]} or {"messages": [...]}',
    )
    p.add_argument("--engine", action="store_true", help="run on the paged serving engine (a batch at once)")
    p.add_argument("--out", help="with --engine: write the outputs as JSONL here (default: stdout)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="kernel backend")
    _strict(p)
    _overwrite(p)
    add_dataclass_args(p, GenerateConfig, "generation")
    add_dataclass_args(p, EngineConfig, "engine (with --engine)", skip=ENGINE_SKIP)
    p.set_defaults(func=c.cmd_generate)

    from .serve_cmd import add_serve_parser

    add_serve_parser(sub, common)

    p = sub.add_parser(
        "demo",
        parents=common,
        help="calibrate + evaluate the bundled demo model (offline, about 30 s on two quiet CPU cores)",
    )
    p.add_argument("--out", default="oscarkv-demo", help="output directory (rotations, results, plots)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="smaller budgets (a smoke run)")
    _overwrite(p)
    p.set_defaults(func=c.cmd_demo)
    return ap


def _print_warnings(command: str) -> Any:
    from ..errors import OscarkvWarning

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, OscarkvWarning):
            print(f"oscarkv {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 user error, 130 interrupted)."""
    from ..errors import OscarkvError

    try:
        ap = build_parser()
        args = ap.parse_args(argv)
    except KeyboardInterrupt:
        print("oscarkv: interrupted", file=sys.stderr)
        return 130
    if not getattr(args, "command", None):
        print(
            "oscarkv: error: a command is required (calibrate, info, eval, generate, serve, demo)",
            file=sys.stderr,
        )
        print("  hint: `oscarkv --help` lists the commands", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.showwarning = _print_warnings(args.command)
        try:
            return int(args.func(args) or 0)
        except OscarkvError as e:
            if args.debug:
                raise
            print(f"oscarkv {args.command}: error: {e}", file=sys.stderr)
            if getattr(e, "hint", ""):
                print(f"  hint: {e.hint}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(
                f"oscarkv {args.command}: interrupted (no output file was left half-written)", file=sys.stderr
            )
            return 130
