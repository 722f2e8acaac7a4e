"""Flags from frozen config dataclasses, and an argparse parser whose errors are one line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any, NoReturn

__all__ = ["DTYPE_CHOICES", "OneLineParser", "add_dataclass_args", "cli_fields", "dataclass_from_args"]

#: ``--dtype`` choices: the keys of :data:`oscarkv.hf.loading.DTYPES`, repeated here so that parsing
#: flags (``--help``, ``info``) does not import transformers (tests/test_cli.py keeps the two equal)
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as ``PROG: error: MESSAGE`` plus a hint line, exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        print(f"  hint: `{self.prog} --help` lists every flag", file=sys.stderr)
        raise SystemExit(2)


def _scalar_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, group: str | None = None, skip: tuple[str, ...] = ()
) -> None:
    """Add one ``--field-name`` flag per field of dataclass ``cls`` (default: the field default),
    except the fields in ``skip`` (the command has its own flag for them)."""
    target = parser.add_argument_group(group or cls.__name__) if group != "" else parser
    hints = typing.get_type_hints(cls)
    for f in cli_fields(cls, skip):
        tp = _scalar_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        # argparse %-formats help text: a literal % in a field's help ("25% of ...") must be doubled
        help_ = (f.metadata.get("help", "") + f" (default: {default})").replace("%", "%%")
        if tp is bool:
            target.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_,
                dest=f.name,
            )
        else:
            optional = tp is not hints[f.name] and tp in (int, float)  # `none` gives None
            target.add_argument(
                flag, type=_or_none(tp) if optional else tp, default=default, help=help_, dest=f.name
            )


def _or_none(tp: type) -> Any:
    """``tp`` from a flag's text, or None from ``none``."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else tp(text)

    parse.__name__ = tp.__name__  # argparse names the type in its error: "invalid float value"
    return parse


def cli_fields(cls: type, skip: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """The fields of ``cls`` that :func:`add_dataclass_args` turns into flags (given the same ``skip``)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and f.name not in skip]


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build ``cls`` from the flags added by :func:`add_dataclass_args` (validation errors
    surface as the dataclass's own ``SpecError``)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
