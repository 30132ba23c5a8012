"""Plain-integer evaluation of IR expressions and stencils (no torch).

Used by the checker (probing clauses at concrete cells) and to bind parameters. The vectorized
versions live in :mod:`lmpm.visibility`; these are the small, obviously-correct ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping

from lmpm.errors import BindError
from lmpm.ir import memo
from lmpm.ir.nodes import NEIGHBORHOODS, Axis, AxisKind, Binder, Expr, Op, Program


class EvalError(Exception):
    """An expression could not be evaluated (unbound name, division by zero)."""


def evaluate(e: Expr, env: Mapping[str, int]) -> int:
    op = e.op
    if op == Op.CONST:
        assert isinstance(e.value, int)
        return e.value
    if op in (Op.VAR, Op.PARAM):
        assert isinstance(e.value, str)
        try:
            return env[e.value]
        except KeyError:
            raise EvalError(f"`{e.value}` is not bound") from None
    if op == Op.NEG:
        return -evaluate(e.args[0], env)
    if op == Op.NOT:
        return int(not evaluate(e.args[0], env))
    if op == Op.AND:
        return int(bool(evaluate(e.args[0], env)) and bool(evaluate(e.args[1], env)))
    if op == Op.OR:
        return int(bool(evaluate(e.args[0], env)) or bool(evaluate(e.args[1], env)))
    a = evaluate(e.args[0], env)
    b = evaluate(e.args[1], env)
    match op:
        case Op.ADD:
            return a + b
        case Op.SUB:
            return a - b
        case Op.MUL:
            return a * b
        case Op.DIV | Op.MOD:
            if b == 0:
                raise EvalError("division by zero")
            return a // b if op == Op.DIV else a % b
        case Op.LT:
            return int(a < b)
        case Op.LE:
            return int(a <= b)
        case Op.GT:
            return int(a > b)
        case Op.GE:
            return int(a >= b)
        case Op.EQ:
            return int(a == b)
        case Op.NE:
            return int(a != b)
    raise AssertionError(f"unknown op {op}")


def names_in(e: Expr | None) -> set[tuple[Op, str]]:
    """(VAR|PARAM, name) pairs used by ``e``."""
    out: set[tuple[Op, str]] = set()
    stack = [e] if e is not None else []
    while stack:
        x = stack.pop()
        if x.op in (Op.VAR, Op.PARAM):
            assert isinstance(x.value, str)
            out.add((x.op, x.value))
        stack.extend(x.args)
    return out


def bind_params(
    program: Program, overrides: Mapping[str, int] | None = None, *, require_all: bool = False
) -> dict[str, int]:
    """Parameter values: ``overrides`` (e.g. ``--set``) over declared defaults, in declaration order.

    Unknown override names raise :class:`BindError` listing the parameters that exist. With
    ``require_all``, a parameter left without a value is a BindError too.
    """
    overrides = dict(overrides or {})
    known = {p.name for p in program.params}
    unknown = sorted(set(overrides) - known)
    if unknown:
        listing = ", ".join(sorted(known)) or "none"
        raise BindError(
            f"unknown parameter(s) {', '.join(unknown)}; the program's parameters are: {listing}",
            code="B001",
        )
    env: dict[str, int] = {}
    missing: list[str] = []
    for p in program.params:
        if p.name in overrides:
            env[p.name] = int(overrides[p.name])
        elif p.default is not None:
            try:
                env[p.name] = evaluate(p.default, env)
            except EvalError as e:
                raise BindError(
                    f"cannot evaluate the default of `{p.name}`: {e}", span=p.span, code="B002"
                ) from None
        else:
            missing.append(p.name)
    if require_all and missing:
        raise BindError(
            f"parameter(s) without a value: {', '.join(missing)}",
            hint="bind them with " + " ".join(f"--set {m}=..." for m in missing),
            code="B003",
        )
    return env


def value_dims(program: Program, name: str, env: Mapping[str, int]) -> tuple[int, ...]:
    v = program.value(name)
    return tuple(evaluate(d, env) for d in v.dims)


def binder_values(b: Binder, env: Mapping[str, int]) -> list[tuple[int, ...]]:
    if b.neighborhood is not None:
        return list(NEIGHBORHOODS[b.neighborhood])
    assert b.lo is not None and b.hi is not None
    return [(v,) for v in range(evaluate(b.lo, env), evaluate(b.hi, env) + 1)]


def access_cells(
    axes: tuple[Axis, ...],
    binders: tuple[Binder, ...],
    guard: Expr | None,
    env: Mapping[str, int],
    dims: tuple[int, ...],
    *,
    clip: bool = True,
) -> Iterator[tuple[int, ...]]:
    """Source cells of an access at one target cell (``env`` binds its variables).

    Out-of-bounds indices are dropped when ``clip`` (the semantics); otherwise they are yielded so a
    caller can report them. REGION axes are taken as the whole axis (their call is bound at run time).
    """
    binds = [binder_values(b, env) for b in binders]
    for combo in itertools.product(*binds):
        local = dict(env)
        for b, vals in zip(binders, combo):
            local.update(zip(b.vars, vals))
        if guard is not None and not evaluate(guard, local):
            continue
        ranges: list[range | list[int]] = []
        k = 0
        for ax in axes:
            if ax.kind == AxisKind.REGION:
                for _ in range(ax.width):
                    ranges.append(range(dims[k]))
                    k += 1
                continue
            n = dims[k]
            if ax.kind == AxisKind.ALL:
                ranges.append(range(n))
            elif ax.kind == AxisKind.AT:
                assert ax.lo is not None
                i = evaluate(ax.lo, local)
                ranges.append([i] if (0 <= i < n or not clip) else [])
            else:
                assert ax.lo is not None and ax.hi is not None
                lo, hi = evaluate(ax.lo, local), evaluate(ax.hi, local)
                if clip:
                    lo, hi = max(lo, 0), min(hi, n - 1)
                ranges.append(range(lo, hi + 1))
            k += 1
        yield from itertools.product(*ranges)


# ---- compiled evaluation (the checker's fast path) -------------------------------------------------

_PY_BINARY = {
    Op.ADD: "+",
    Op.SUB: "-",
    Op.MUL: "*",
    Op.LT: "<",
    Op.LE: "<=",
    Op.GT: ">",
    Op.GE: ">=",
    Op.EQ: "==",
    Op.NE: "!=",
}


def fold(e: Expr, env: Mapping[str, int]) -> Expr:
    """``e`` with bound parameters replaced by their values and constant subtrees evaluated.

    Division or modulo by zero is left in place (so evaluating it still raises EvalError).
    """
    op = e.op
    if op == Op.CONST or op == Op.VAR:
        return e
    if op == Op.PARAM:
        assert isinstance(e.value, str)
        v = env.get(e.value)
        return Expr.const(v) if v is not None else e
    args = tuple(fold(a, env) for a in e.args)
    if all(a.op == Op.CONST for a in args):
        try:
            return Expr.const(evaluate(Expr(op, args, e.value), {}))
        except EvalError:
            pass
    return Expr(op, args, e.value)


def _div(a: int, b: int) -> int:
    if b == 0:
        raise EvalError("division by zero")
    return a // b


def _mod(a: int, b: int) -> int:
    if b == 0:
        raise EvalError("division by zero")
    return a % b


def _unbound(name: str) -> int:
    raise EvalError(f"`{name}` is not bound")


def _py(e: Expr, names: dict[str, str]) -> str:
    """Python source for ``e``; ``names`` maps variables to the generated function's arguments."""
    op = e.op
    if op == Op.CONST:
        if type(e.value) is not int:  # only ever an int: nothing else is turned into code
            raise EvalError(f"constant {e.value!r} is not an integer")
        return f"({int(e.value)!r})"
    if op == Op.VAR or op == Op.PARAM:
        assert isinstance(e.value, str)
        arg = names.get(e.value)
        return arg if arg is not None else f"_unbound({e.value!r})"
    a = [_py(x, names) for x in e.args]
    if op == Op.NEG:
        return f"(-{a[0]})"
    if op == Op.NOT:
        return f"(not {a[0]})"
    if op == Op.AND:
        return f"(bool({a[0]}) and bool({a[1]}))"
    if op == Op.OR:
        return f"(bool({a[0]}) or bool({a[1]}))"
    if op == Op.DIV or op == Op.MOD:
        rhs = e.args[1]
        if rhs.op == Op.CONST and rhs.value != 0:
            return f"({a[0]} {'//' if op == Op.DIV else '%'} {a[1]})"
        return f"{'_div' if op == Op.DIV else '_mod'}({a[0]}, {a[1]})"
    return f"({a[0]} {_PY_BINARY[op]} {a[1]})"


_COMPILED: dict[tuple[Expr, tuple[str, ...]], Callable[..., int]] = memo.cache()


def compile_expr(e: Expr, variables: tuple[str, ...]) -> Callable[..., int]:
    """``e`` as a Python function of ``variables`` (positional), built once per (e, variables).

    Same results as :func:`evaluate` (booleans come back as ``bool``, an ``int``); unbound names and
    division by zero raise :class:`EvalError` when evaluated.

    >>> f = compile_expr(Expr(Op.ADD, (Expr.var("x"), Expr.const(1))), ("x",))
    >>> f(41)
    42
    """
    key = (e, variables)
    fn = _COMPILED.get(key)
    if fn is None:
        names = {v: f"_a{i}" for i, v in enumerate(variables)}
        src = f"lambda {', '.join(names.values())}: {_py(e, names)}"
        try:
            fn = eval(src, {"_div": _div, "_mod": _mod, "_unbound": _unbound})
        except (RecursionError, SyntaxError, MemoryError):  # absurdly deep: interpret instead
            order = variables

            def fn(*vals: int, _e: Expr = e) -> int:
                return evaluate(_e, dict(zip(order, vals)))

        if len(_COMPILED) > 50_000:
            _COMPILED.clear()
        _COMPILED[key] = fn
    return fn
