"""Lower layers never import higher ones, the import graph has no cycle (docs/architecture.md).

The checker takes a source root, so the tests at the bottom run it on small synthetic trees.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "oscarkv"

#: top-level module or package -> layer; ``__init__`` is the package root, the top layer
LAYER = {
    "config": 0,
    "errors": 0,
    "utils": 0,
    "version": 0,
    "quant": 1,
    "rotation": 1,
    "kernels": 2,
    "store": 3,
    "calibration": 4,
    "hf": 4,
    "engine": 5,
    "eval": 6,
    "server": 6,
    "vllm_plugin": 6,
    "demo": 7,
    "cli": 7,
    "__main__": 7,
    "__init__": 7,
}
#: packages a package never imports, whatever the layer numbers allow: the tiered store has one
#: owner (``store``), which the three hosts (``hf``, ``engine``, ``vllm_plugin``) call; no host
#: reaches into another
NEVER = {
    "store": frozenset({"hf", "engine", "vllm_plugin", "server", "eval", "calibration", "cli", "demo"}),
    "hf": frozenset({"engine", "vllm_plugin", "server", "eval", "cli", "demo"}),
    "engine": frozenset({"hf", "eval", "calibration", "cli", "demo", "server", "vllm_plugin"}),
    "vllm_plugin": frozenset({"engine", "hf", "server", "eval", "calibration", "cli", "demo"}),
    "server": frozenset({"hf", "eval", "calibration", "cli", "demo", "vllm_plugin"}),
}
#: third-party packages a layer may not import at module level or anywhere in it
FORBIDDEN = {
    0: frozenset({"torch", "transformers", "triton"}),
    1: frozenset({"transformers", "triton", "fastapi"}),
}
#: third-party package -> the only top-level packages that may import it
ONLY_IN = {
    "fastapi": frozenset({"server"}),
    "uvicorn": frozenset({"server"}),
    "starlette": frozenset({"server"}),
    "vllm": frozenset({"vllm_plugin"}),
}
#: third-party package -> (package, the only paths inside it that may import it)
ONLY_UNDER = {"transformers": ("engine", ("engine/models/", "engine/tokenizer.py"))}


class Import(NamedTuple):
    """One imported name: a module of the tree (``internal``) or a third-party top-level package."""

    target: str
    line: int
    internal: bool


def module_name(path: Path, root: Path) -> str:
    """``root/hf/cache.py`` -> ``oscarkv.hf.cache``; a package's ``__init__.py`` -> the package."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path) -> bool:
    """Whether ``name`` (``oscarkv.x.y``) is a module or (namespace) package of the tree."""
    rel = root.joinpath(*name.split(".")[1:])
    return rel.with_suffix(".py").is_file() or rel.is_dir()


def imports(path: Path, root: Path) -> list[Import]:
    """Every import in ``path``, in functions too; ``from P import X`` is of ``P.X`` when that is a
    module of the tree, else of ``P`` (a name defined in ``P``'s ``__init__``)."""
    pkg = root.name
    here = module_name(path, root).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package a relative import starts from
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                out.append(Import(a.name if top == pkg else top, node.lineno, top == pkg))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(
                    [*here[: len(here) - node.level + 1], *([node.module] if node.module else [])]
                )
            else:
                base = node.module or ""
            if base.split(".")[0] != pkg:
                out.append(Import(base.split(".")[0], node.lineno, False))
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append(Import(sub if _is_module(sub, root) else base, node.lineno, True))
    return out


def _top(module: str) -> str:
    """The top-level package of a module name (``__init__`` for the root itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def file_violations(path: Path, root: Path) -> list[str]:
    """Layer, package and third-party rule violations of one file, as ``rel:line message``."""
    rel = path.relative_to(root).as_posix()
    mine = _top(module_name(path, root))
    if mine not in LAYER:
        return [f"{rel}: package {mine!r} is not in the layer table"]
    out = []
    for imp in imports(path, root):
        where = f"{rel}:{imp.line}"
        if imp.internal:
            theirs = _top(imp.target)
            if theirs not in LAYER:
                out.append(f"{where} imports {imp.target}: {theirs!r} is not in the layer table")
            elif LAYER[theirs] > LAYER[mine]:
                out.append(f"{where} (layer {LAYER[mine]}) imports {imp.target} (layer {LAYER[theirs]})")
            elif theirs in NEVER.get(mine, ()):
                out.append(f"{where}: {mine} never imports {theirs} ({imp.target})")
            continue
        if imp.target in FORBIDDEN.get(LAYER[mine], ()):
            out.append(f"{where} (layer {LAYER[mine]}) imports {imp.target}")
        if imp.target in ONLY_IN and mine not in ONLY_IN[imp.target]:
            out.append(f"{where} imports {imp.target} (only {', '.join(sorted(ONLY_IN[imp.target]))} may)")
        if imp.target in ONLY_UNDER:
            pkg, allowed = ONLY_UNDER[imp.target]
            if mine == pkg and not any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in allowed):
                out.append(f"{where} imports {imp.target} (in {pkg} only under {', '.join(allowed)})")
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the tree's modules it imports, minus edges to its own enclosing packages."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        mine = graph.setdefault(me, set())
        for imp in imports(path, root):
            # a submodule importing its package's __init__ (`from .. import KernelOps`) is the
            # normal way packages share names; the layer rule still sees root imports
            if imp.internal and imp.target != me and not me.startswith(imp.target + "."):
                mine.add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the trees are small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, c) for c in sorted(comps, key=min) if len(c) > 1]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """The shortest path from the component's first module back to itself (BFS inside it)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # impossible for a component of size > 1


def check(root: Path) -> list[str]:
    """Every violation in the tree under ``root``: per-file rules, then import cycles."""
    out = [v for p in sorted(root.rglob("*.py")) for v in file_violations(p, root)]
    return out + ["import cycle: " + " -> ".join(c) for c in cycles(import_graph(root))]


# ---- the real tree ------------------------------------------------------------------------
FILES = sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_layering(path: Path) -> None:
    assert file_violations(path, SRC) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph(SRC)) == []


def test_layer_table_covers_every_package() -> None:
    assert {_top(module_name(p, SRC)) for p in FILES} <= set(LAYER)


# ---- the checker on synthetic trees -------------------------------------------------------
CLEAN = {
    "__init__.py": "from .version import __version__\nfrom .hf import cache\n",
    "version.py": "__version__ = '1'\n",
    "config.py": "import dataclasses\n",
    "kernels/__init__.py": "class KernelOps: ...\n",
    "kernels/triton/__init__.py": "",
    "kernels/triton/ops.py": "from .. import KernelOps\nimport triton\n",
    "hf/__init__.py": "from .cache import C\n",
    "hf/cache.py": "import transformers\nfrom ..config import X\nfrom ..version import __version__\n",
    "calibration/__init__.py": "",
    "calibration/api.py": "from oscarkv import version\nfrom ..version import __version__\n",
    "engine/__init__.py": "",
    "engine/models/__init__.py": "",
    "engine/models/m.py": "from transformers import PretrainedConfig\nfrom ...kernels import KernelOps\n",
    "engine/tokenizer.py": "import transformers\n",
    "server/__init__.py": "",
    "server/z.py": "import fastapi\nimport uvicorn\nfrom starlette import responses\nfrom ..engine import tokenizer\n",
    "cli.py": "def main():\n    from .hf import loading\n    from . import demo\n",
    "demo.py": "from .hf.cache import C\n",
}


def _tree(tmp_path: Path, **extra: str) -> Path:
    """``tmp_path/oscarkv`` holding :data:`CLEAN` plus ``extra`` (keys: paths with ``__`` for ``/``)."""
    root = tmp_path / "oscarkv"
    for rel, text in {**CLEAN, **{k.replace("__", "/") + ".py": v for k, v in extra.items()}}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_clean_tree_passes(tmp_path: Path) -> None:
    assert check(_tree(tmp_path)) == []


def test_from_dot_dot_import_of_a_module_is_that_module(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert [i.target for i in imports(root / "calibration/api.py", root)] == ["oscarkv.version"] * 2
    assert [i.target for i in imports(root / "kernels/triton/ops.py", root)] == ["oscarkv.kernels", "triton"]


@pytest.mark.parametrize(
    "text",
    [
        "from .. import __version__\n",
        "import oscarkv\n",
        "from oscarkv import calibrate\n",
        "from .. import *\n",
    ],
)
def test_root_import_from_a_lower_layer_fails(tmp_path: Path, text: str) -> None:
    assert check(_tree(tmp_path, calibration__y=text)) == [
        "calibration/y.py:1 (layer 4) imports oscarkv (layer 7)"
    ]


def test_higher_layer_import_fails(tmp_path: Path) -> None:
    assert check(_tree(tmp_path, quant__q="def f():\n    from oscarkv.kernels import KernelOps\n")) == [
        "quant/q.py:2 (layer 1) imports oscarkv.kernels (layer 2)"
    ]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"engine__x": "from ..hf import cache\n"},
            "engine/x.py:1: engine never imports hf (oscarkv.hf.cache)",
        ),
        (
            {"engine__x": "import oscarkv.calibration\n"},
            "engine/x.py:1: engine never imports calibration (oscarkv.calibration)",
        ),
        (
            {"server__s": "from ..eval import run\n"},
            "server/s.py:1: server never imports eval (oscarkv.eval.run)",
        ),
        (
            {"server__s": "from oscarkv.hf import loading\n"},
            "server/s.py:1: server never imports hf (oscarkv.hf)",
        ),
        # the hosts of the tiered store reach it through ``store``, never through another host
        (
            {"vllm_plugin__x": "from ..engine import tokenizer\n"},
            "vllm_plugin/x.py:1: vllm_plugin never imports engine (oscarkv.engine.tokenizer)",
        ),
        (
            {"vllm_plugin__x": "def f():\n    import oscarkv.engine\n"},
            "vllm_plugin/x.py:2: vllm_plugin never imports engine (oscarkv.engine)",
        ),
        (
            {"vllm_plugin__x": "from oscarkv.hf import cache\n"},
            "vllm_plugin/x.py:1: vllm_plugin never imports hf (oscarkv.hf.cache)",
        ),
        (
            {"hf__x": "from ..engine import tokenizer\n"},
            "hf/x.py:1 (layer 4) imports oscarkv.engine.tokenizer (layer 5)",
        ),
        (
            {"engine__x": "from oscarkv.vllm_plugin import x\n", "vllm_plugin__x": ""},
            "engine/x.py:1 (layer 5) imports oscarkv.vllm_plugin.x (layer 6)",
        ),
        (
            {"store__s": "from ..hf import cache\n"},
            "store/s.py:1 (layer 3) imports oscarkv.hf.cache (layer 4)",
        ),
        (
            {"store__s": "from ..engine.models import m\n"},
            "store/s.py:1 (layer 3) imports oscarkv.engine.models.m (layer 5)",
        ),
    ],
)
def test_package_rules(tmp_path: Path, extra: dict[str, str], expected: str) -> None:
    assert check(_tree(tmp_path, eval__run="", **extra)) == [expected]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"engine__w": "import fastapi\n"}, "engine/w.py:1 imports fastapi (only server may)"),
        ({"hf__w": "from uvicorn import run\n"}, "hf/w.py:1 imports uvicorn (only server may)"),
        ({"cli": "import starlette.routing\n"}, "cli.py:1 imports starlette (only server may)"),
        (
            {"engine__e": "from transformers import AutoTokenizer\n"},
            "engine/e.py:1 imports transformers (in engine only under engine/models/, engine/tokenizer.py)",
        ),
        ({"config": "import torch\n"}, "config.py:1 (layer 0) imports torch"),
        ({"rotation__r": "import triton\n"}, "rotation/r.py:1 (layer 1) imports triton"),
    ],
)
def test_third_party_rules(tmp_path: Path, extra: dict[str, str], expected: str) -> None:
    assert check(_tree(tmp_path, **extra)) == [expected]


def test_fastapi_in_layer_1_breaks_two_rules(tmp_path: Path) -> None:
    assert check(_tree(tmp_path, quant__f="import fastapi\n")) == [
        "quant/f.py:1 (layer 1) imports fastapi",
        "quant/f.py:1 imports fastapi (only server may)",
    ]


def test_unknown_package_fails(tmp_path: Path) -> None:
    assert check(_tree(tmp_path, extras__x="", cli="from .extras import x\n")) == [
        "cli.py:1 imports oscarkv.extras.x: 'extras' is not in the layer table",
        "extras/x.py: package 'extras' is not in the layer table",
    ]


def test_two_module_cycle_fails(tmp_path: Path) -> None:
    # the cli <-> demo circle that load_model's move ended: same layer, so only the graph sees it
    root = _tree(tmp_path, demo="def run():\n    from .cli import main\n")
    assert check(root) == ["import cycle: oscarkv.cli -> oscarkv.demo -> oscarkv.cli"]


def test_longer_cycle_through_packages_fails(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        quant__a="from . import b\n",
        quant__b="from .c import f\n",
        quant__c="import oscarkv.quant.a\n",
    )
    assert cycles(import_graph(root)) == [
        ["oscarkv.quant.a", "oscarkv.quant.b", "oscarkv.quant.c", "oscarkv.quant.a"]
    ]


def test_package_init_edges_are_not_cycles(tmp_path: Path) -> None:
    # hf/__init__ -> hf.cache -> hf (its own package): allowed; cache -> the sibling it re-exports is not
    assert cycles(import_graph(_tree(tmp_path, hf__cache="from . import C\n"))) == []
    root = _tree(tmp_path / "b", hf__cache="from .pools import P\n", hf__pools="from .cache import C\n")
    assert cycles(import_graph(root)) == [["oscarkv.hf.cache", "oscarkv.hf.pools", "oscarkv.hf.cache"]]


@pytest.mark.parametrize(("pkg", "other"), [("store", "hf"), ("store", "engine"), ("store", "vllm_plugin"),
                                            ("store", "server"), ("hf", "engine"), ("vllm_plugin", "engine")])  # fmt: skip
def test_never_rules_hold_whatever_the_layers(pkg: str, other: str) -> None:
    # the hosts and the store stay apart even if the layer numbers are ever reordered
    assert other in NEVER[pkg]


def test_rule_tables_name_real_packages() -> None:
    assert set(NEVER) | {p for s in NEVER.values() for p in s} <= set(LAYER)
    assert {p for s in ONLY_IN.values() for p in s} | {p for p, _ in ONLY_UNDER.values()} <= set(LAYER)
