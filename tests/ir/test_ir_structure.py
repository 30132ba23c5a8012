"""Structural rules, held: in ``lmpm/ir`` no class over 400 lines and no function over 60; no
import loop among LMPM's modules (imports at module level, those under ``if TYPE_CHECKING`` aside;
a package's ``__init__`` run as a parent is no import of it); the data plane below the control
plane."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "lmpm").rglob("*.py"):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The module-level imports of ``body`` (inside `if`/`try` too, not under TYPE_CHECKING)."""
    out: list[ast.Import | ast.ImportFrom] = []
    for n in body:
        if isinstance(n, ast.Import | ast.ImportFrom):
            out.append(n)
        elif isinstance(n, ast.If):
            typing_only = "TYPE_CHECKING" in ast.unparse(n.test)
            out += _imports(n.orelse) + ([] if typing_only else _imports(n.body))
        elif isinstance(n, ast.Try):
            out += _imports(n.body) + _imports(n.orelse) + _imports(n.finalbody)
    return out


def _targets(
    name: str, f: Path, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]
) -> set[str]:
    if isinstance(node, ast.Import):
        named = [a.name for a in node.names]
    else:
        base = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(max(node.level - 1, 0)):
            base = base.rpartition(".")[0]
        pre = (base + "." + node.module if node.module else base) if node.level else node.module
        assert pre is not None
        subs = [f"{pre}.{a.name}" for a in node.names if f"{pre}.{a.name}" in mods]
        named = subs if len(subs) == len(node.names) else [pre, *subs]
    out = set()
    for d in named:
        parts = d.split(".")
        found = next(
            (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods),
            None,
        )
        if found is not None and found != name:
            out.add(found)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_loop() -> None:
    mods = _modules()
    graph = {
        m: set().union(*(_targets(m, f, n, mods) for n in _imports(ast.parse(f.read_text()).body)))
        for m, f in mods.items()
    }
    assert _cycles(graph) == []


def test_the_data_plane_imports_nothing_of_the_control_plane() -> None:
    """runtime/data/ sits below runtime/control/: the control plane drives the data plane through
    the port, never the other way round (imports at module level and inside functions)."""
    up = []
    for f in sorted((SRC / "lmpm" / "runtime" / "data").glob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
            if isinstance(n, ast.ImportFrom) and n.module:
                names = [n.module]
            up += [f"{f.name}: {m}" for m in names if m.startswith("lmpm.runtime.control")]
    assert up == []


def test_no_long_class_or_function_in_ir() -> None:
    long = []
    for f in sorted((SRC / "lmpm" / "ir").rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if not isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            size = (n.end_lineno or n.lineno) - n.lineno + 1
            if size > (400 if isinstance(n, ast.ClassDef) else 60):
                long.append(f"{n.name} ({f.name}): {size} lines")
    assert long == []
