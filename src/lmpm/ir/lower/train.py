"""Lowering of training values: `Params` values, the `minimize` rule that trains one, the
constraints on its parameters (freeze, norm bounds) and its commit policy. A fault refuses its
statement (E150-E160); what a training program may hold as a whole is the checker's training pass
(:mod:`lmpm.ir.check.training`, E161 E162)."""

from __future__ import annotations

from lmpm.errors import Span
from lmpm.ir.eval import EvalError, evaluate, names_in
from lmpm.ir.lower.core import RuleParts, lower_reads, new_constraint
from lmpm.ir.lower.exprs import lower_expr, lower_params_access, lower_target, params_of
from lmpm.ir.lower.scope import MINIMIZE, Scope, describe, src, suggest
from lmpm.ir.nodes import (
    PARAMS_SHAPES,
    TRUE,
    Access,
    Arg,
    ArgKind,
    Axis,
    AxisKind,
    Call,
    Constraint,
    DType,
    Op,
    PredKind,
    Read,
    ReadKind,
    Rule,
    RuleKind,
    ShapeKind,
    Value,
)
from lmpm.ir.printer import read_str
from lmpm.lang import ast
from lmpm.train.spec import OPTIMIZERS, SCHEDULES

# ---- training values: `minimize` options (lmpm.train.spec.MinimizeSpec) ----
NORM_PREDICATE = "NormAtMost"
# (kind, lower bound, lower bound excluded, upper bound excluded, choices); kind int|number|choice
_Opt = tuple[str, float | None, bool, float | None, tuple[str, ...]]
MINIMIZE_OPTIONS: dict[str, _Opt] = {
    "steps": ("int", 1, False, None, ()),  # inner optimizer steps per epoch (H)
    "batch": ("int", 1, False, None, ()),  # rows per inner step per worker
    "optimizer": ("choice", None, False, None, OPTIMIZERS),
    "lr": ("number", 0, True, None, ()),
    "weight_decay": ("number", 0, False, None, ()),
    "momentum": ("number", 0, False, 1, ()),  # sgd only
    "clip": ("number", 0, True, None, ()),  # global grad-norm clip
    "schedule": ("choice", None, False, None, SCHEDULES),
    "warmup": ("int", 0, False, None, ()),
    "seed": ("int", None, False, None, ()),
}
DILOCO_OPTIONS = ("outer_lr", "momentum", "nesterov")


def lower_params_value(v: ast.Value, scope: Scope) -> Value:
    """`value P : Params[Module] shape Tensors()|Blocks()`: cells named after the module."""
    t = v.type
    if len(t.args) != 1 or not isinstance(t.args[0], ast.Name):
        raise scope.fail(
            "E150",
            "`Params` takes the name of a module binding, e.g. `Params[ByteLM]`",
            t.span,
            "write `value P : Params[ByteLM] shape Tensors()`",
        )
    shape = v.shape
    kinds = {k.value: k for k in PARAMS_SHAPES}
    if shape.kind not in kinds or shape.dims:
        raise scope.fail(
            "E150",
            f"a Params value has the shape Tensors() (one cell per parameter tensor) or "
            f"Blocks() (one per top-level block), got `{shape.kind}` with "
            f"{len(shape.dims)} dimension(s)",
            shape.span,
            "write `shape Tensors()` or `shape Blocks()`",
        )
    if v.clock is not None and v.clock != "Lamport":
        raise scope.fail("E105", f"unknown clock `{v.clock}`", v.span, "the clock is `Lamport`")
    kind = kinds[shape.kind]
    return Value(v.name, DType.PARAMS, None, None, kind, (), (), "Lamport", v.span, t.args[0].id)


def lower_minimize_rule(item: ast.Rule, parts: RuleParts, scope: Scope) -> Rule:
    """The rule that trains a Params value: `emit proposal P[*] := minimize(Loss(P, data), ...)`."""
    target, on, emit = parts.target, parts.on, parts.emit
    if on.guard is not None:
        raise scope.fail(
            "E154",
            f"rule `{item.name}` minimizes a loss every epoch; it takes no `when` guard",
            on.guard.span,
            "drop the `when ...`",
        )
    scope = scope.inner()
    rule_reads = lower_reads(parts.read, target, (), scope) if parts.read else ()
    rule_reads = tuple(lower_data_read(r, scope) for r in rule_reads)
    etarget, _ = lower_target(emit.target, scope, what="the emitted cell")
    if etarget.name != target.name:
        raise scope.fail(
            "E111",
            "a rule emits proposals for the cells of its `on` pattern",
            emit.target.span,
            f"write `emit proposal {target.name}[*] := ...`",
        )
    call = emit.call
    if not (isinstance(call, ast.Call) and call.func == MINIMIZE):
        raise scope.fail(
            "E154",
            f"a Params value is proposed by `minimize(...)`; rule `{item.name}` proposes "
            f"{describe(call)}",
            call.span,
            f"write `emit proposal {target.name}[*] := minimize(Loss({target.name}, data), "
            "steps=50, batch=8)`",
        )
    proposal = lower_minimize(call, scope, target, rule_reads)
    score = (
        lower_loss(parts.score.call, scope, target, rule_reads, "score") if parts.score else None
    )
    return Rule(
        item.name,
        RuleKind.MINIMIZE,
        target.name,
        (),
        TRUE,
        rule_reads,
        proposal,
        score,
        item.span,
    )


def lower_data_read(r: Read, scope: Scope) -> Read:
    """A read of a minimize rule is data: a whole token value of rows (Seq or Grid2D)."""
    v = scope.values[r.source]
    whole = r.kind == ReadKind.VISIBLE or (
        r.kind == ReadKind.INDEX and all(a.kind == AxisKind.ALL for a in r.axes)
    )
    if v.dtype != DType.TOKEN or v.shape not in (ShapeKind.SEQ, ShapeKind.GRID2D):
        raise scope.fail(
            "E157",
            f"a loss reads token data (Seq(N): one row; Grid2D(L, R): R rows of L tokens); "
            f"`{v.name}` is a {v.dtype.value} {v.shape.value} value",
            r.span,
            "declare the data as `value Corpus : Token[Byte] shape Grid2D(64, 4096)`",
        )
    if not whole:
        raise scope.fail(
            "E157",
            f"a loss reads whole data values (workers shard the rows); `{read_str(r)}` is "
            f"part of `{v.name}`",
            r.span,
            f"write `{r.name} = {v.name}[*]`",
        )
    return Read(
        r.name,
        ReadKind.INDEX,
        v.name,
        tuple(Axis(AxisKind.ALL) for _ in v.dims),
        (),
        r.optional,
        r.span,
    )


def lower_loss(e: ast.Expr, scope: Scope, p: Value, reads: tuple[Read, ...], what: str) -> Call:
    """`Loss(P, data...)`: the Params value first (what is differentiated), then reads."""
    form = f"`Loss({p.name}, data)`"
    if not isinstance(e, ast.Call):
        raise scope.fail(
            "E155",
            f"the {what} must be a loss call {form}, got {describe(e)}",
            e.span,
            "a loss binding takes the parameters and the data it is computed on",
        )
    args = e.args
    first = args[0].value if args else None
    if not (isinstance(first, ast.Name) and first.id == p.name and args[0].name is None) and not (
        first is not None and params_of(first, scope) is p
    ):
        raise scope.fail(
            "E155",
            f"`{e.func}` does not take `{p.name}` as its first argument: "
            "there is nothing to differentiate",
            args[0].span if args else e.span,
            f"write `{e.func}({p.name}, "
            + ", ".join(r.name for r in reads[:1] or ())
            + ("" if reads else "data")
            + ")`",
        )
    if first is not None and isinstance(first, ast.Subscript):
        lower_params_access(first, scope, p)  # `P[*]` only: a loss differentiates every cell
        if not isinstance(first.indices[0], ast.Star):
            raise scope.fail(
                "E155",
                f"a loss differentiates the whole Params value; write `{p.name}`",
                first.span,
                f"freeze cells with `forbid change({p.name}[...])` instead",
            )
    out = [Arg(ArgKind.ACCESS, None, access=Access(p.name, (Axis(AxisKind.ALL),), first.span))]
    names = [r.name for r in reads]
    out += _loss_data(e, scope, p, names)
    if len(out) == 1:
        raise scope.fail(
            "E155",
            f"`{e.func}` reads no data",
            e.span,
            f"pass the data reads: `{e.func}({p.name}, {', '.join(names) or 'data'})`",
        )
    return Call(e.func, tuple(out), "loss", e.span)


def _loss_data(e: ast.Call, scope: Scope, p: Value, names: list[str]) -> list[Arg]:
    """A loss's arguments after the Params value: the rule's reads, positionally."""
    out: list[Arg] = []
    for a in e.args[1:]:
        v = a.value
        if a.name is not None:
            raise scope.fail(
                "E155",
                f"a loss takes its data positionally, got `{a.name}=`",
                a.span,
                f"write `{e.func}({p.name}, {', '.join(names) or 'data'})`",
            )
        if params_of(v, scope) is not None:
            raise scope.fail(
                "E153",
                f"`{p.name}` as data of `{e.func}`: a Params value is what a loss "
                "differentiates, not what it reads",
                v.span,
                f"pass token data: `{e.func}({p.name}, {', '.join(names) or 'data'})`",
            )
        if not (isinstance(v, ast.Name) and v.id in names):
            raise scope.fail(
                "E155",
                f"a loss's data are the rule's reads; {describe(v)}"
                + (f" `{v.id}`" if isinstance(v, ast.Name) else "")
                + " is not one",
                v.span,
                "the reads are: " + ", ".join(names)
                if names
                else "add `read {data = Corpus[*]}` to the rule",
            )
        out.append(Arg(ArgKind.READ, None, v.id))
    return out


def lower_minimize(c: ast.Call, scope: Scope, p: Value, reads: tuple[Read, ...]) -> Call:
    """`minimize(Loss(P, data...), steps=H, batch=B, ...)` with the options of MinimizeSpec."""
    if not c.args or c.args[0].name is not None:
        raise scope.fail(
            "E155",
            "`minimize` takes the loss first, without a keyword",
            c.args[0].span if c.args else c.span,
            f"write `minimize(Loss({p.name}, data), steps=50, batch=8)`",
        )
    args = [Arg(ArgKind.CALL, None, call=lower_loss(c.args[0].value, scope, p, reads, "loss"))]
    seen: set[str] = set()
    for a in c.args[1:]:
        if a.name is None:
            raise scope.fail(
                "E156",
                "`minimize` takes one loss, then keyword options",
                a.span,
                "options: " + ", ".join(MINIMIZE_OPTIONS),
            )
        if a.name not in MINIMIZE_OPTIONS:
            near = suggest(a.name, list(MINIMIZE_OPTIONS))
            raise scope.fail(
                "E156",
                f"`minimize` has no option `{a.name}`",
                a.span,
                (near + "; " if near else "") + "options: " + ", ".join(MINIMIZE_OPTIONS),
            )
        if a.name in seen:
            raise scope.fail("E156", f"option `{a.name}` is given twice", a.span)
        seen.add(a.name)
        args.append(lower_option(a.name, scope, a.value, MINIMIZE_OPTIONS[a.name]))
    hint = "steps: inner optimizer steps per epoch; batch: rows per step per worker"
    _required(c, ("steps", "batch"), seen, "E156", hint, scope)
    return Call(MINIMIZE, tuple(args), "minimize", c.span)


def _required(
    c: ast.Call, keys: tuple[str, ...], seen: set[str], code: str, hint: str, scope: Scope
) -> None:
    """The first keyword of ``keys`` that call ``c`` does not give is an error."""
    missing = [k for k in keys if k not in seen]
    if missing:
        raise scope.fail(code, f"`{c.func}` needs `{missing[0]}=`", c.span, hint)


def lower_option(key: str, scope: Scope, v: ast.Expr, rule: _Opt) -> Arg:
    """One keyword option, its kind and range checked (params resolved with their defaults)."""
    kind, lo, _, _, choices = rule
    if kind == "choice":
        if isinstance(v, ast.Str | ast.Name):
            word = v.value if isinstance(v, ast.Str) else v.id
            if word in choices:
                return Arg(ArgKind.STR, key, word)
        near = suggest(v.value, list(choices)) if isinstance(v, ast.Str) else None
        raise scope.fail(
            "E156",
            f"`{key}` is one of " + ", ".join(f'"{x}"' for x in choices) + f", got {src(v)}",
            v.span,
            near or f'write `{key}="{choices[0]}"`',
        )
    if kind == "int":
        if isinstance(v, ast.Float) or not isinstance(v, ast.Int | ast.Name | ast.BinOp | ast.Neg):
            raise scope.fail(
                "E156", f"`{key}` is an integer, got {describe(v)}", v.span, range_words(key, rule)
            )
        ex = lower_expr(v, scope.inner())
        env = scope.param_defaults()
        try:
            n: float = evaluate(ex, env)
        except EvalError as err:
            if all(name in env for _, name in names_in(ex)):
                raise scope.fail("E156", f"`{key}` cannot be evaluated: {err}", v.span) from None
            n = lo if lo is not None else 0  # decided when the parameters are bound
        in_range(key, scope, n, rule, v.span)
        if ex.op == Op.CONST:
            return Arg(ArgKind.INT, key, ex.value)
        return Arg(ArgKind.EXPR, key, expr=ex)
    x = v.operand if isinstance(v, ast.Neg) else v
    if not isinstance(x, ast.Int | ast.Float):
        raise scope.fail(
            "E156", f"`{key}` is a number, got {describe(v)}", v.span, range_words(key, rule)
        )
    f = float(x.value) * (-1 if isinstance(v, ast.Neg) else 1)
    in_range(key, scope, f, rule, v.span)
    return Arg(ArgKind.FLOAT, key, f)


def in_range(key: str, scope: Scope, n: float, rule: _Opt, span: Span) -> None:
    _, lo, lo_open, hi, _ = rule
    if (lo is not None and (n < lo or (lo_open and n == lo))) or (hi is not None and n >= hi):
        raise scope.fail("E156", f"`{key}` is {n:g}; {range_words(key, rule)}", span)


def params_predicate(pred: ast.Expr, scope: Scope) -> Value | None:
    """The Params value a constraint's predicate speaks about (its first operand), if any."""
    if isinstance(pred, ast.Call):
        first = pred.args[0].value if pred.args else None
        return params_of(first, scope) if first is not None else None
    if isinstance(pred, ast.In):
        return params_of(pred.lhs, scope)
    return None


def lower_params_constraint(
    item: ast.Constraint, scope: Scope, p: Value, priority: int
) -> Constraint:
    """`forbid change(P[sel])` (freeze) or `require NormAtMost(P[sel], R)` (a norm bound)."""
    pred = item.pred
    allowed = (
        f'the constraints on a Params value are `forbid change({p.name}["pos.*"])` (freeze) '
        f'and `require {NORM_PREDICATE}({p.name}["blocks.*"], 40)` (a norm bound)'
    )
    func = pred.func if isinstance(pred, ast.Call) else None
    if func == "change" and item.kind == "forbid":
        assert isinstance(pred, ast.Call)
        if len(pred.args) != 1 or pred.args[0].name is not None:
            raise scope.fail("E159", "`change` takes one access", pred.span, allowed)
        access = lower_params_access(pred.args[0].value, scope, p)
        return new_constraint(item, PredKind.CHANGE, access, (), priority)
    if func == NORM_PREDICATE and item.kind == "require":
        assert isinstance(pred, ast.Call)
        call = _norm_bound(pred, scope, p)
        return new_constraint(item, PredKind.USER, call.args[0].access, (), priority, call=call)
    what = (
        f"`{item.kind} {func}(...)`" if func in ("change", NORM_PREDICATE) else f"{describe(pred)}"
    )
    raise scope.fail("E159", f"{what} is not a constraint on a Params value", pred.span, allowed)


def _norm_bound(pred: ast.Call, scope: Scope, p: Value) -> Call:
    """`NormAtMost(P[sel], R)`: the access, then a positive bound."""
    if len(pred.args) != 2 or any(a.name is not None for a in pred.args):
        raise scope.fail(
            "E159",
            f"`{NORM_PREDICATE}` takes a Params access and a bound",
            pred.span,
            f'write `require {NORM_PREDICATE}({p.name}["blocks.*"], 40)`',
        )
    access = lower_params_access(pred.args[0].value, scope, p)
    b = pred.args[1].value
    if not (isinstance(b, ast.Int | ast.Float) and b.value > 0):
        raise scope.fail(
            "E159",
            f"the bound of `{NORM_PREDICATE}` is a positive number, got {src(b)}",
            b.span,
            "e.g. 40 or 2.5",
        )
    bound = (
        Arg(ArgKind.INT, None, b.value)
        if isinstance(b, ast.Int)
        else Arg(ArgKind.FLOAT, None, b.value)
    )
    return Call(
        NORM_PREDICATE, (Arg(ArgKind.ACCESS, None, access=access), bound), "norm", pred.span
    )


def lower_params_policy(e: ast.Expr, scope: Scope) -> Call:
    """`diloco(outer_lr=F, momentum=F[, nesterov=0|1])`, `average` or
    `satisfy(max_constraints_then_score)` (the best-scoring valid replica)."""
    allowed = (
        "a Params value commits with diloco(outer_lr=0.7, momentum=0.9), average, or "
        "satisfy(max_constraints_then_score)"
    )
    name = e.func if isinstance(e, ast.Call) else e.id if isinstance(e, ast.Name) else None
    args = e.args if isinstance(e, ast.Call) else ()
    if name == "average" and not args:
        return Call("average", (), "policy", e.span)
    if (
        name == "satisfy"
        and len(args) == 1
        and isinstance(args[0].value, ast.Name)
        and args[0].value.id == "max_constraints_then_score"
    ):
        return Call("satisfy", (Arg(ArgKind.NAME, None, args[0].value.id),), "policy", e.span)
    if name != "diloco" or not isinstance(e, ast.Call):
        raise scope.fail(
            "E160",
            f"{src(e)} is not a commit policy for a Params value",
            e.span,
            allowed,
        )
    out: list[Arg] = []
    seen: set[str] = set()
    for a in args:
        if a.name is None or a.name not in DILOCO_OPTIONS:
            raise scope.fail(
                "E160",
                "`diloco` takes the keywords " + ", ".join(DILOCO_OPTIONS),
                a.span,
                "write diloco(outer_lr=0.7, momentum=0.9)",
            )
        if a.name in seen:
            raise scope.fail("E160", f"`{a.name}` is given twice", a.span)
        seen.add(a.name)
        out.append(_diloco_option(a, scope, allowed))
    _required(
        e, ("outer_lr", "momentum"), seen, "E160", "write diloco(outer_lr=0.7, momentum=0.9)", scope
    )
    return Call("diloco", tuple(out), "policy", e.span)


def _diloco_option(a: ast.Arg, scope: Scope, allowed: str) -> Arg:
    """One keyword of `diloco(...)`: `nesterov` is 0 or 1, the others numbers in range."""
    x = a.value
    if a.name == "nesterov":
        if not (isinstance(x, ast.Int) and x.value in (0, 1)):
            raise scope.fail("E160", "`nesterov` is 0 or 1", x.span)
        return Arg(ArgKind.INT, a.name, x.value)
    if not isinstance(x, ast.Int | ast.Float):
        raise scope.fail("E160", f"`{a.name}` is a number, got {describe(x)}", x.span, allowed)
    f = float(x.value)
    if a.name == "outer_lr" and f <= 0:
        raise scope.fail("E160", f"`outer_lr` must be above 0, got {f:g}", x.span)
    if a.name == "momentum" and not 0 <= f < 1:
        raise scope.fail("E160", f"`momentum` must be in [0, 1), got {f:g}", x.span)
    return Arg(ArgKind.FLOAT, a.name, f)


def range_words(key: str, rule: _Opt) -> str:
    """The allowed values of a `minimize` option, in words."""
    kind, lo, lo_open, hi, _ = rule
    what = "an integer" if kind == "int" else "a number"
    if lo is None:
        return f"`{key}` is {what}"
    low = f"above {lo:g}" if lo_open else f"at least {lo:g}"
    return f"`{key}` must be {what} {low}" + (f" and below {hi:g}" if hi is not None else "")
