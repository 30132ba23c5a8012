"""Lowering of the core language: values, `visible` clauses, rules, constraints and commits.

Training values (``Params``) and workflows lower in :mod:`lmpm.ir.lower.train` and
:mod:`lmpm.ir.lower.workflow`; :mod:`lmpm.ir.build` picks the lowering of each statement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lmpm.errors import Span
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.lower.exprs import (
    lower_access,
    lower_bound_call,
    lower_expr,
    lower_set_literal,
    lower_target,
    params_of,
    pattern_vars,
    split_guard,
)
from lmpm.ir.lower.scope import (
    AXIS_NAMES,
    BUILTIN_PREDICATES,
    MINIMIZE,
    PREV_READ,
    TYPES,
    VOCABS,
    Scope,
    Skip,
    describe,
    suggest,
)
from lmpm.ir.nodes import (
    NEIGHBORHOODS,
    PARAMS_SHAPES,
    RANK,
    TRUE,
    Access,
    Axis,
    AxisKind,
    Binder,
    Call,
    Commit,
    Constraint,
    DType,
    Expr,
    Op,
    PredKind,
    Read,
    ReadKind,
    Rule,
    RuleKind,
    ShapeKind,
    Status,
    Stencil,
    Value,
)
from lmpm.lang import ast


# ---- values ------------------------------------------------------------------------------------
def lower_value(v: ast.Value, scope: Scope) -> Value:
    """`value V : Type shape Shape(dims) clock Lamport` (a Params value: lmpm.ir.lower.train)."""
    t = v.type
    if t.name not in TYPES:
        raise scope.fail(
            "E105",
            f"unknown type `{t.name}`",
            t.span,
            "types are Token[V], Event, Rule, Float, Tensor[D], Params[Module]",
        )
    dtype = TYPES[t.name]
    if v.shape.kind in {k.value for k in PARAMS_SHAPES}:
        raise scope.fail(
            "E150",
            f"`{v.shape.kind}()` is the shape of a Params value; `{v.name}` holds {dtype.value}s",
            v.shape.span,
            "write `value P : Params[Module] shape Tensors()` (or `Blocks()`)",
        )
    vocab, vocab_name = _vocab(t, dtype, scope)
    kind = _shape_kind(v.shape, scope)
    dims = tuple(lower_expr(d, scope.inner(free_params=True)) for d in v.shape.dims)
    if v.clock is not None and v.clock != "Lamport":
        raise scope.fail("E105", f"unknown clock `{v.clock}`", v.span, "the clock is `Lamport`")
    if kind == ShapeKind.SET and dtype not in (DType.EVENT, DType.RULE):
        scope.sink.warning(
            "W105",
            f"Set value `{v.name}` holds {dtype.value}s; Set values are "
            "CRDT logs of events or rules",
            v.shape.span,
        )
    return Value(v.name, dtype, vocab, vocab_name, kind, dims, AXIS_NAMES[kind], "Lamport", v.span)


def _vocab(t: ast.TypeRef, dtype: DType, scope: Scope) -> tuple[Expr | None, str | None]:
    """The vocabulary of `Token[V]` / `Tensor[D]` (its expression and the name it was given)."""
    if dtype not in (DType.TOKEN, DType.TENSOR):
        if t.args:
            raise scope.fail("E105", f"`{t.name}` takes no arguments", t.span)
        return None, None
    if len(t.args) != 1:
        raise scope.fail(
            "E105",
            f"`{t.name}` takes one argument, got {len(t.args)}",
            t.span,
            f"write {t.name}[Byte], {t.name}[VQ] or {t.name}[16]",
        )
    a = t.args[0]
    if isinstance(a, ast.Name) and a.id in VOCABS and a.id not in scope.params:
        return Expr.const(VOCABS[a.id]), a.id
    if isinstance(a, ast.Name):
        return scope.param_ref(a.id, a.span), a.id
    return lower_expr(a, scope.inner()), None


def _shape_kind(shape: ast.ShapeRef, scope: Scope) -> ShapeKind:
    kinds = {k.value: k for k in ShapeKind}
    if shape.kind not in kinds:
        raise scope.fail(
            "E106",
            f"unknown shape `{shape.kind}`",
            shape.span,
            "shapes are Seq(N), Grid2D(W,H), Grid3D(T,W,H), Set(); Params values: "
            "Tensors(), Blocks()",
        )
    kind = kinds[shape.kind]
    if len(shape.dims) != RANK[kind]:
        raise scope.fail(
            "E106",
            f"{kind.value} takes {RANK[kind]} dimension(s), got {len(shape.dims)}",
            shape.span,
        )
    return kind


# ---- visibility --------------------------------------------------------------------------------
def lower_visible(item: ast.Visible, scope: Scope) -> Stencil:
    for side in (item.target, item.source):
        if (p := params_of(side, scope)) is not None:
            raise scope.fail(
                "E152",
                f"`{p.name}` is a Params value; Params values take no `visible` clauses",
                side.span,
                "a Params value is read only by its loss: `minimize(Loss("
                + p.name
                + ", data), ...)`",
            )
    target, vars_ = lower_target(item.target, scope, what="the target of `visible`")
    if target.shape == ShapeKind.SET:
        raise scope.fail(
            "E104",
            f"`{target.name}` is a Set value; visibility is between cells",
            item.target.span,
        )
    scope = scope.inner(vars=set(vars_))
    binders, guard = split_guard(item.guard, scope)
    access = lower_access(item.source, scope, what="the source of `visible`")
    return Stencil(target.name, vars_, access.value, access.axes, binders, guard, item.span)


# ---- rules -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RuleParts:
    """A rule's statements (each at most once) and the value its `on` pattern names."""

    on: ast.On
    read: ast.Read | None
    emit: ast.Emit
    score: ast.Score | None
    target: Value
    vars: tuple[str, ...]  # the `on` pattern's index variables


def rule_parts(item: ast.Rule, scope: Scope) -> RuleParts:
    """The parts every rule has, whichever language lowers it (a Params target: a minimize rule)."""
    ons = [s for s in item.body if isinstance(s, ast.On)]
    reads = [s for s in item.body if isinstance(s, ast.Read)]
    emits = [s for s in item.body if isinstance(s, ast.Emit)]
    scores = [s for s in item.body if isinstance(s, ast.Score)]
    for kind, stmts in (("on", ons), ("read", reads), ("emit", emits), ("score", scores)):
        if len(stmts) > 1:
            raise scope.fail(
                "E111", f"rule `{item.name}` has more than one `{kind}`", stmts[1].span
            )
    if not ons:
        raise scope.fail(
            "E111",
            f"rule `{item.name}` has no `on` pattern",
            item.name_span,
            "add `on Value[vars]` naming the cells it proposes for",
        )
    if not emits:
        raise scope.fail(
            "E111",
            f"rule `{item.name}` emits nothing",
            item.name_span,
            "add `emit proposal Value[vars] := Model(...)`",
        )
    target, vars_ = lower_target(ons[0].pattern, scope, what="the `on` pattern")
    return RuleParts(
        ons[0], reads[0] if reads else None, emits[0], scores[0] if scores else None, target, vars_
    )


def lower_rule(item: ast.Rule, parts: RuleParts, scope: Scope) -> Rule:
    """A rule over cells (a local rule) or over a Set value (a schedule)."""
    target, vars_ = parts.target, parts.vars
    emit_call = parts.emit.call
    if isinstance(emit_call, ast.Call) and emit_call.func == MINIMIZE:
        raise scope.fail(
            "E154",
            f"`minimize` proposes parameters, but `{target.name}` holds "
            f"{target.dtype.value}s: discrete cells are not differentiable",
            emit_call.span,
            "minimize a loss over a Params value: `value P : Params[Module] shape "
            "Tensors()`, then `on P[*]` ... `emit proposal P[*] := minimize(Loss(P, data), ...)`",
        )
    scope = scope.inner(vars=set(vars_), allow_epoch=True)
    on = parts.on
    trigger = lower_expr(on.guard, scope) if on.guard is not None else TRUE
    kind = RuleKind.SCHEDULE if target.shape == ShapeKind.SET else RuleKind.LOCAL
    rule_reads = lower_reads(parts.read, target, vars_, scope) if parts.read else ()
    if kind == RuleKind.SCHEDULE and rule_reads:
        assert parts.read is not None
        raise scope.fail(
            "E111", "a schedule rule reads nothing; it proposes the open set", parts.read.span
        )
    etarget, evars = lower_target(parts.emit.target, scope, what="the emitted cell")
    if etarget.name != target.name or evars != vars_:
        want = f"{target.name}[{', '.join(vars_)}]" if vars_ else target.name
        raise scope.fail(
            "E111",
            "a rule emits proposals for the cells of its `on` pattern",
            parts.emit.target.span,
            f"write `emit proposal {want} := ...`",
        )
    role = "schedule" if kind == RuleKind.SCHEDULE else "model"
    proposal = lower_bound_call(emit_call, role, rule_reads, scope)
    score = lower_bound_call(parts.score.call, "score", rule_reads, scope) if parts.score else None
    return Rule(
        item.name, kind, target.name, vars_, trigger, rule_reads, proposal, score, item.span
    )


def lower_reads(
    stmt: ast.Read, target: Value, vars_: tuple[str, ...], scope: Scope
) -> tuple[Read, ...]:
    out: list[Read] = []
    for item in stmt.items:
        rd = lower_read(item, target, vars_, scope)
        if any(r.name == rd.name for r in out):
            raise scope.fail(
                "E112",
                f"two reads are named `{rd.name}`",
                item.span,
                f"name one explicitly: `other = {rd.source}[...]`",
            )
        out.append(rd)
    return tuple(out)


def lower_read(item: ast.Arg, target: Value, vars_: tuple[str, ...], scope: Scope) -> Read:
    """One read: `name in N8`, `prev_frame`, `Value` (what is visible) or `[name =] Value[...]`."""
    e = item.value
    optional = False
    if isinstance(e, ast.Optional):
        optional, e = True, e.inner
    if item.name is None and isinstance(e, ast.In):
        return _neighbors_read(e, item, optional, target, vars_, scope)
    name = item.name
    if isinstance(e, ast.Name) and e.id == PREV_READ and e.id not in scope.values:
        if not vars_:
            raise scope.fail("E112", "`prev_frame` needs a target with a time axis", e.span)
        axes = (
            Axis(AxisKind.AT, Expr(Op.SUB, (Expr.var(vars_[0]), Expr.const(1)))),
            *(Axis(AxisKind.AT, Expr.var(v)) for v in vars_[1:]),
        )
        return Read(name or PREV_READ, ReadKind.PREV, target.name, axes, (), optional, item.span)
    if isinstance(e, ast.Name):
        v = _visible_source(e, scope)
        return Read(name or v.name.lower(), ReadKind.VISIBLE, v.name, (), (), optional, item.span)
    if (p := params_of(e, scope)) is not None:
        raise _reads_params(p, e.span, scope)
    acc = lower_access(e, scope, what="a read")
    return Read(
        name or acc.value.lower(), ReadKind.INDEX, acc.value, acc.axes, (), optional, item.span
    )


def _neighbors_read(
    e: ast.In,
    item: ast.Arg,
    optional: bool,
    target: Value,
    vars_: tuple[str, ...],
    scope: Scope,
) -> Read:
    """`name in N8`: the target's neighbours, one binder over the neighbourhood's offsets."""
    if not isinstance(e.lhs, ast.Name) or not isinstance(e.rhs, ast.Name):
        raise scope.fail("E112", "a neighbourhood read is written `name in N8`", e.span)
    hood = e.rhs.id
    if hood not in NEIGHBORHOODS:
        raise scope.fail(
            "E109",
            f"unknown neighbourhood `{hood}`",
            e.rhs.span,
            "neighbourhoods: " + ", ".join(NEIGHBORHOODS),
        )
    dim = len(NEIGHBORHOODS[hood][0])
    if dim > len(vars_):
        raise scope.fail(
            "E103",
            f"{hood} spans {dim} axes but `{target.name}` has {len(vars_)}",
            e.rhs.span,
        )
    offs = tuple(f"_d{i}" for i in range(dim))
    lead = len(vars_) - dim
    axes = tuple(
        Axis(AxisKind.AT, Expr.var(v))
        if k < lead
        else Axis(AxisKind.AT, Expr(Op.ADD, (Expr.var(v), Expr.var(offs[k - lead]))))
        for k, v in enumerate(vars_)
    )
    return Read(
        e.lhs.id, ReadKind.NEIGHBORS, target.name, axes, (Binder(offs, hood),), optional, item.span
    )


def _visible_source(e: ast.Name, scope: Scope) -> Value:
    """The value a bare-name read reads (every cell of it the target may see)."""
    if e.id not in scope.values:
        raise scope.fail(
            "E112",
            f"unknown read `{e.id}`",
            e.span,
            "a read is `name in N8`, `prev_frame`, `Value`, `Value[...]` or "
            "`name = Value[...]`" + (f"; {s}" if (s := suggest(e.id, list(scope.values))) else ""),
        )
    v = scope.values[e.id]
    if v.dtype == DType.PARAMS:
        raise _reads_params(v, e.span, scope)
    if v.shape == ShapeKind.SET:
        raise scope.fail("E104", f"`{v.name}` is a Set value; rules read cells", e.span)
    return v


def _reads_params(p: Value, span: Span, scope: Scope) -> Skip:
    return scope.fail(
        "E153",
        f"`{p.name}` is a Params value; rules do not read parameters as cells",
        span,
        f"a loss takes the parameters as its first argument: `Loss({p.name}, data)`",
    )


# ---- constraints -------------------------------------------------------------------------------
def lower_priority(item: ast.Constraint, scope: Scope) -> int:
    """A constraint's priority: an integer known at compile time."""
    pexpr = lower_expr(item.priority, scope.inner())
    try:
        return evaluate(pexpr, scope.param_defaults())
    except EvalError:
        raise scope.fail(
            "E113", "priority must be an integer known at compile time", item.priority.span
        ) from None


def new_constraint(
    item: ast.Constraint,
    pred: PredKind,
    access: Access | None,
    pvars: tuple[str, ...],
    priority: int,
    *,
    set_call: Call | None = None,
    call: Call | None = None,
) -> Constraint:
    """The constraint ``item`` says, its status decided later by the checker."""
    return Constraint(
        item.name,
        item.kind,
        pred,
        access,
        pvars,
        set_call,
        call,
        priority,
        Status.DYNAMIC,
        item.span,
    )


def lower_constraint(item: ast.Constraint, priority: int, scope: Scope) -> Constraint:
    """`forbid|require P priority N` over cells (over a Params value: lmpm.ir.lower.train)."""
    pred = item.pred
    scope = scope.inner(free_params=True)
    if isinstance(pred, ast.Call) and pred.func in BUILTIN_PREDICATES:
        if len(pred.args) != 1 or pred.args[0].name is not None:
            raise scope.fail(
                "E116",
                f"`{pred.func}` takes one value access, e.g. `{pred.func}(Vid[t,x,y])`",
                pred.span,
            )
        pvars = pattern_vars(pred.args[0].value, scope)
        access = lower_access(pred.args[0].value, scope, what=f"the argument of `{pred.func}`")
        return new_constraint(item, BUILTIN_PREDICATES[pred.func], access, pvars, priority)
    if isinstance(pred, ast.In):
        pvars = pattern_vars(pred.lhs, scope)
        access = lower_access(pred.lhs, scope, what="the left side of `in`")
        set_call = _set_of(pred.rhs, scope)
        return new_constraint(item, PredKind.IN_SET, access, pvars, priority, set_call=set_call)
    if isinstance(pred, ast.Call):
        pvars = ()
        for a in pred.args:
            if isinstance(a.value, ast.Subscript):
                new = pattern_vars(a.value, scope)
                pvars += tuple(v for v in dict.fromkeys(new) if v not in pvars)
        call = lower_bound_call(pred, "predicate", (), scope)
        first = next((a.access for a in call.args if a.access is not None), None)
        return new_constraint(item, PredKind.USER, first, pvars, priority, call=call)
    raise scope.fail(
        "E115",
        f"{describe(pred)} is not a predicate",
        pred.span,
        "predicates: change(A), read_future(A), A in Set(...), A in Call(...), "
        "or a bound predicate Call(A, ...); `forbid not P(...)` is `require P(...)`, and "
        "`require P(...) priority N hard` is a bound no commit may break",
    )


def harden(item: ast.Constraint, c: Constraint, scope: Scope) -> Constraint:
    """`... priority N hard`: a constraint checked on candidates that no commit may break."""
    if not item.hard:
        return c
    if c.pred not in (PredKind.IN_SET, PredKind.USER, PredKind.CHANGE) or c.access is None:
        refuse_hard(item, scope)
    return replace(c, hard=True)


def refuse_hard(item: ast.Constraint, scope: Scope) -> None:
    """`hard` on a constraint that is not checked on candidates' cells (E118)."""
    if item.hard:
        raise scope.fail(
            "E118",
            f"`hard` applies to a constraint checked on candidates; `{item.name}` is not one",
            item.span,
            "drop `hard` (a `read_future` is proved at compile time; a training constraint on "
            "parameters is enforced as it is)",
        )


def _set_of(rhs: ast.Expr, scope: Scope) -> Call:
    """The right side of `A in S`: a `Set(...)` literal or a bound call."""
    if isinstance(rhs, ast.Call) and rhs.func == "Set":
        return lower_set_literal(rhs, scope)
    if isinstance(rhs, ast.Call):
        return lower_bound_call(rhs, "set", (), scope.inner())
    raise scope.fail(
        "E115",
        "the right side of `in` must be a set: `Set(...)` or a "
        'bound call like `Palette("blue-ish")`',
        rhs.span,
    )


# ---- commits -----------------------------------------------------------------------------------
def commit_access(item: ast.Commit, scope: Scope) -> Access:
    """What a `commit` line commits: a whole value."""
    access = lower_access(item.target, scope.inner(free_params=True), what="the target of `commit`")
    if any(a.kind != AxisKind.ALL for a in access.axes):
        raise scope.fail(
            "E117",
            f"a commit policy applies to a whole value, not to part of `{access.value}`",
            item.target.span,
            f"write `commit {access.value}[*] using ...`",
        )
    return access


def lower_commit(item: ast.Commit, access: Access, scope: Scope) -> Commit:
    """`commit V[*] using policy(...)` of a value of cells (of a Params value: lmpm.ir.lower.train)."""
    value = scope.values[access.value]
    pol = item.policy
    name = pol.func if isinstance(pol, ast.Call) else pol.id if isinstance(pol, ast.Name) else ""
    if name == "diloco":
        raise scope.fail(
            "E160",
            f"`diloco` commits a Params value; `{value.name}` holds {value.dtype.value}s",
            pol.span,
            "use it as `commit P[*] using diloco(outer_lr=0.7, momentum=0.9)` on a Params value",
        )
    policy = lower_bound_call(item.policy, "policy", (), scope.inner())
    return Commit(access, policy, item.span)
