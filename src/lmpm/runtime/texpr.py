"""IR expressions evaluated over tensors of coordinates (vectorized guards, masks, triggers)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lmpm.ir.nodes import Expr, Op

Scalar = int | Tensor


def eval_tensor(e: Expr, env: Mapping[str, Scalar]) -> Scalar:
    """Evaluate ``e`` with each name bound to an int or an int64 tensor (broadcasting).

    Booleans come back as bool tensors (or Python ints 0/1 when everything is scalar).
    """
    op = e.op
    if op == Op.CONST:
        assert isinstance(e.value, int)
        return e.value
    if op in (Op.VAR, Op.PARAM):
        assert isinstance(e.value, str)
        return env[e.value]
    if op == Op.NEG:
        return -eval_tensor(e.args[0], env)
    if op == Op.NOT:
        return ~_bool(eval_tensor(e.args[0], env))
    a = eval_tensor(e.args[0], env)
    b = eval_tensor(e.args[1], env)
    match op:
        case Op.ADD:
            return a + b
        case Op.SUB:
            return a - b
        case Op.MUL:
            return a * b
        case Op.DIV:
            return a // b  # floor division, for ints and tensors alike
        case Op.MOD:
            return a % b
        case Op.AND:
            return _bool(a) & _bool(b)
        case Op.OR:
            return _bool(a) | _bool(b)
        case Op.LT:
            return _cmp(a < b)
        case Op.LE:
            return _cmp(a <= b)
        case Op.GT:
            return _cmp(a > b)
        case Op.GE:
            return _cmp(a >= b)
        case Op.EQ:
            return _cmp(a == b)
        case Op.NE:
            return _cmp(a != b)
    raise AssertionError(op)


def _bool(x: Scalar | bool) -> Tensor:
    if isinstance(x, Tensor):
        return x.bool()
    return torch.tensor(bool(x))


def _cmp(x: Tensor | bool) -> Tensor:
    return x if isinstance(x, Tensor) else torch.tensor(bool(x))


def mask_of(e: Expr, env: Mapping[str, Scalar], n: int) -> Tensor:
    """A bool mask of shape (n,) from a guard (broadcasting scalars)."""
    out = eval_tensor(e, env)
    if not isinstance(out, Tensor):
        out = torch.tensor(bool(out))
    return out.bool().expand(n).clone() if out.dim() == 0 else out.bool()


def coords(dims: tuple[int, ...]) -> Tensor:
    """Row-major coordinates of every cell, shape (cells, rank), int64."""
    if not dims:
        return torch.zeros(1, 0, dtype=torch.int64)
    grids = torch.meshgrid(*(torch.arange(d, dtype=torch.int64) for d in dims), indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], dim=1)
