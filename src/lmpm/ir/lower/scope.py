"""The one object every lowering reads: the program's declarations and the names local to a statement.

A :class:`Scope` is cheap: :meth:`Scope.inner` makes the scope of a sub-expression (its index,
binder and pattern variables) over the same :class:`Declared` names, which the declarations fill
first (``lmpm.ir.build``) and the statements then only read (and extend with implicit parameters).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from lmpm.errors import DiagnosticSink, Span
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.nodes import (
    Commit,
    Constraint,
    DType,
    Expr,
    Param,
    PredKind,
    Rule,
    ShapeKind,
    Stencil,
    Value,
    Workflow,
)
from lmpm.lang import ast
from lmpm.lang.format import fmt_expr

VOCABS = {"Byte": 256}  # built-in vocabularies
EPOCH_VAR = "e"  # the epoch number, usable in every rule's call arguments
PREV_READ = "prev_frame"  # the target's own value one step back on the first axis
MINIMIZE = "minimize"  # the proposal of a Params value (lmpm.ir.lower.train)
AXIS_NAMES = {
    ShapeKind.SEQ: ("t",),
    ShapeKind.GRID2D: ("x", "y"),
    ShapeKind.GRID3D: ("t", "x", "y"),
    ShapeKind.SET: (),
}
TYPES = {
    "Token": DType.TOKEN,
    "Event": DType.EVENT,
    "Rule": DType.RULE,
    "Float": DType.FLOAT,
    "Tensor": DType.TENSOR,
    "Params": DType.PARAMS,
}
BUILTIN_PREDICATES = {"change": PredKind.CHANGE, "read_future": PredKind.READ_FUTURE}


class Skip(Exception):
    """Abandon the current statement after a diagnostic was recorded."""


@dataclass(slots=True)
class Declared:
    """The program's top-level names: one per build, shared by every scope of it."""

    sink: DiagnosticSink
    params: dict[str, Param] = field(default_factory=dict)
    values: dict[str, Value] = field(default_factory=dict)
    names: dict[str, tuple[str, Span]] = field(default_factory=dict)  # name -> (kind, span)
    defaults: dict[str, int] | None = None  # the parameters' default values, made on first use


@dataclass(slots=True)
class Lowered:
    """The statements lowered so far, by kind, in program order."""

    stencils: list[Stencil] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    workflows: list[Workflow] = field(default_factory=list)


@dataclass(slots=True)
class Scope:
    """Names an expression may use, and what each one means."""

    decl: Declared
    vars: set[str] = field(default_factory=set)  # index / binder / pattern variables
    allow_epoch: bool = False
    free_params: bool = False  # unknown names become implicit (region) parameters

    def inner(
        self,
        vars: set[str] | None = None,
        allow_epoch: bool = False,
        free_params: bool = False,
    ) -> Scope:
        """A fresh scope over the same declarations (a statement's own variables)."""
        return Scope(self.decl, vars if vars is not None else set(), allow_epoch, free_params)

    @property
    def sink(self) -> DiagnosticSink:
        return self.decl.sink

    @property
    def params(self) -> dict[str, Param]:
        return self.decl.params

    @property
    def values(self) -> dict[str, Value]:
        return self.decl.values

    @property
    def names(self) -> dict[str, tuple[str, Span]]:
        return self.decl.names

    def fail(self, code: str, msg: str, span: Span, hint: str | None = None) -> Skip:
        """Record an error; the caller raises the returned Skip to abandon the statement."""
        self.sink.error(code, msg, span, hint)
        return Skip()

    def claim(self, name: str, kind: str, span: Span) -> None:
        if name in self.names:
            prev_kind, prev = self.names[name]
            raise self.fail(
                "E102",
                f"`{name}` is already declared as a {prev_kind} at line {prev.line}",
                span,
                "pick another name",
            )
        self.names[name] = (kind, span)

    def declared_param(self, name: str) -> bool:
        # An implicit parameter (a free name elsewhere) does not stop a statement from using the
        # same name as its own index variable: variables are looked up before parameters.
        return name in self.params and self.params[name].declared

    def implicit_param(self, name: str, span: Span) -> Expr:
        if name not in self.params:
            self.params[name] = Param(name, None, False, span)
        return Expr.param(name)

    def param_ref(self, name: str, span: Span) -> Expr:
        if name in self.params:
            return Expr.param(name)
        if name in self.names:
            kind, _ = self.names[name]
            raise self.fail("E108", f"`{name}` is a {kind}, not a number", span)
        return self.implicit_param(name, span)

    def lookup_value(self, name: str, span: Span) -> Value:
        if name in self.values:
            return self.values[name]
        if name in self.names:
            kind, _ = self.names[name]
            if kind == "value":
                raise Skip()  # its declaration failed, and said so
            raise self.fail("E101", f"`{name}` is a {kind}, not a value", span)
        raise self.fail(
            "E101",
            f"unknown value `{name}`",
            span,
            suggest(name, list(self.values)) or "declare it with `value NAME : TYPE shape SHAPE`",
        )

    def param_defaults(self) -> dict[str, int]:
        # Declarations are complete before any constraint is built, so compute this once.
        if self.decl.defaults is not None:
            return self.decl.defaults
        env: dict[str, int] = {}
        for p in self.params.values():
            if p.default is not None:
                try:
                    env[p.name] = evaluate(p.default, env)
                except EvalError:
                    pass
        self.decl.defaults = env
        return env


def src(a: ast.Expr) -> str:
    """The source text of ``a`` (as the formatter writes it)."""
    try:
        return fmt_expr(a)
    except RecursionError:
        return "..."


_DESCRIPTIONS = {
    ast.Int: "an integer",
    ast.Float: "a decimal number",
    ast.Str: "a string",
    ast.Name: "a name",
    ast.Star: "`*`",
    ast.Dots: "`...`",
    ast.Call: "a call",
    ast.Subscript: "an access",
    ast.Optional: "`X?`",
    ast.Tuple: "a tuple",
    ast.Range: "a range",
    ast.BinOp: "arithmetic",
    ast.Neg: "a negation",
    ast.Cmp: "a comparison",
    ast.In: "an `in` test",
    ast.And: "`and`",
    ast.Or: "`or`",
    ast.Not: "`not`",
    ast.Of: "`k of n`",
}


def describe(e: ast.Expr) -> str:
    """What kind of expression ``e`` is, in words (for messages)."""
    return _DESCRIPTIONS.get(type(e), type(e).__name__)


def suggest(name: str, candidates: list[str]) -> str | None:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"did you mean `{close[0]}`?" if close else None
