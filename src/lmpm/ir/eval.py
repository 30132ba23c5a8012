"""Plain-integer evaluation of IR expressions and stencils (no torch).

Used by the checker (probing clauses at concrete cells) and to bind parameters. The vectorized
versions live in :mod:`lmpm.visibility`; these are the small, obviously-correct ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

from lmpm.errors import BindError
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
