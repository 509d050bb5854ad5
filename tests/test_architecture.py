"""The architecture stays as the docs say: one installed import package (`refine`, the exporters
inside it as `refine.exporters`), and no import circles in refine/ or exporters/ (two modules
that each need the other can be read, tested or changed only together)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"refine": REPO / "refine", "refine.exporters": REPO / "exporters"}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by its dotted name (the exporters' folder as
    refine.exporters, as the wheel ships it)."""
    found = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports (any import statement, at any depth of the source, also
    under TYPE_CHECKING: a type is a dependency too). `from P import name` counts as an import of
    P.name where that is a module, else of P."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in known else base)
        graph[name] = {e for e in edges if e in known and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_exporters_import_under_refine_and_nowhere_else(tmp_path: Path) -> None:
    """In this (editable) install: `refine.exporters` is the repository's exporters/ folder, and
    there is no top-level `exporters` package (run from a directory that is not the checkout)."""
    code = ("import importlib.util, refine.exporters, refine.exporters.errors as e; "
            "print(refine.exporters.__file__); print(importlib.util.find_spec('exporters'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, check=True)
    path, spec = out.stdout.split("\n")[:2]
    assert Path(path) == REPO / "exporters" / "__init__.py"
    assert spec == "None"


def test_the_wheel_holds_one_package(tmp_path: Path) -> None:
    """`pip wheel --no-deps .`: one top-level package, refine, with the lemma library and the
    exporters inside it."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(REPO), "-w", str(tmp_path)],
                          capture_output=True, text=True)
    if done.returncode != 0 and "No matching distribution" in done.stderr:
        pytest.skip("the build backend cannot be installed here (no package index)")
    assert done.returncode == 0, done.stderr
    [wheel] = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"refine", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "refine/exporters/capture/export.py" in names and "refine/rules/core.lp" in names
    assert not any(n.startswith("exporters/") for n in names)
