"""Checks every command runs before it loads a model or starts a long computation.

Each returns what the command needs (a prompt's text, a checked model, loaded rotations), or
raises an :class:`~oscarkv.errors.OscarkvError` that the CLI prints as one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InputError

__all__ = ["check_model", "load_checked_rotations", "read_json_file", "read_prompt"]


def read_prompt(arg: str) -> str:
    """``--prompt`` text: literal text, ``@FILE`` (UTF-8) or ``@@…`` for a literal leading ``@``."""
    from ..utils.files import read_text

    if arg.startswith("@@"):
        text = arg[1:]
    elif arg.startswith("@"):
        if arg == "@":
            raise InputError(
                "--prompt @: no file name after @", "pass @FILE, or @@text for a prompt starting with @"
            )
        text = read_text(arg[1:], "--prompt file")
    else:
        text = arg
    if not text.strip():
        where = f" ({arg[1:]} is empty)" if arg.startswith("@") and not arg.startswith("@@") else ""
        raise InputError(f"--prompt: the prompt is empty{where}", "pass some text, or @FILE")
    return text


def read_json_file(path: str, flag: str) -> Any:
    """A JSON file's content, or an InputError naming the flag."""
    from ..utils.files import read_text

    try:
        return json.loads(read_text(path, flag))
    except json.JSONDecodeError as e:
        raise InputError(f"{flag} {path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def check_model(path: str, device: str, weights: bool = True) -> tuple[Any, str]:
    """The checked model source (config read, no weights loaded) and the resolved device;
    ``weights=False`` accepts a directory without weight files (random-weight engine runs)."""
    from ..hf.loading import resolve_device
    from ..hf.validate import check_model_source

    dev = resolve_device(device)
    return check_model_source(path, weights), dev


def load_checked_rotations(path: str, model_config: Any, strict: bool) -> Any:
    """Rotations from ``path`` validated against the model's config (fingerprint: warn or error)."""
    from ..rotation import load_rotations

    if not Path(path).exists():
        raise InputError(
            f"--rotations {path}: no such file or directory", "pass the --out of `oscarkv calibrate`"
        )
    return load_rotations(path, model_config=model_config, strict=strict)
