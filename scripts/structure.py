"""The structure measurements of issue 45 over src/lmpm, with Python's ``ast``.

- functions in ``runtime/`` over :data:`MAX_FUNCTION_LINES` lines (a nested function counts on its
  own and inside its parent);
- classes in ``runtime/`` over :data:`MAX_CLASS_LINES` lines;
- functions anywhere with more than :data:`MAX_PARAMS` parameters (``self``/``cls`` not counted);
- private names (``_x``) of another LMPM module imported, and private modules (``lmpm.pkg._mod``)
  imported from outside their package. Third-party internals (``torch._inductor``,
  ``torch.utils._pytree``, ``ray._private``) are those projects' business and not counted.

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


def measure(src: Path = SRC) -> Offenders:
    """The offenders of every rule in the package at ``src``."""
    found: list[Def] = []
    imports: list[str] = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found.extend(defs(rel, tree))
        imports.extend(private_imports(rel, tree))
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


if __name__ == "__main__":
    main()
