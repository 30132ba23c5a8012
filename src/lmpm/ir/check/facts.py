"""What every check pass reads: the program with its parameters bound, each value's dims, indices
over the program, and where things are in the source. One :class:`Facts` per check."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field

from lmpm.errors import DiagnosticSink, Span
from lmpm.ir.eval import EvalError, bind_params, evaluate, names_in
from lmpm.ir.nodes import ArgKind, Axis, Call, Expr, Op, Program, Stencil, Value
from lmpm.ir.probe import Compiled, compiled, shape_of
from lmpm.lang import ast

PROBE_DIM = 64  # size given to an unbound dimension while probing; divisible by 2..64 powers
# Call roles of a training program, bound by the training runtime rather than by name lookup.
TRAIN_ROLES = ("minimize", "loss", "norm")


def probe_env(program: Program, overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    env = bind_params(program, overrides)
    for p in program.params:
        env.setdefault(p.name, PROBE_DIM)
    return env


@dataclass
class Facts:
    """The program being checked and what the passes share (filled by the shapes pass)."""

    p: Program
    sink: DiagnosticSink
    overrides: dict[str, int]
    known: set[str] | None  # the names a run binds (None: not known, W210 instead of E207)
    strict: bool
    # names the run's own bindings provide: they override a built-in of the same name, whose
    # signature then says nothing
    user_bound: set[str]
    tree: ast.Program | None = None  # the AST: locates faults on the exact sub-expression
    env: dict[str, int] = field(default_factory=dict)  # parameters, bound or probe-sized
    dims: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each value's dims
    # Indices so every check is linear in the program's size.
    values: dict[str, Value] = field(default_factory=dict)
    into: dict[tuple[str, str], list[Stencil]] = field(default_factory=dict)  # (target, source)
    by_target: dict[str, list[Stencil]] = field(default_factory=dict)
    proposed: set[str] = field(default_factory=set)  # values some rule proposes
    ast_dims: dict[str, tuple[ast.Expr, ...]] = field(default_factory=dict)
    ast_guards: dict[str, Span] = field(default_factory=dict)  # rule -> its `when` guard
    _stencils: dict[int, Compiled | None] = field(default_factory=dict)
    _ast_calls: dict[Span, ast.Call] | None = None  # made when a diagnostic needs it
    _given: set[str] | None = None  # parameters with a value (bound)

    def __post_init__(self) -> None:
        self.values = {v.name: v for v in self.p.values}
        for s in self.p.stencils:
            self.into.setdefault((s.target, s.source), []).append(s)
            self.by_target.setdefault(s.target, []).append(s)
        self.proposed = {r.target for r in self.p.rules}
        if self.tree is not None:
            _index_ast(self.tree, self.ast_dims, self.ast_guards)

    def shape(
        self,
        vars_: tuple[str, ...],
        axes: tuple[Axis, ...],
        binders: tuple,  # type: ignore[type-arg]
        guard: Expr | None,
        source: str,
    ) -> Compiled:  # type: ignore[type-arg]
        return compiled(shape_of(vars_, axes, binders, guard, self.env, self.dims[source]))

    def stencil(self, s: Stencil) -> Compiled | None:
        """The clause compiled for probing (None where a value's dims are unknown)."""
        key = id(s)
        if key not in self._stencils:
            ok = s.source in self.dims and s.target in self.dims
            self._stencils[key] = (
                self.shape(s.vars, s.axes, s.binders, s.guard, s.source) if ok else None
            )
        return self._stencils[key]

    def target_env(self, vars_: tuple[str, ...], cell: tuple[int, ...]) -> dict[str, int]:
        env = dict(self.env)
        env.update(zip(vars_, cell))
        return env

    def vocab_of(self, value: str) -> int:
        v = self.values[value]
        try:
            return evaluate(v.vocab, self.env) if v.vocab is not None else 256
        except EvalError:
            return 256

    def bound(self, e: Expr) -> bool:
        """Whether ``e`` uses only parameters with a value (a default or --set), not probe sizes."""
        if self._given is None:
            self._given = {p.name for p in self.p.params if p.default is not None} | set(
                self.overrides
            )
        return all(n in self._given for op, n in names_in(e) if op == Op.PARAM)

    def is_user_bound(self, name: str, builtins: Mapping[str, object]) -> bool:
        """A name some --bind module / bindings= mapping binds (it overrides a built-in)."""
        if name in self.user_bound:
            return True
        if self.known is None:
            return False
        return name in self.known and name not in builtins

    @property
    def ast_calls(self) -> dict[Span, ast.Call]:
        """Each call of the source by its span (walked once, when a diagnostic points into one)."""
        if self._ast_calls is None:
            self._ast_calls = {} if self.tree is None else _ast_calls(self.tree)
        return self._ast_calls

    def arg_span(self, call: Call, i: int, *, value: bool = False) -> Span:
        """The i-th argument (``k=0``), or with ``value`` only its value (``0``)."""
        node = self.ast_calls.get(call.span)
        if node is not None and i < len(node.args):
            return node.args[i].value.span if value else node.args[i].span
        return call.span


def set_members(c: Call, env: Mapping[str, int]) -> set[int]:
    """The tokens of a `Set(...)` literal: integers, `lo..hi` ranges, strings (their UTF-8 bytes)."""
    out: set[int] = set()
    lo: int | None = None
    for a in c.args:
        if a.kind == ArgKind.INT:
            out.add(int(a.value))  # type: ignore[arg-type]
        elif a.kind == ArgKind.STR:
            out.update(str(a.value).encode("utf-8"))
        elif a.kind == ArgKind.EXPR and a.expr is not None:
            n = evaluate(a.expr, env)
            if a.key == "lo":
                lo = n
            elif a.key == "hi" and lo is not None:
                out.update(range(lo, n + 1))
                lo = None
            else:
                out.add(n)
    return out


def name_span(call: Call) -> Span:
    """The span of the call's name (``average`` in ``average()``)."""
    sp = call.span
    return Span(sp.file, sp.line, sp.col, sp.line, sp.col + len(call.func))


def suggest(name: str, candidates: list[str]) -> str | None:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


def vars_of(e: Expr) -> set[str]:
    return {n for op, n in names_in(e) if op == Op.VAR}


def axes_using(vars_: tuple[str, ...], used: set[str]) -> frozenset[int]:
    return frozenset(k for k, v in enumerate(vars_) if v in used)


def _index_ast(
    tree: ast.Program, dims: dict[str, tuple[ast.Expr, ...]], guards: dict[str, Span]
) -> None:
    """Where each value's dims and each rule's guard are in the source."""
    for item in tree.items:
        if isinstance(item, ast.Value):
            dims[item.name] = item.shape.dims
        elif isinstance(item, ast.Rule):
            for st in item.body:
                if isinstance(st, ast.On) and st.guard is not None:
                    guards[item.name] = st.guard.span


def _ast_calls(tree: ast.Program) -> dict[Span, ast.Call]:
    """Every call in the source by its span."""
    calls: dict[Span, ast.Call] = {}
    for item in tree.items:
        stack: list[object] = [item]
        while stack:
            x = stack.pop()
            if isinstance(x, ast.Call):
                calls.setdefault(x.span, x)
                stack.extend(a.value for a in x.args)
            elif isinstance(x, ast.Arg):
                stack.append(x.value)
            elif hasattr(x, "__slots__") and not isinstance(x, Span):
                for name in x.__slots__:
                    child = getattr(x, name)
                    if isinstance(child, tuple):
                        stack.extend(child)
                    elif child is not None and not isinstance(child, str | int | float | Span):
                        stack.append(child)
    return calls
