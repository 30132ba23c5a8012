"""The link step: a checked program's call names bound once, its literal arguments evaluated once.

Between the checker and the resolver. For each call the resolver binds (a rule's model and score,
a schedule, a constraint's predicate, set and region, each value's commit policy) :func:`link`
looks the name up once (:class:`lmpm.bindings.Bindings`: the run's mapping, its ``--bind``
modules, the built-ins) and evaluates each literal argument once with the parameters bound; the
resolver and the runtime read the :class:`Linked` program and never go back to the bindings or to
the evaluator for a literal. ``lmpm check --bind`` runs the same step (``load=False``: built-ins
are not imported, so it stays torch-free; ``lenient``: a literal over an unbound parameter is left
to the run), so a literal that cannot be one is an error of the check, with its location.

>>> from lmpm.bindings import Bindings
>>> from lmpm.ir import compile_source
>>> p = compile_source(
...     "value S : Token[Byte] shape Seq(8)\\n"
...     "visible S[t] <- S[0..t-1] when t > 0\\n"
...     "rule R:\\n  on S[t] when t > 0\\n  read {context = S[0..t-1]}\\n"
...     "  emit proposal S[t] := ByteLM(context, k=2*3)\\n"
... ).ir
>>> linked = link(p, Bindings(), {}, load=False)
>>> linked.args(p.rules[0].proposal)
(Runtime(), 6)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmpm.bindings import Bindings
from lmpm.errors import BindError, Span
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.nodes import (
    Arg,
    ArgKind,
    AxisKind,
    Call,
    Expr,
    Op,
    PredKind,
    Program,
    RuleKind,
    ShapeKind,
)

# The policy of a value with proposals but no `commit` statement (the checker warns, W207).
DEFAULT_POLICY = Call(
    "satisfy",
    (Arg(ArgKind.NAME, None, "max_constraints_then_score"),),
    "policy",
    Span("<default>", 1, 1, 1, 2),
)


@dataclass(frozen=True, slots=True)
class Of:
    """The literal `k of n` (``quorum(2 of 3, satisfy)``): k agreeing replicas out of n run."""

    k: int
    n: int


@dataclass(frozen=True, slots=True)
class Runtime:
    """An argument that is not a literal: a read, a further access of a predicate, `...`, an
    expression of the epoch `e` (evaluated each epoch), or one over a parameter not yet bound."""


RUNTIME = Runtime()


@dataclass(frozen=True)
class Linked:
    """A program with its call names bound and its literal arguments evaluated."""

    program: Program
    env: Mapping[str, int]  # the parameters
    objects: Mapping[str, Any] = field(default_factory=dict)  # call name -> the bound object
    _args: Mapping[Call, tuple[Any, ...]] = field(default_factory=dict)

    def bound(self, call: Call) -> Any:
        """The object ``call``'s name is bound to."""
        return self.objects[call.func]

    def args(self, call: Call) -> tuple[Any, ...]:
        """Each argument's value (:data:`RUNTIME` where it is not a literal)."""
        return self._args[call]

    def kwargs(self, call: Call) -> dict[str, Any]:
        """The literal arguments by keyword (a positional one as ``argN``)."""
        return {
            a.key or f"arg{i}": v
            for i, (a, v) in enumerate(zip(call.args, self._args[call]))
            if v is not RUNTIME
        }


def link(
    program: Program,
    bindings: Bindings,
    env: Mapping[str, int],
    *,
    load: bool = True,
    lenient: bool = False,
) -> Linked:
    """Bind every call name the resolver binds and evaluate every literal argument, once.

    Raises BindError (an unbound name, a bound model that is not callable, an argument that cannot
    be a literal). ``load=False`` binds only the names the run's own modules and mapping bind (a
    built-in is not imported); ``lenient`` leaves a literal over an unbound parameter to the run."""
    lk = _Linker(bindings, load, lenient)
    policies = {cm.access.value: cm.policy for cm in program.commits}
    for v in program.values:
        if v.shape != ShapeKind.SET:
            lk.literals(policies.get(v.name, DEFAULT_POLICY), env)
    for r in program.rules:
        if r.kind == RuleKind.SCHEDULE:
            lk.bind(r.proposal, "schedule")
            lk.literals(r.proposal, {**env, "e": 0})
        elif r.kind != RuleKind.MINIMIZE:
            lk.bind(r.proposal, "model")
            lk.literals(r.proposal, env, skip=(ArgKind.READ,), epoch=True)
            if r.score is not None:
                lk.bind(r.score, "score")
    for c in program.constraints:
        for ax in c.access.axes if c.access is not None else ():
            if ax.kind == AxisKind.REGION and ax.call is not None and ax.call.func != "inputs":
                lk.bind(ax.call, "region")
                lk.literals(ax.call, env)
        if c.pred == PredKind.IN_SET and c.set is not None:
            if c.set.func != "Set":
                lk.bind(c.set, "set")
            lk.literals(c.set, env)
        elif c.pred == PredKind.USER and c.call is not None and c.call.role == "predicate":
            lk.bind(c.call, "predicate")
            lk.literals(c.call, env, skip=(ArgKind.ACCESS,))
    return Linked(program, env, lk.objects, lk.args)


class _Linker:
    def __init__(self, bindings: Bindings, load: bool, lenient: bool) -> None:
        self.bindings = bindings
        self.load = load
        self.lenient = lenient
        self.objects: dict[str, Any] = {}
        self.args: dict[Call, tuple[Any, ...]] = {}

    def bind(self, call: Call, role: str) -> None:
        name = call.func
        if name in self.objects:
            return
        if not self.load and name not in self.bindings.user_names():
            # a built-in is imported by the run (the checker holds it to its signature); a name
            # nothing binds is the checker's W210, or E207 with --strict
            return
        obj = self.bindings.get(name, role)
        if role in ("model", "score", "predicate") and not callable(obj):
            # (under `lmpm check --bind` too: a run must not fail on a binding check accepted)
            raise BindError(
                f"{role} `{name}` is bound to a {type(obj).__name__}, which is not callable",
                span=call.span,
                code="B052",
            )
        self.objects[name] = obj

    def literals(
        self,
        call: Call,
        env: Mapping[str, int],
        *,
        skip: tuple[ArgKind, ...] = (),
        epoch: bool = False,
    ) -> None:
        if call in self.args:
            return
        out: list[Any] = []
        for a in call.args:
            if a.kind in skip or (epoch and a.kind == ArgKind.EXPR and _uses_epoch(a.expr)):
                out.append(RUNTIME)
                continue
            try:
                out.append(literal(a, env, call.span))
            except EvalError:
                if not self.lenient:
                    raise
                out.append(RUNTIME)  # over a parameter the check leaves unbound
        self.args[call] = tuple(out)


def literal(a: Arg, env: Mapping[str, int], span: Span | None = None) -> Any:
    """The value of a literal argument (a call argument is its name and its arguments' values)."""
    match a.kind:
        case ArgKind.INT | ArgKind.FLOAT | ArgKind.STR | ArgKind.NAME:
            return a.value
        case ArgKind.EXPR:
            assert a.expr is not None
            return evaluate(a.expr, env)
        case ArgKind.CALL:
            assert a.call is not None
            return (a.call.func, tuple(literal(x, env, span) for x in a.call.args))
        case ArgKind.OF:  # `k of n` (quorum)
            k, n = (int(literal(x, env, span)) for x in a.parts)
            return Of(k, n)
    raise BindError(f"argument of kind {a.kind.value} cannot be a literal", span=span, code="B050")


def _uses_epoch(e: Expr | None) -> bool:
    stack = [e] if e is not None else []
    while stack:
        x = stack.pop()
        if x.op == Op.VAR and x.value == "e":
            return True
        stack.extend(x.args)
    return False
