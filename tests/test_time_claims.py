"""The demo's running time is stated the same way wherever a user reads it: the README, the
demo's docstring and ``oscarkv --help``."""

from __future__ import annotations

import re
from pathlib import Path

import oscarkv.demo
from oscarkv.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CLAIM = re.compile(r"about (\d+ (?:s|min(?:utes)?))")


def _claims(text: str) -> set[str]:
    return set(CLAIM.findall(" ".join(text.split())))


def test_the_demo_time_agrees_in_readme_docstring_and_help() -> None:
    readme = (ROOT / "README.md").read_text()
    command1 = readme[readme.index("Command 1 shows") :][:200]
    doc = (oscarkv.demo.__doc__ or "").split("\n\n")[0]
    helps = build_parser().format_help()
    demo_help = helps[helps.index("evaluate the bundled demo") :][:200]
    found = [_claims(command1), _claims(doc), _claims(demo_help)]
    assert all(len(c) == 1 for c in found) and len(set.union(*found)) == 1, found
