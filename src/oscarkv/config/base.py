"""What every config shares: the error type, one-line field errors, help metadata."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from ..errors import OscarkvError

__all__ = [
    "SpecError",
    "check_positions",
    "field_error",
    "flag_name",
    "help_field",
    "is_int",
    "is_num",
    "packed_bytes",
    "short_repr",
]


class SpecError(OscarkvError):
    """A configuration value is invalid; the message names field, allowed values and value."""


def flag_name(name: str) -> str:
    """The command-line flag generated from field ``name`` (``recent_tokens`` -> ``--recent-tokens``)."""
    return "--" + name.replace("_", "-")


def short_repr(got: Any, limit: int = 80) -> str:
    r = repr(got).replace("\n", "\\n")
    return r if len(r) <= limit else r[: limit - 3] + "..."


def field_error(cls: str, name: str, allowed: str, got: Any, hint: str | bool = "") -> SpecError:
    """``CLS.NAME must be ALLOWED; got GOT`` (one line). ``hint=True`` names the field's flag."""
    if hint is True:
        hint = f"on the command line this is {flag_name(name)}"
    return SpecError(f"{cls}.{name} must be {allowed}; got {short_repr(got)}", hint or "")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def help_field(text: str, cli: bool = True, **kw: Any) -> Any:
    """A dataclass field with its ``--help`` text; ``cli=False`` keeps it off the command line."""
    return field(metadata={"help": text, "cli": cli}, **kw)


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes that one packed row of ``head_dim`` codes of ``bits`` bits occupies."""
    return head_dim * bits // 8


def check_positions(flag: str, n: int, max_positions: int | None) -> None:
    if is_int(max_positions) and max_positions > 0 and n > max_positions:
        raise SpecError(
            f"{flag} {n} exceeds the model's {max_positions} positions; pass {flag} {max_positions} or less"
        )
