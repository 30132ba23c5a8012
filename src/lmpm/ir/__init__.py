"""The Lamport IR: nodes, lowering from the AST, the checker, JSON and the text printer.

``compile_source`` runs the whole front end (parse → build → check) without importing torch.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lmpm.errors import Diagnostic, DiagnosticSink, ParseError
from lmpm.ir.build import build
from lmpm.ir.check import check, lint
from lmpm.ir.nodes import Program
from lmpm.lang import ast
from lmpm.lang.parser import parse, parse_file


@dataclass(frozen=True, slots=True)
class Frontend:
    """The result of compiling a program: its AST, its checked IR and every diagnostic."""

    ast: ast.Program
    ir: Program
    diagnostics: tuple[Diagnostic, ...]

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")

    @property
    def warnings(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "warning")


def _front(
    tree: ast.Program,
    overrides: Mapping[str, int] | None,
    strict: bool,
    known_names: Iterable[str] | None,
    raise_errors: bool,
    bound_names: Iterable[str] = (),
) -> Frontend:
    sink = DiagnosticSink()
    ir = check(  # (after the lowering's faults, only the training pass runs)
        build(tree, sink),
        sink,
        overrides=overrides,
        known_names=known_names,
        strict=strict,
        tree=tree,
        bound_names=bound_names,
    )
    if raise_errors:
        sink.raise_if_errors()
    return Frontend(tree, ir, tuple(sink.items))


@contextmanager
def _no_gc() -> Iterator[None]:
    """The front end allocates many small acyclic objects (tokens, spans, nodes); the cyclic
    collector would rescan them over and over. Reference counting frees them all the same."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def compile_source(
    text: str,
    file: str = "<input>",
    *,
    overrides: Mapping[str, int] | None = None,
    strict: bool = False,
    known_names: Iterable[str] | None = None,
    raise_errors: bool = True,
    bound_names: Iterable[str] = (),
) -> Frontend:
    """Parse, lower and check ``text``. Raises ParseError/CheckError unless ``raise_errors=False``
    (then parse errors still raise, and check errors are in ``diagnostics``). ``bound_names``: the
    names the run's own bindings provide (a built-in they override is not held to its signature)."""
    with _no_gc():
        return _front(parse(text, file), overrides, strict, known_names, raise_errors, bound_names)


def compile_file(
    path: str | Path,
    *,
    overrides: Mapping[str, int] | None = None,
    strict: bool = False,
    known_names: Iterable[str] | None = None,
    raise_errors: bool = True,
    bound_names: Iterable[str] = (),
) -> Frontend:
    """:func:`compile_source` on a file (bytes that are not UTF-8 are a ParseError)."""
    with _no_gc():
        return _front(parse_file(path), overrides, strict, known_names, raise_errors, bound_names)


__all__ = [
    "Frontend",
    "ParseError",
    "Program",
    "build",
    "check",
    "compile_file",
    "compile_source",
    "lint",
]
