"""``oscarkv serve``: the OpenAI-compatible HTTP server over the paged engine."""

from __future__ import annotations

import argparse

from ..errors import InputError
from .args import add_dataclass_args, cli_fields, dataclass_from_args

__all__ = ["SERVE_ENGINE_SKIP", "add_serve_parser", "cmd_serve"]

#: EngineConfig fields that are not flags of `serve` (``--model`` is its own, required flag)
SERVE_ENGINE_SKIP = ("model", "check_invariants")


def add_serve_parser(sub: argparse._SubParsersAction, common: list[argparse.ArgumentParser]) -> None:
    from ..config import EngineConfig, ServerConfig

    p = sub.add_parser(
        "serve", parents=common, help="serve an OpenAI-compatible HTTP API (completions, chat)"
    )
    p.add_argument("--model", required=True, help="model directory: config.json, *.safetensors, tokenizer")
    add_dataclass_args(p, EngineConfig, "engine", skip=SERVE_ENGINE_SKIP)
    add_dataclass_args(p, ServerConfig, "server")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Check the flags and files, load the model, serve until Ctrl-C."""
    from ..config import EngineConfig, ServerConfig
    from ..utils.files import read_text
    from .preflight import check_model

    kw = {f.name: getattr(args, f.name) for f in cli_fields(EngineConfig, SERVE_ENGINE_SKIP)}
    eng = EngineConfig(model=args.model, **kw)
    if eng.kv_dtype == "int2" and eng.rotations is None:
        raise InputError(
            "serve with --kv-dtype int2 (the default) needs --rotations DIR",
            "pass --rotations DIR (from `oscarkv calibrate`), or --kv-dtype bf16 to serve without OSCAR",
        )
    srv = dataclass_from_args(ServerConfig, args)
    for path, what in ((srv.chat_template, "--chat-template"), (srv.api_key_file, "--api-key-file")):
        if path is not None:
            read_text(path, what)
    check_model(args.model, eng.device, weights=eng.load_format != "dummy")
    from ..server.launch import serve

    serve(eng, srv)
    return 0
