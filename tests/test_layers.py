"""Lower layers never import higher ones (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "oscarkv"

LAYER = {
    "config": 0,
    "utils": 0,
    "quant": 1,
    "rotation": 1,
    "kernels": 2,
    "calibration": 3,
    "hf": 3,
    "engine": 4,
    "eval": 5,
    "server": 5,
    "demo": 6,
    "cli": 6,
    "__main__": 6,
    "__init__": 6,
}
#: third-party packages a layer may not import at module level or anywhere in it
FORBIDDEN = {0: {"torch", "transformers", "triton"}, 1: {"transformers", "triton", "fastapi"}}


def _top(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    return rel.parts[0]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name inside oscarkv or third-party name, line) for every import."""
    tree = ast.parse(path.read_text())
    pkg = list(path.relative_to(SRC).parent.parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(["oscarkv", *base, *(node.module.split(".") if node.module else [])])
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
    return out


FILES = sorted(p for p in SRC.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_layering(path: Path) -> None:
    mine = LAYER[_top(path)]
    for mod, line in _imports(path):
        parts = mod.split(".")
        if parts[0] == "oscarkv" and len(parts) > 1:
            theirs = LAYER[parts[1]]
            assert theirs <= mine, f"{path.name}:{line} (layer {mine}) imports {mod} (layer {theirs})"
        else:
            assert parts[0] not in FORBIDDEN.get(mine, set()), f"{path.name}:{line} imports {mod}"


def test_layer_table_covers_every_package() -> None:
    assert {_top(p) for p in FILES} <= set(LAYER)
