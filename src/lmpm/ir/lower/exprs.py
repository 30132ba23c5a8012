"""Lowering of the expressions every statement shares: integer expressions, accesses, targets,
guards and binders, and calls with their arguments. Each is a pure function of (AST node, scope)."""

from __future__ import annotations

from lmpm.ir.lower.scope import EPOCH_VAR, Scope, describe, src
from lmpm.ir.nodes import (
    BINARY_OPS,
    NEIGHBORHOODS,
    TRUE,
    Access,
    Arg,
    ArgKind,
    Axis,
    AxisKind,
    Binder,
    Call,
    DType,
    Expr,
    Op,
    Read,
    ShapeKind,
    Value,
)
from lmpm.lang import ast


def lower_expr(e: ast.Expr, scope: Scope) -> Expr:
    """An integer or boolean expression."""
    match e:
        case ast.Int(value=v):
            return Expr.const(v)
        case ast.Name(id=n, span=sp):
            if n in scope.vars:
                return Expr.var(n)
            if n == EPOCH_VAR and scope.allow_epoch:
                return Expr.var(n)
            if n in scope.params:
                return Expr.param(n)
            if n in scope.names:
                kind, _ = scope.names[n]
                raise scope.fail("E108", f"`{n}` is a {kind}, not a number", sp)
            if scope.free_params:
                return scope.implicit_param(n, sp)
            known = sorted(scope.vars)
            raise scope.fail(
                "E110",
                f"unknown name `{n}`",
                sp,
                (f"names here: {', '.join(known)}; " if known else "")
                + f"declare a parameter with `param {n} = ...`",
            )
        case ast.BinOp(op=op, lhs=lhs, rhs=rhs):
            return Expr(BINARY_OPS[op], (lower_expr(lhs, scope), lower_expr(rhs, scope)))
        case ast.Neg(operand=x):
            inner = lower_expr(x, scope)
            if inner.op == Op.CONST and isinstance(inner.value, int):
                return Expr.const(-inner.value)
            return Expr(Op.NEG, (inner,))
        case ast.Cmp(op=op, lhs=lhs, rhs=rhs):
            return Expr(BINARY_OPS[op], (lower_expr(lhs, scope), lower_expr(rhs, scope)))
        case ast.And(lhs=lhs, rhs=rhs):
            return Expr(Op.AND, (lower_expr(lhs, scope), lower_expr(rhs, scope)))
        case ast.Or(lhs=lhs, rhs=rhs):
            return Expr(Op.OR, (lower_expr(lhs, scope), lower_expr(rhs, scope)))
        case ast.Not(operand=x):
            return Expr(Op.NOT, (lower_expr(x, scope),))
        case ast.Float(text=t, span=sp):
            raise scope.fail(
                "E108",
                f"the decimal `{t}` is not allowed here: sizes, indices, guards and "
                "priorities are integers",
                sp,
                "decimals go in call arguments, e.g. `ByteLM(context, temperature=0.7)`",
            )
        case ast.In(span=sp):
            raise scope.fail(
                "E109",
                "a neighbourhood binder (`(dx,dy) in N8`) may only appear "
                "as a top-level `and` term of a `when` guard",
                sp,
            )
        case _:
            raise scope.fail(
                "E108", f"{describe(e)} is not allowed in an integer expression", e.span
            )


def lower_access(e: ast.Expr, scope: Scope, *, what: str) -> Access:
    """`Value[indices]` or a bare `Value` (all its cells)."""
    if (p := params_of(e, scope)) is not None:
        return lower_params_access(e, scope, p)
    if isinstance(e, ast.Name):
        v = scope.lookup_value(e.id, e.span)
        return Access(v.name, tuple(Axis(AxisKind.ALL) for _ in v.dims), e.span)
    if not (isinstance(e, ast.Subscript) and isinstance(e.base, ast.Name)):
        raise scope.fail(
            "E108",
            f"{what} must be a value access like `Vid[t,x,y]`, got {describe(e)}",
            e.span,
        )
    v = _indexed_value(e, scope)
    rank = len(v.dims)
    idx = e.indices
    if len(idx) == 1 and isinstance(idx[0], ast.Star) and rank > 1:
        return Access(v.name, tuple(Axis(AxisKind.ALL) for _ in range(rank)), e.span)
    regions = [i for i in idx if isinstance(i, ast.Call)]
    if len(regions) > 1:
        raise scope.fail("E103", "at most one region call per access", regions[1].span)
    width = rank - (len(idx) - 1) if regions else 1
    covered = len(idx) - len(regions) + (width if regions else 0)
    if covered != rank or (regions and width < 1):
        raise scope.fail(
            "E103",
            f"`{v.name}` is {v.shape.value} with {rank} ax"
            f"{'i' if rank == 1 else 'e'}s ({', '.join(v.axis_names)}), "
            f"but this access gives {len(idx)} ind{'ex' if len(idx) == 1 else 'ices'}",
            e.span,
            f"write `{v.name}[{', '.join(v.axis_names)}]`",
        )
    axes = tuple(lower_axis(i, scope, width) for i in idx)
    return Access(v.name, axes, e.span)


def _indexed_value(e: ast.Subscript, scope: Scope) -> Value:
    """The value `V[...]` indexes: one with cells (a Set value has none)."""
    assert isinstance(e.base, ast.Name)
    v = scope.lookup_value(e.base.id, e.base.span)
    if v.shape == ShapeKind.SET:
        raise scope.fail(
            "E104",
            f"`{v.name}` is a Set value and has no cells to index",
            e.span,
            f"write `{v.name}` without brackets",
        )
    return v


def lower_axis(i: ast.Expr, scope: Scope, width: int) -> Axis:
    match i:
        case ast.Star():
            return Axis(AxisKind.ALL)
        case ast.Range(lo=lo, hi=hi):
            return Axis(
                AxisKind.RANGE,
                lower_index_expr(lo, scope),
                lower_index_expr(hi, scope),
            )
        case ast.Call():
            return Axis(AxisKind.REGION, call=lower_bound_call(i, "region", (), scope), width=width)
        case _:
            return Axis(AxisKind.AT, lower_index_expr(i, scope))


def lower_index_expr(e: ast.Expr, scope: Scope) -> Expr:
    """An index: affine in the index variables, plus floor division and modulo by constants.

    The checker's probing (and the visibility compiler's stencils) rely on this shape."""
    out = lower_expr(e, scope)
    bad = _non_affine(out, e)
    if bad is not None:
        node, why = bad
        raise scope.fail(
            "E114",
            f"index `{src(node)}` {why}",
            node.span,
            "indices are affine in the index variables: `x+dx`, `2*x`, `x/8`, `t-1`",
        )
    return out


def lower_target(e: ast.Expr, scope: Scope, *, what: str) -> tuple[Value, tuple[str, ...]]:
    """`Vid[t,x,y]` with distinct variable names (or a bare Set or Params value)."""
    if (p := params_of(e, scope)) is not None:
        access = lower_params_access(e, scope, p)
        if access.axes[0].kind != AxisKind.ALL:
            raise scope.fail(
                "E151",
                f"{what} is the whole Params value `{p.name}`, not some of its cells",
                e.span,
                f"write `{p.name}[*]`",
            )
        return p, ()
    if isinstance(e, ast.Name):
        v = scope.lookup_value(e.id, e.span)
        if v.shape != ShapeKind.SET:
            raise scope.fail(
                "E107",
                f"{what} `{v.name}` needs index variables",
                e.span,
                f"write `{v.name}[{', '.join(v.axis_names)}]`",
            )
        return v, ()
    if not (isinstance(e, ast.Subscript) and isinstance(e.base, ast.Name)):
        raise scope.fail("E107", f"{what} must look like `Vid[t,x,y]`, got {describe(e)}", e.span)
    v = _indexed_value(e, scope)
    names: list[str] = []
    for i in e.indices:
        if not isinstance(i, ast.Name):
            raise scope.fail(
                "E107",
                f"{what} indices must be variable names, got {describe(i)}",
                i.span,
                f"write `{v.name}[{', '.join(v.axis_names)}]`; put conditions in `when`",
            )
        if scope.declared_param(i.id) or i.id in scope.names:
            raise scope.fail(
                "E107",
                f"`{i.id}` is already a name in the program and cannot be an index variable",
                i.span,
            )
        if i.id in names:
            raise scope.fail("E107", f"index variable `{i.id}` is used twice", i.span)
        names.append(i.id)
    if len(names) != len(v.dims):
        raise scope.fail(
            "E103",
            f"`{v.name}` is {v.shape.value} with {len(v.dims)} axes "
            f"({', '.join(v.axis_names)}), but {len(names)} index variable(s) given",
            e.span,
            f"write `{v.name}[{', '.join(v.axis_names)}]`",
        )
    return v, tuple(names)


def split_guard(g: ast.Expr | None, scope: Scope) -> tuple[tuple[Binder, ...], Expr]:
    if g is None:
        return (), TRUE
    terms: list[ast.Expr] = []

    def flatten(x: ast.Expr) -> None:
        if isinstance(x, ast.And):
            flatten(x.lhs)
            flatten(x.rhs)
        else:
            terms.append(x)

    flatten(g)
    binders: list[Binder] = []
    rest: list[ast.Expr] = []
    for t in terms:
        if isinstance(t, ast.In):
            binders.append(lower_binder(t, scope))
        else:
            rest.append(t)
    guard: Expr | None = None
    for t in rest:
        ex = lower_expr(t, scope)
        guard = ex if guard is None else Expr(Op.AND, (guard, ex))
    return tuple(binders), guard if guard is not None else TRUE


def lower_binder(t: ast.In, scope: Scope) -> Binder:
    lhs = t.lhs
    names = (
        [lhs]
        if isinstance(lhs, ast.Name)
        else list(lhs.items)
        if isinstance(lhs, ast.Tuple)
        else []
    )
    if not names or not all(isinstance(n, ast.Name) for n in names):
        raise scope.fail(
            "E109",
            "the left side of `in` must be a name or a tuple of names",
            lhs.span,
            "write `(dx,dy) in N8` or `d in -2..2`",
        )
    vars_ = tuple(n.id for n in names if isinstance(n, ast.Name))
    for n in names:
        assert isinstance(n, ast.Name)
        if n.id in scope.vars or scope.declared_param(n.id) or n.id in scope.names:
            raise scope.fail("E109", f"binder variable `{n.id}` shadows another name", n.span)
    if len(set(vars_)) != len(vars_):
        raise scope.fail("E109", "binder variables must be distinct", lhs.span)
    rhs = t.rhs
    if isinstance(rhs, ast.Name):
        if rhs.id not in NEIGHBORHOODS:
            raise scope.fail(
                "E109",
                f"unknown neighbourhood `{rhs.id}`",
                rhs.span,
                "neighbourhoods: " + ", ".join(NEIGHBORHOODS),
            )
        dim = len(NEIGHBORHOODS[rhs.id][0])
        if dim != len(vars_):
            raise scope.fail(
                "E109",
                f"{rhs.id} is {dim}-D but binds {len(vars_)} variable(s)",
                t.span,
                f"write ({', '.join(f'd{i}' for i in range(dim))}) in {rhs.id}",
            )
        scope.vars.update(vars_)
        return Binder(vars_, rhs.id)
    if isinstance(rhs, ast.Range) and len(vars_) == 1:
        lo, hi = lower_expr(rhs.lo, scope), lower_expr(rhs.hi, scope)
        scope.vars.update(vars_)
        return Binder(vars_, None, lo, hi)
    raise scope.fail(
        "E109",
        "a binder ranges over a neighbourhood (N4, N8, N6, N26, N2) or, "
        "for one variable, a range `a..b`",
        rhs.span,
    )


def lower_bound_call(e: ast.Expr, role: str, reads: tuple[Read, ...], scope: Scope) -> Call:
    if isinstance(e, ast.Name):
        return Call(e.id, (), role, e.span)
    if not isinstance(e, ast.Call):
        raise scope.fail("E108", f"expected a call like `Model(...)`, got {describe(e)}", e.span)
    args: list[Arg] = []
    for a in e.args:
        args.append(lower_call_arg(a, reads, scope, role))
    return Call(e.func, tuple(args), role, e.span)


def lower_call_arg(a: ast.Arg, reads: tuple[Read, ...], scope: Scope, role: str) -> Arg:
    v = a.value
    key = a.name
    match v:
        case ast.Dots():
            if role != "score":
                raise scope.fail(
                    "E112",
                    "`...` forwards a rule's reads and proposal to its "
                    "score; it is only allowed in `score`",
                    v.span,
                )
            return Arg(ArgKind.FORWARD, key)
        case ast.Int(value=n):
            return Arg(ArgKind.INT, key, n)
        case ast.Float(value=x):
            return Arg(ArgKind.FLOAT, key, x)
        case ast.Neg(operand=ast.Float(value=x)):
            return Arg(ArgKind.FLOAT, key, -x)
        case ast.Str(value=s):
            return Arg(ArgKind.STR, key, s)
        case ast.Name():
            return _name_arg(v, key, reads, scope, role)
        case ast.Call():
            return Arg(ArgKind.CALL, key, call=lower_bound_call(v, role, reads, scope))
        case ast.Subscript():
            return Arg(ArgKind.ACCESS, key, access=lower_access(v, scope, what="an argument"))
        case ast.BinOp() | ast.Neg():
            return Arg(ArgKind.EXPR, key, expr=lower_expr(v, scope))
        case ast.Of(count=k, total=n):
            if role != "policy":
                raise scope.fail(
                    "E108",
                    "`k of n` is only allowed as a commit policy's argument",
                    v.span,
                    "write e.g. `commit X[*] using quorum(2 of 3, satisfy)`",
                )
            parts = tuple(lower_count_arg(x, scope) for x in (k, n))
            return Arg(ArgKind.OF, key, parts=parts)
        case _:
            raise scope.fail("E108", f"{describe(v)} is not allowed as a call argument", v.span)


def _name_arg(
    v: ast.Name, key: str | None, reads: tuple[Read, ...], scope: Scope, role: str
) -> Arg:
    """A bare name as an argument: a variable or parameter, a read of the rule (a unique prefix
    will do), or a name the binding interprets."""
    n, sp = v.id, v.span
    if n in scope.vars or (n == EPOCH_VAR and scope.allow_epoch) or n in scope.params:
        return Arg(ArgKind.EXPR, key, expr=lower_expr(v, scope))
    if reads:
        match = [r for r in reads if r.name == n] or [r for r in reads if r.name.startswith(n)]
        if len(match) == 1:
            return Arg(ArgKind.READ, key, match[0].name)
        names = ", ".join(r.name for r in reads)
        if len(match) > 1:
            raise scope.fail(
                "E112",
                f"`{n}` could mean any of the reads {', '.join(r.name for r in match)}",
                sp,
                "use the full read name",
            )
        if role in ("model", "score") and key is None:
            raise scope.fail(
                "E112",
                f"`{n}` names no read of this rule",
                sp,
                f"the reads are: {names}",
            )
    return Arg(ArgKind.NAME, key, n)


def lower_count_arg(e: ast.Expr, scope: Scope) -> Arg:
    """One side of `k of n`: an integer literal or an integer expression of the params."""
    if isinstance(e, ast.Int):
        return Arg(ArgKind.INT, None, e.value)
    if isinstance(e, ast.Name | ast.BinOp | ast.Neg):
        return Arg(ArgKind.EXPR, None, expr=lower_expr(e, scope))
    raise scope.fail(
        "E108", f"`k of n` counts with integers, got {describe(e)}", e.span, "e.g. `2 of 3`"
    )


def lower_set_literal(c: ast.Call, scope: Scope) -> Call:
    args: list[Arg] = []
    for a in c.args:
        v = a.value
        if a.name is not None:
            raise scope.fail("E116", "Set(...) takes no keyword arguments", a.span)
        if isinstance(v, ast.Int):
            args.append(Arg(ArgKind.INT, None, v.value))
        elif isinstance(v, ast.Str):
            args.append(Arg(ArgKind.STR, None, v.value))
        elif isinstance(v, ast.Range):
            # A range is two args, `lo` then `hi`, so the printer and runtime see it plainly.
            args.append(Arg(ArgKind.EXPR, "lo", expr=lower_expr(v.lo, scope.inner())))
            args.append(Arg(ArgKind.EXPR, "hi", expr=lower_expr(v.hi, scope.inner())))
        elif isinstance(v, ast.Name) and v.id in scope.params:
            args.append(Arg(ArgKind.EXPR, None, expr=Expr.param(v.id)))
        else:
            raise scope.fail(
                "E116",
                f"Set(...) holds integers, ranges `a..b` and strings, got {describe(v)}",
                v.span,
            )
    return Call("Set", tuple(args), "set", c.span)


def pattern_vars(e: ast.Expr, scope: Scope) -> tuple[str, ...]:
    """Bare names used directly as indices range over their axis (pattern variables)."""
    if not isinstance(e, ast.Subscript):
        return ()
    out = []
    for i in e.indices:
        if isinstance(i, ast.Name) and i.id not in scope.params and i.id not in scope.names:
            out.append(i.id)
    scope.vars.update(out)
    return tuple(out)


def params_of(e: ast.Expr, scope: Scope) -> Value | None:
    """The Params value `e` names (`P`, `P[...]`), if it names one."""
    base = e.base if isinstance(e, ast.Subscript) else e
    if isinstance(base, ast.Name):
        v = scope.values.get(base.id)
        if v is not None and v.dtype == DType.PARAMS:
            return v
    return None


def lower_params_access(e: ast.Expr, scope: Scope, p: Value) -> Access:
    """`P`, `P[*]` (every cell) or `P["glob"]` (the cells whose names match)."""
    if isinstance(e, ast.Name):
        return Access(p.name, (Axis(AxisKind.ALL),), e.span)
    assert isinstance(e, ast.Subscript)
    idx = e.indices
    if len(idx) == 1 and isinstance(idx[0], ast.Star):
        return Access(p.name, (Axis(AxisKind.ALL),), e.span)
    if len(idx) == 1 and isinstance(idx[0], ast.Str) and idx[0].value:
        return Access(p.name, (Axis(AxisKind.GLOB, pattern=idx[0].value),), e.span)
    bad = idx[0] if len(idx) == 1 else e
    raise scope.fail(
        "E151",
        f"the cells of the Params value `{p.name}` are named tensors; select them with `*` "
        f"or a name pattern, got {describe(bad) if len(idx) == 1 else f'{len(idx)} indices'}",
        bad.span,
        f'write `{p.name}[*]` or `{p.name}["blocks.*"]` (fnmatch over names like '
        "`blocks.0.attn.weight`)",
    )


def _has_var(e: Expr) -> bool:
    stack = [e]
    while stack:
        x = stack.pop()
        if x.op == Op.VAR:
            return True
        stack.extend(x.args)
    return False


def _non_affine(e: Expr, src: ast.Expr) -> tuple[ast.Expr, str] | None:
    """The AST node of the first non-affine operation in ``e`` (built from ``src``), and why."""
    stack: list[tuple[Expr, ast.Expr]] = [(e, src)]
    while stack:
        x, a = stack.pop()
        kids = ast.operands(a)
        if x.op == Op.MUL and _has_var(x.args[0]) and _has_var(x.args[1]):
            return a, "multiplies two index variables"
        if x.op in (Op.DIV, Op.MOD):
            rhs = x.args[1]
            if _has_var(rhs):
                return a, "divides by an index variable"
            if rhs.op == Op.CONST and rhs.value == 0:
                return a, "divides by zero"
        if x.op in (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE, Op.AND, Op.OR, Op.NOT):
            return a, "is a condition, not a number"
        if len(kids) == len(x.args):
            stack.extend(zip(x.args, kids))
    return None
