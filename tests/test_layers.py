"""The folder layout is the architecture: imports point down the layers, and no modules import each other.

Read from the source with `ast` (nothing is imported or executed), so a planted upward import or a circle fails here
whether or not any other test exercises it. Type-only imports (`if TYPE_CHECKING:`) and imports inside functions
count too: they are the same dependency, only deferred.

    engine  <  kv_transfer  <  cluster  <  prefill_workers | decode_workers | router  <  pdcluster

The three pool/router packages sit side by side and import none of each other.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# package → its layer; a package may import its own modules and any package of a lower layer
LAYERS: dict[str, int] = {
    "engine": 0,
    "kv_transfer": 1,
    "cluster": 2,
    "prefill_workers": 3,
    "decode_workers": 3,
    "router": 3,
    "pdcluster": 4,
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a module of ours."""

    source: str  # importing module, dotted (e.g. "router.core")
    target: str  # imported module (or package), dotted
    line: int


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the layered packages under `root`, by dotted name (a package by its own name)."""
    out: dict[str, pathlib.Path] = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(root: pathlib.Path) -> Iterator[Import]:
    """Every import of one of our modules by one of our modules, anywhere in the file."""
    known = modules(root)
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # NOTE: `from pkg import mod` depends on the submodule; `from mod import name` on the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in known:  # `import a.b.c` of a non-module attribute path
                    target = target.rpartition(".")[0]
                if target and target != name:
                    yield Import(name, target, node.lineno)


def upward(root: pathlib.Path) -> list[str]:
    """Imports that point up a layer or sideways into a sibling package, as 'file:line: a imports b' lines."""
    bad = []
    for imp in imports(root):
        src, dst = imp.source.split(".")[0], imp.target.split(".")[0]
        if src != dst and LAYERS[dst] >= LAYERS[src]:
            bad.append(f"{modules(root)[imp.source].relative_to(root)}:{imp.line}: {imp.source} imports {imp.target}"
                       f" (layer {LAYERS[src]} may import only layers below it)")
    return bad


def circles(root: pathlib.Path) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (Tarjan's strongly connected parts)."""
    graph: dict[str, set[str]] = {m: set() for m in modules(root)}
    for imp in imports(root):
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_points_down_the_layers() -> None:
    assert upward(ROOT) == []


def test_no_modules_import_each_other() -> None:
    assert circles(ROOT) == []


def test_every_top_level_package_has_a_layer() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(LAYERS), "a new top-level package needs a place in LAYERS (and in README's module table)"


# ---- the checks themselves catch what they are for (a planted tree) -------------------------------------------
def plant(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for package in LAYERS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("text", [
    "from pdcluster.config import ClusterConfig\n",
    "import pdcluster.config\n",
    "def f():\n    from pdcluster import config\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pdcluster.config import ClusterConfig\n",
])
def test_a_planted_upward_import_fails(tmp_path: pathlib.Path, text: str) -> None:
    root = plant(tmp_path, {"pdcluster/config.py": "", "kv_transfer/sender.py": text})
    (bad,) = upward(root)
    assert bad.startswith("kv_transfer/sender.py:") and "kv_transfer.sender imports pdcluster" in bad


def test_a_sideways_import_between_siblings_fails(tmp_path: pathlib.Path) -> None:
    root = plant(tmp_path, {"router/core.py": "", "decode_workers/worker.py": "from router.core import Router\n"})
    assert [line.split(": ", 1)[1] for line in upward(root)] == [
        "decode_workers.worker imports router.core (layer 3 may import only layers below it)"]


def test_downward_imports_pass(tmp_path: pathlib.Path) -> None:
    root = plant(tmp_path, {"engine/x.py": "", "cluster/w.py": "from engine.x import A\nfrom engine import x\n",
                            "router/r.py": "from . import s\nfrom cluster.w import W\n", "router/s.py": ""})
    assert upward(root) == [] and circles(root) == []


def test_a_planted_circle_fails_type_only_too(tmp_path: pathlib.Path) -> None:
    root = plant(tmp_path, {
        "router/core.py": "from router.flow import RequestRun\n",
        "router/flow.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.core import Router\n",
        "engine/a.py": "from engine import b\n", "engine/b.py": "from engine import c\n",
        "engine/c.py": "def f():\n    from .a import x\n",
    })
    assert circles(root) == [["engine.a", "engine.b", "engine.c"], ["router.core", "router.flow"]]
