"""The structure measurements of issue 45 over src/lmpm, with Python's ``ast``.

- functions in ``runtime/`` over :data:`MAX_FUNCTION_LINES` lines (a nested function counts on its
  own and inside its parent);
- classes in ``runtime/`` over :data:`MAX_CLASS_LINES` lines;
- functions anywhere with more than :data:`MAX_PARAMS` parameters (``self``/``cls`` not counted);
- private names (``_x``) of another LMPM module imported, and private modules (``lmpm.pkg._mod``)
  imported from outside their package. Third-party internals (``torch._inductor``,
  ``torch.utils._pytree``, ``ray._private``) are those projects' business and not counted;
- private attributes read across modules: ``obj._x`` where ``obj`` is not ``self``/``cls`` and
  ``_x`` is not defined in the reading module (a ``def``/``class``, a ``self._x =`` assignment, a
  class or module level name): another module's internals (``group._owner_calls``,
  ``shapes._BOUNDS``). Reads rooted in a third-party import (``torch._C``, ``sys._getframe``,
  ``aten = torch.ops.aten; aten._to_copy``) and :data:`THIRD_PARTY_ATTRS` are not counted.

``tests/test_structure.py`` asserts the rules on these measurements (with its allow-lists).

    python scripts/structure.py        # one line per offender, grouped by rule
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lmpm"
MAX_FUNCTION_LINES = 80  # in runtime/
MAX_CLASS_LINES = 600  # in runtime/
MAX_PARAMS = 8  # anywhere in src/lmpm
# private names of third-party APIs read on objects whose type the walk does not know
THIRD_PARTY_ATTRS = frozenset(
    {
        "_version",  # torch.Tensor._version: the in-place version counter
        "_asdict",  # NamedTuple's public API (underscored against field clashes)
        "_replace",
        "_fields",
        "_make",
    }
)


@dataclass(frozen=True, slots=True)
class Def:
    """A function or class of src/lmpm, by its qualified name in its module."""

    where: str  # "runtime/session.py::Run.__init__"
    line: int
    kind: str  # "function" or "class"
    lines: int
    params: int  # a function's, without self/cls (0 for a class)


@dataclass(frozen=True, slots=True)
class Offenders:
    """What breaks each rule, by qualified name (imports: ``file: lmpm.module.name``)."""

    long_functions: dict[str, Def]
    long_classes: dict[str, Def]
    many_params: dict[str, Def]
    private_imports: list[str]
    private_attributes: list[str]  # "file: expr", each once per file


def params(a: ast.arguments) -> int:
    """The parameters of a signature, ``self``/``cls`` not counted."""
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    n += (a.vararg is not None) + (a.kwarg is not None)
    first = (a.posonlyargs + a.args)[:1]
    return n - 1 if first and first[0].arg in ("self", "cls") else n


def defs(rel: str, node: ast.AST, prefix: str = "") -> Iterator[Def]:
    """Every function and class under ``node`` of module file ``rel``, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{child.name}"
            assert child.end_lineno is not None
            lines = child.end_lineno - child.lineno + 1
            if isinstance(child, ast.ClassDef):
                yield Def(f"{rel}::{name}", child.lineno, "class", lines, 0)
            else:
                n = params(child.args)
                yield Def(f"{rel}::{name}", child.lineno, "function", lines, n)
            yield from defs(rel, child, f"{name}.")
        else:
            yield from defs(rel, child, prefix)


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def package(rel: str) -> str:
    """The dotted package of a module file: ``runtime/data/owner.py`` -> ``lmpm.runtime.data``."""
    return ".".join(["lmpm", *rel.split("/")[:-1]])


def _absolute(rel: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = package(rel).split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def private_imports(rel: str, tree: ast.Module) -> Iterator[str]:
    """``rel: lmpm.mod.name`` for each private LMPM name or module that ``rel`` imports from
    outside the package that owns it."""
    here = package(rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(rel, node)
            names = [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for dotted in names:
            parts = dotted.split(".")
            if parts[0] != "lmpm":
                continue  # a third party's internals: not LMPM's structure
            for i, part in enumerate(parts[1:], start=1):
                # a private module or name belongs to its package: importing it there is fine
                owner = ".".join(parts[:i])
                if _private(part) and not (here == owner or here.startswith(owner + ".")):
                    yield f"{rel}: {dotted}"
                    break


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain or call starts from (``torch`` of ``torch.ops.aten``)."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _owned_and_foreign(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The private names a module defines itself, and the names bound to third-party objects
    (imported from outside LMPM, or assigned at module level from such a name)."""
    owned: set[str] = set()
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            owned.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                owned.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            owned.add(node.id)
        elif isinstance(node, ast.arg):
            owned.add(node.arg)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "lmpm":
                    foreign.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if (node.module or "").split(".")[0] != "lmpm":
                foreign.update(a.asname or a.name for a in node.names)
    for stmt in tree.body:  # aten = torch.ops.aten
        if isinstance(stmt, ast.Assign) and _root(stmt.value) in foreign:
            foreign.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return owned, foreign


def private_attributes(rel: str, tree: ast.Module) -> Iterator[str]:
    """``rel: expr`` for each read of another module's private attribute (see the module doc),
    once per expression, in source order."""
    owned, foreign = _owned_and_foreign(tree)
    seen: set[str] = set()
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _private(n.attr)]
    for node in sorted(reads, key=lambda n: (n.lineno, n.col_offset)):
        if node.attr in owned or node.attr in THIRD_PARTY_ATTRS:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue  # its own (``self.group._calls`` is not: the group's)
        if _root(node.value) in foreign:
            continue
        text = f"{rel}: {ast.unparse(node)}"
        if text not in seen:
            seen.add(text)
            yield text


def measure(src: Path = SRC) -> Offenders:
    """The offenders of every rule in the package at ``src``."""
    found: list[Def] = []
    imports: list[str] = []
    attributes: list[str] = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found.extend(defs(rel, tree))
        imports.extend(private_imports(rel, tree))
        attributes.extend(private_attributes(rel, tree))
    runtime = [d for d in found if d.where.startswith("runtime/")]
    return Offenders(
        long_functions={
            d.where: d for d in runtime if d.kind == "function" and d.lines > MAX_FUNCTION_LINES
        },
        long_classes={
            d.where: d for d in runtime if d.kind == "class" and d.lines > MAX_CLASS_LINES
        },
        many_params={d.where: d for d in found if d.kind == "function" and d.params > MAX_PARAMS},
        private_imports=imports,
        private_attributes=attributes,
    )


def main() -> None:
    o = measure()
    groups = [
        (f"functions > {MAX_FUNCTION_LINES} lines in runtime/", o.long_functions, "lines"),
        (f"classes > {MAX_CLASS_LINES} lines in runtime/", o.long_classes, "lines"),
        (f"functions > {MAX_PARAMS} parameters", o.many_params, "params"),
    ]
    for title, found, field in groups:
        print(f"== {title}: {len(found)}")
        for d in sorted(found.values(), key=lambda d: -getattr(d, field)):
            print(f"   {getattr(d, field):4d}  {d.where} (line {d.line})")
    print(f"== private imports across modules: {len(o.private_imports)}")
    for imp in o.private_imports:
        print(f"   {imp}")
    print(f"== private attributes read across modules: {len(o.private_attributes)}")
    for attr in o.private_attributes:
        print(f"   {attr}")


if __name__ == "__main__":
    main()
