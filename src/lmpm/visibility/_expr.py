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
