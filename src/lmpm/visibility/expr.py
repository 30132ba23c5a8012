"""IR expressions evaluated on torch integer tensors (or plain ints, folded where possible).

One evaluator serves every consumer: the stencil expansion (tensors over all target cells), the
generated ``mask_mod`` (0-d tensors under ``vmap``) and constant folding (plain ints). It never
branches on tensor data, so it traces under ``vmap`` and ``torch.compile``.

Semantics match :func:`lmpm.ir.eval.evaluate`: ``DIV`` is floor division and ``MOD`` takes the sign
of the divisor (torch's ``//`` and ``%`` on integer tensors do exactly that). Booleans are 0/1.
A division by zero that depends on a cell makes the expression *undefined* at that cell: the
divisor is replaced by 1 and ``divisor != 0`` is appended to ``defined``, which callers AND into the
clause (an undefined index selects nothing). A division by a constant zero is a :class:`BindError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

import torch
from torch import Tensor

from lmpm.errors import BindError
from lmpm.ir.nodes import Expr, Op

# An evaluated expression: a python int/bool (constant) or an integer/bool tensor.
Val = Union[int, bool, Tensor]  # noqa: UP007 - used at run time in isinstance-free code


def _int(x: Val) -> Val:
    """Booleans used in arithmetic become 0/1 integers."""
    if isinstance(x, Tensor) and x.dtype == torch.bool:
        return x.long()
    if isinstance(x, bool):
        return int(x)
    return x


def _bool(x: Val) -> Val:
    if isinstance(x, Tensor):
        return x if x.dtype == torch.bool else x != 0
    return bool(x)


def and_(a: Val, b: Val) -> Val:
    """Logical and that folds constants (``True and t`` is ``t``)."""
    a, b = _bool(a), _bool(b)
    if not isinstance(a, Tensor):
        return b if a else False
    if not isinstance(b, Tensor):
        return a if b else False
    return a & b


def not_(a: Val) -> Val:
    a = _bool(a)
    return ~a if isinstance(a, Tensor) else not a


def or_(a: Val, b: Val) -> Val:
    a, b = _bool(a), _bool(b)
    if not isinstance(a, Tensor):
        return True if a else b
    if not isinstance(b, Tensor):
        return True if b else a
    return a | b


def evaluate(e: Expr, env: Mapping[str, Val], defined: list[Val] | None = None) -> Val:
    """Evaluate ``e``; names are looked up in ``env`` (params, target vars, binder vars)."""
    op = e.op
    if op == Op.CONST:
        assert isinstance(e.value, int)
        return e.value
    if op in (Op.VAR, Op.PARAM):
        assert isinstance(e.value, str)
        try:
            return env[e.value]
        except KeyError:
            raise BindError(
                f"`{e.value}` has no value in a visibility clause",
                hint=f"bind it with --set {e.value}=...",
                code="B010",
            ) from None
    if op == Op.NEG:
        return -_int(evaluate(e.args[0], env, defined))
    if op == Op.NOT:
        x = _bool(evaluate(e.args[0], env, defined))
        return ~x if isinstance(x, Tensor) else not x
    if op == Op.AND:
        return and_(evaluate(e.args[0], env, defined), evaluate(e.args[1], env, defined))
    if op == Op.OR:
        return or_(evaluate(e.args[0], env, defined), evaluate(e.args[1], env, defined))
    a = _int(evaluate(e.args[0], env, defined))
    b = _int(evaluate(e.args[1], env, defined))
    match op:
        case Op.ADD:
            return a + b
        case Op.SUB:
            return a - b
        case Op.MUL:
            return a * b
        case Op.DIV | Op.MOD:
            if isinstance(b, Tensor):
                ok = b != 0
                if defined is not None:
                    defined.append(ok)
                b = torch.where(ok, b, torch.ones_like(b))
            elif b == 0:
                raise BindError("division by zero in a visibility clause", code="B011")
            return a // b if op == Op.DIV else a % b
        case Op.LT:
            return a < b
        case Op.LE:
            return a <= b
        case Op.GT:
            return a > b
        case Op.GE:
            return a >= b
        case Op.EQ:
            return a == b
        case Op.NE:
            return a != b
    raise AssertionError(f"unknown op {op}")


def all_defined(defined: list[Val]) -> Val:
    out: Val = True
    for d in defined:
        out = and_(out, d)
    return out


# ---- host bounds: what an expression can be, known without reading a tensor -----------------
Span = tuple[int, int]  # inclusive [min, max]
# An affine form: a constant plus integer multiples of atoms. An atom is a variable (by name) or a
# non-affine subexpression (by its Expr), with a span. Equal atoms cancel: (x+2) - (x-2) is 4.
Form = tuple[int, dict[object, int]]


def bounds(e: Expr, spans: Mapping[str, Span]) -> Span | None:
    """The inclusive span of ``e`` over every assignment of its names within ``spans``
    (target variables: their axis; params and binder values: one point), or None when unknown.

    Sound, not always tight: a builder sizes its tensors with it, so no tensor is read on the host
    (a GPU would wait for it).

    >>> from lmpm.ir.nodes import Expr, Op
    >>> x = Expr.var("x")
    >>> bounds(Expr(Op.SUB, (Expr(Op.ADD, (x, Expr.const(2))), x)), {"x": (0, 63)})
    (2, 2)
    """
    return difference(e, None, spans)


def difference(hi: Expr, lo: Expr | None, spans: Mapping[str, Span]) -> Span | None:
    """The span of ``hi - lo`` (of ``hi`` when ``lo`` is None); shared names cancel."""
    atoms: dict[object, Span] = {}
    a = _affine(hi, spans, atoms)
    if a is None:
        return None
    if lo is not None:
        b = _affine(lo, spans, atoms)
        if b is None:
            return None
        a = _add(a, b, -1)
    return _span(a, atoms)


# ``e`` as ``const + sum(coef * variable)`` over plain variables (python ints elsewhere).
Linear = tuple[int, tuple[tuple[str, int], ...]]


def linear(e: Expr, spans: Mapping[str, Span]) -> Linear | None:
    """``e`` as a constant plus integer multiples of the variables that ``spans`` does not fix
    (None when it is not of that form): ``x + dx - 1`` with ``dx = 1`` is ``(0, (("x", 1),))``.
    Boxes of one clause differ in such constants only, so their positions share one tensor.

    >>> from lmpm.ir.nodes import Expr, Op
    >>> linear(Expr(Op.ADD, (Expr.var("x"), Expr.var("d"))), {"x": (0, 9), "d": (-1, -1)})
    (-1, (('x', 1),))
    """
    atoms: dict[object, Span] = {}
    form = _affine(e, spans, atoms)
    if form is None:
        return None
    terms: list[tuple[str, int]] = []
    for k, c in form[1].items():
        if not (isinstance(k, Expr) and k.op == Op.VAR):
            return None  # a non-affine part (x / 8)
        terms.append((str(k.value), c))
    return form[0], tuple(sorted(terms))


def _add(a: Form, b: Form, sign: int = 1) -> Form:
    terms = dict(a[1])
    for k, c in b[1].items():
        terms[k] = terms.get(k, 0) + sign * c
    return a[0] + sign * b[0], {k: c for k, c in terms.items() if c}


def _span(f: Form, atoms: Mapping[object, Span]) -> Span:
    lo = hi = f[0]
    for k, c in f[1].items():
        a, b = atoms[k]
        lo += min(c * a, c * b)
        hi += max(c * a, c * b)
    return lo, hi


def _atom(e: Expr, span: Span | None, atoms: dict[object, Span]) -> Form | None:
    if span is None:
        return None
    if span[0] == span[1]:
        return span[0], {}
    atoms[e] = span
    return 0, {e: 1}


def _affine(e: Expr, spans: Mapping[str, Span], atoms: dict[object, Span]) -> Form | None:
    op = e.op
    if op == Op.CONST:
        assert isinstance(e.value, int)
        return e.value, {}
    if op in (Op.VAR, Op.PARAM):
        span = spans.get(str(e.value))
        return None if span is None else _atom(e, span, atoms)
    if op == Op.NEG:
        a = _affine(e.args[0], spans, atoms)
        return None if a is None else _add((0, {}), a, -1)
    if op in (Op.NOT, Op.AND, Op.OR):
        return _atom(e, (0, 1), atoms)  # a boolean: 0 or 1
    a = _affine(e.args[0], spans, atoms)
    b = _affine(e.args[1], spans, atoms)
    if a is None or b is None:
        return None
    if not a[1] and not b[1]:  # two constants: the value itself
        if op in (Op.DIV, Op.MOD) and b[0] == 0:
            return None
        value = evaluate(Expr(op, (Expr.const(a[0]), Expr.const(b[0]))), {})
        assert not isinstance(value, Tensor)
        return int(value), {}
    if op in (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE):
        return _atom(e, (0, 1), atoms)  # a boolean: 0 or 1
    if op in (Op.ADD, Op.SUB):
        return _add(a, b, 1 if op == Op.ADD else -1)
    if op == Op.MUL and (not a[1] or not b[1]):
        k, f = (a[0], b) if not a[1] else (b[0], a)
        return k * f[0], {n: k * c for n, c in f[1].items() if k * c}
    sa, sb = _span(a, atoms), _span(b, atoms)
    if op == Op.MUL:
        corners = [x * y for x in sa for y in sb]
        return _atom(e, (min(corners), max(corners)), atoms)
    if sb[0] <= 0 <= sb[1]:
        return None  # a divisor that may be 0 (the cell is then undefined)
    if op == Op.DIV:
        corners = [x // y for x in sa for y in sb]
        return _atom(e, (min(corners), max(corners)), atoms)
    # MOD by a divisor of one sign: within [0, |d|-1] (or [-(|d|-1), 0]); itself when already so.
    m = max(abs(sb[0]), abs(sb[1]))
    if sb[0] > 0:
        return a if sb[0] == sb[1] and sa[0] >= 0 and sa[1] < sb[0] else _atom(e, (0, m - 1), atoms)
    return _atom(e, (-(m - 1), 0), atoms)
