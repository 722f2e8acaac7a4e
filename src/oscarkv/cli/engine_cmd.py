"""``oscarkv generate --engine``: a batch of requests through the paged serving engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from ..errors import InputError
from .args import cli_fields
from .preflight import check_model, read_prompt

__all__ = ["ENGINE_SKIP", "check_engine_flags", "generate_engine", "read_requests"]

#: EngineConfig fields that `generate` sets from its own flags
ENGINE_SKIP = (
    "model",
    "rotations",
    "dtype",
    "device",
    "backend",
    "check_invariants",
    "load_format",
    "seed",
    "absorb_v",
)


def _engine_flags() -> list[dataclasses.Field]:
    from ..config import EngineConfig

    return cli_fields(EngineConfig, ENGINE_SKIP)


def check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse engine-only flags without ``--engine`` and the prompt flags that do not go together."""
    if not args.engine:
        for f in _engine_flags():
            if getattr(args, f.name) != f.default:
                flag = "--" + f.name.replace("_", "-")
                raise InputError(f"{flag} only applies with --engine; add --engine or drop {flag}")
        for flag, v in (("--prompts", args.prompts), ("--out", args.out)):
            if v is not None:
                raise InputError(f"{flag} only applies with --engine (a batch of requests)")
        if args.prompt is None:
            raise InputError(
                "generate needs --prompt TEXT|@FILE", "or --engine --prompts FILE.jsonl for a batch"
            )
    elif (args.prompt is None) == (args.prompts is None):
        raise InputError("--engine needs exactly one of --prompt TEXT|@FILE and --prompts FILE.jsonl")


def read_requests(path: str) -> list[Any]:
    """``--prompts`` JSONL: each line a text prompt, token ids, or chat messages."""
    from ..utils.files import read_text

    reqs: list[Any] = []
    for n, line in enumerate(read_text(path, "--prompts").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--prompts {path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg})") from None
        keys = [k for k in ("prompt", "prompt_token_ids", "messages") if isinstance(obj, dict) and k in obj]
        if len(keys) != 1:
            raise InputError(
                f'{where}: expected an object with one of "prompt", "prompt_token_ids" or "messages"'
            )
        reqs.append((keys[0], obj[keys[0]]))
    if not reqs:
        raise InputError(f"--prompts {path}: holds no requests")
    return reqs


def _sampling(gen: Any) -> Any:
    """The engine's SamplingParams for a :class:`~oscarkv.config.GenerateConfig`."""
    from ..engine import SamplingParams

    kw = gen.sampling_kwargs()
    if not kw["do_sample"]:
        return SamplingParams(max_tokens=gen.max_new_tokens, temperature=0)
    top_k = kw.get("top_k") or -1
    return SamplingParams(
        max_tokens=gen.max_new_tokens, temperature=kw["temperature"], top_p=kw["top_p"], top_k=top_k
    )


def generate_engine(args: argparse.Namespace, gen: Any) -> int:
    """Run every request of ``--prompts`` (or the one ``--prompt``) with the sampling of ``gen``
    (a GenerateConfig) and print or write JSONL."""
    from rich.console import Console

    from ..config import EngineConfig
    from ..utils.files import atomic_write_text, check_output_file

    params = _sampling(gen)
    reqs = read_requests(args.prompts) if args.prompts else [("prompt", read_prompt(args.prompt))]
    if args.out:
        check_output_file(args.out, overwrite=args.overwrite)
    eng = {f.name: getattr(args, f.name) for f in _engine_flags()}
    cfg = EngineConfig(model=args.model, rotations=args.rotations, dtype=args.dtype, device=args.device,
                       backend=args.backend, **eng)  # fmt: skip
    check_model(args.model, args.device, weights=cfg.load_format != "dummy")
    from ..engine.llm import LLM
    from ..engine.tokenizer import apply_chat

    t0 = time.perf_counter()
    with LLM.from_config(cfg) as llm:
        prompts = [apply_chat(llm.tokenizer, v) if k == "messages" else v for k, v in reqs]
        outs = llm.generate(prompts, params)
        report = llm.engine.startup_report()
    secs = time.perf_counter() - t0
    lines = [
        json.dumps(
            {
                "index": i,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "prompt_tokens": len(o.prompt_token_ids),
                "cached_tokens": o.num_cached_tokens,
            }
        )
        for i, o in enumerate(outs)
    ]
    if args.out:
        atomic_write_text(args.out, "\n".join(lines) + "\n")
    else:
        sys.stdout.write("\n".join(lines) + "\n")
    n_out = sum(len(o.token_ids) for o in outs)
    Console(stderr=True).print(
        f"[dim]{len(outs)} requests, {n_out} tokens in {secs:.1f}s ({n_out / secs:.1f} tok/s incl. loading); "
        f"{report}" + (f"; wrote {args.out}" if args.out else "") + "[/]"
    )
    return 0
