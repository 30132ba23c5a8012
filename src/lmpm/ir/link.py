"""The link step: a checked program's call names bound once, its literal arguments evaluated once.

Between the checker and the resolver. For each call the resolver binds (a rule's model and score,
a schedule, a constraint's predicate, set and region, each value's commit policy) :func:`link`
looks the name up once (:class:`lmpm.bindings.Bindings`: the run's mapping, its ``--bind``
modules, the built-ins) and evaluates each literal argument once with the parameters bound; the
resolver and the runtime read the :class:`Linked` program and never go back to the bindings or to
the evaluator for a literal. A name the run's own modules bind is held to how the runtime calls
it (:data:`CALLED_AS`): a Python signature that cannot take the call is B053, at the call (a
built-in is held to its declared signature by the checker, E213). ``lmpm check --bind`` runs the
same step (``load=False``: built-ins are not imported, so it stays torch-free; ``lenient``: a
literal over an unbound parameter is left to the run), so a literal that cannot be one, or a
model that cannot take its call, is an error of the check, with its location.

The VM links a workflow's model and tools with :func:`link_workflow`, the trainer a training
program's module and losses with :func:`link_training`.

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

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
    Rule,
    RuleKind,
    ShapeKind,
    Workflow,
)
from lmpm.train.spec import TrainSpec

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

    Raises BindError (an unbound name, a bound model that is not callable or whose Python
    signature does not take what the run passes, an argument that cannot be a literal).
    ``load=False`` binds only the names the run's own modules and mapping bind (a built-in is not
    imported); ``lenient`` leaves a literal over an unbound parameter to the run."""
    lk = _Linker(bindings, load, lenient)
    policies = {cm.access.value: cm.policy for cm in program.commits}
    for v in program.values:
        if v.shape != ShapeKind.SET:
            lk.literals(policies.get(v.name, DEFAULT_POLICY), env)
    streams = {w.value for w in program.workflows}  # a workflow's model runs in the VM
    for r in program.rules:
        if r.kind == RuleKind.SCHEDULE:
            lk.bind(r.proposal, "schedule", _keywords(r.proposal))
            lk.literals(r.proposal, {**env, "e": 0})
        elif r.kind != RuleKind.MINIMIZE:
            lk.model(r, env, vm=r.target in streams)
    for c in program.constraints:
        for ax in c.access.axes if c.access is not None else ():
            if ax.kind == AxisKind.REGION and ax.call is not None and ax.call.func != "inputs":
                lk.bind(ax.call, "region", _positional(ax.call, "shape"))
                lk.literals(ax.call, env)
        if c.pred == PredKind.IN_SET and c.set is not None:
            if c.set.func != "Set":
                lk.bind(c.set, "set", _positional(c.set))
            lk.literals(c.set, env)
        elif c.pred == PredKind.USER and c.call is not None and c.call.role == "predicate":
            lk.bind(c.call, "predicate", Calling(("ctx",), ()))
            lk.literals(c.call, env, skip=(ArgKind.ACCESS,))
    return Linked(program, env, lk.objects, lk.args)


def link_workflow(
    program: Program, workflow: Workflow, bindings: Bindings, *, load: bool = True
) -> Linked:
    """What the VM runs ``workflow`` with: the model of the rule that proposes its value (its
    integer and string keywords) and the tool of each zone, bound once."""
    lk = _Linker(bindings, load, lenient=True)
    for r in program.rules:
        if r.target == workflow.value:
            lk.bind(r.proposal, "model", _vm_calling(r), "workflow model")
            lk.literals(r.proposal, {}, skip=tuple(k for k in ArgKind if k not in _VM_LITERALS))
    lk.tools(workflow)
    return Linked(program, {}, lk.objects, lk.args)


@dataclass(frozen=True, slots=True)
class LinkedTraining:
    """What a training program's names are bound to (:mod:`lmpm.train.modules`)."""

    module: Callable[[], Any]  # builds the module the Params value holds (an nn.Module)
    loss: Callable[..., Any]  # loss(module, *data) -> (mean loss, tokens): what minimize lowers
    eval_loss: Callable[..., Any] | None  # the `score` loss (held-out data), if the rule has one


def link_training(spec: TrainSpec) -> LinkedTraining:
    """Bind a training program's module and losses: B080 (a module) or B081 (a loss) for a name
    nothing binds."""
    # (torch: imported when a training program is linked, never by the front end)
    from lmpm.train.modules import LOSSES, MODULES

    def loss(name: str) -> Callable[..., Any]:
        if name not in LOSSES:
            raise BindError(
                f"no loss is bound as `{name}`",
                code="B081",
                hint=f"the losses are {', '.join(sorted(LOSSES))}",
            )
        return LOSSES[name]

    name = spec.params.module
    if name not in MODULES:
        raise BindError(
            f"no module is bound as `{name}` for a Params value",
            code="B080",
            hint=f"the modules are {', '.join(sorted(MODULES))}",
        )
    rule = spec.rule
    return LinkedTraining(
        MODULES[name], loss(rule.loss), loss(rule.eval_loss) if rule.eval_loss else None
    )


class Calling(NamedTuple):
    """How the runtime calls a bound object: the positional arguments (their names, as the
    message shows them) and the keywords."""

    positional: tuple[str, ...]
    keywords: tuple[str, ...]


# The keywords the runtime adds to a model's call (lmpm.runtime.data.dataplane, DataPlane._kwargs), and
# the VM's (lmpm.vm.runner, WorkflowRun.logits): a call's own keywords come first.
MODEL_KEYWORDS = ("vocab", "seed", "epoch")
VM_MODEL_KEYWORDS = ("vocab",)
# How the runtime calls each role, in the hint of B053.
CALLED_AS = {
    "model": "model(inputs, **keywords): the call's keywords (a positional literal as argN), then "
    "vocab, seed and epoch; take **kwargs for the ones it does not use",
    "workflow model": "model(inputs, vocab=V, **keywords): the call's integer and string keywords; "
    "take **kwargs for the ones it does not use",
    "score": "score(inputs, epoch=e)",
    "predicate": "predicate(ctx): one PredicateInput (lmpm.runtime.data.constraints)",
    "region": "region(*positional literals, shape=(...), **keywords)",
    "set": "set(*positional literals, **keywords)",
    "schedule": "schedule(**keywords) (a positional literal as argN)",
    "tool": "tool(args): one argument list per waiting stream",
}
# The kinds of argument the VM passes to a workflow's model (WorkflowRun.kwargs).
_VM_LITERALS = (ArgKind.INT, ArgKind.STR)


class _Linker:
    """One link: the objects bound so far (by name) and each call's literal arguments."""

    def __init__(self, bindings: Bindings, load: bool, lenient: bool) -> None:
        self.bindings = bindings
        self.user = bindings.user_names()
        self.load = load
        self.lenient = lenient
        self.objects: dict[str, Any] = {}
        self.args: dict[Call, tuple[Any, ...]] = {}

    def model(self, r: Rule, env: Mapping[str, int], *, vm: bool) -> None:
        """A rule's model and score, as the data plane and the workers call them (``vm``: the
        model of a workflow's value, as the VM calls it)."""
        if vm:
            self.bind(r.proposal, "model", _vm_calling(r), "workflow model")
        else:
            args = r.proposal.args
            keys = [a.key or f"arg{i}" for i, a in enumerate(args) if a.kind != ArgKind.READ]
            self.bind(r.proposal, "model", Calling(("inputs",), _merged(keys, MODEL_KEYWORDS)))
        self.literals(r.proposal, env, skip=(ArgKind.READ,), epoch=True)
        if r.score is not None:
            self.bind(r.score, "score", Calling(("inputs",), ("epoch",)))

    def tools(self, w: Workflow) -> None:
        """The tool each zone of ``w`` calls, as the VM calls it."""
        for z in w.zones:
            if z.tool is not None:
                self.bind(z.tool, "tool", Calling(("args",), ()))

    def bind(self, call: Call, role: str, calling: Calling, convention: str = "") -> None:
        """Bind ``call``'s name (once) and hold a user's object to how the runtime calls it."""
        name = call.func
        if name not in self.objects:
            if not self.load and name not in self.user:
                # a built-in is imported by the run (the checker holds it to its signature); a
                # name nothing binds is the checker's W210, or E207 with --strict
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
        if name in self.user:
            _check_signature(call, role, self.objects[name], calling, convention or role)

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


def _merged(keys: list[str], added: tuple[str, ...]) -> tuple[str, ...]:
    """A call's own keywords, then the ones the runtime adds unless the call gives them."""
    return tuple(keys) + tuple(k for k in added if k not in keys)


def _vm_calling(r: Rule) -> Calling:
    """How the VM calls the model of a workflow's value (WorkflowRun.logits)."""
    keys = [str(a.key) for a in r.proposal.args if a.key is not None and a.kind in _VM_LITERALS]
    return Calling(("inputs",), _merged(keys, VM_MODEL_KEYWORDS))


def _keywords(call: Call) -> Calling:
    """Every argument by keyword (a positional one as ``argN``): a schedule's call."""
    return Calling((), tuple(a.key or f"arg{i}" for i, a in enumerate(call.args)))


def _positional(call: Call, *added: str) -> Calling:
    """Positional literals positionally, keyword ones by keyword, then ``added``: a region's or a
    set's call."""
    keys = [a.key for a in call.args if a.key is not None]
    pos = tuple(f"arg{i}" for i, a in enumerate(call.args) if a.key is None)
    return Calling(pos, _merged(keys, added))


def _check_signature(call: Call, role: str, obj: Any, calling: Calling, convention: str) -> None:
    """B053 when ``obj``'s Python signature does not take ``calling`` (an object without a
    signature Python can read, a builtin or some extension types, is taken as it is)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*calling.positional, **dict.fromkeys(calling.keywords))
    except TypeError as e:
        shown = ", ".join([*calling.positional, *(f"{k}=..." for k in calling.keywords)])
        raise BindError(
            f"{role} `{call.func}` is bound to {_described(obj, sig)}, which cannot take the "
            f"run's call `{call.func}({shown})`: {e}",
            span=call.span,
            code="B053",
            hint=f"the run calls a {convention} as {CALLED_AS[convention]}",
        ) from None


def _described(obj: Any, sig: inspect.Signature) -> str:
    """``obj``'s name and signature and, for Python code, where it is defined (``file:line``)."""
    name = getattr(obj, "__qualname__", None) or type(obj).__name__
    code = getattr(obj, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"`{name}{sig}`{where}"


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
