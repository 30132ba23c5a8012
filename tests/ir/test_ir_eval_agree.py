"""One expression semantics: the three evaluators of IR expressions agree on random expressions.

- :func:`lmpm.ir.eval.evaluate` (the checker, constant folding) and its compiled form
  :func:`lmpm.ir.eval.compile_expr` (the probes),
- :func:`lmpm.visibility.expr.evaluate` on plain ints (folding in the visibility compiler) and on
  tensors of cells (stencils, ``mask_mod``, the runtime's triggers via :mod:`lmpm.runtime.data.texpr`).

Division by zero: the int evaluators raise; the tensor evaluator marks the cell undefined.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpm.errors import BindError
from lmpm.ir.eval import EvalError, compile_expr, evaluate
from lmpm.ir.nodes import Expr, Op
from lmpm.runtime.data.texpr import mask_of
from lmpm.visibility import expr

BIN = [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MOD, Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE]
BIN += [Op.AND, Op.OR]
VARS = ("x", "y")

leaves = st.one_of(
    st.integers(-6, 6).map(Expr.const),
    st.sampled_from(VARS).map(Expr.var),
    st.just(Expr.param("P")),
)


def _extend(children: st.SearchStrategy[Expr]) -> st.SearchStrategy[Expr]:
    return st.one_of(
        st.tuples(st.sampled_from(BIN), children, children).map(lambda t: Expr(t[0], (t[1], t[2]))),
        children.map(lambda c: Expr(Op.NEG, (c,))),
        children.map(lambda c: Expr(Op.NOT, (c,))),
    )


exprs = st.recursive(leaves, _extend, max_leaves=12)
POINTS = [(x, y) for x in range(-3, 4) for y in range(-3, 4)]


def _int_eval(e: Expr, env: dict[str, int]) -> int | None:
    try:
        return int(evaluate(e, env))
    except EvalError:
        return None


@settings(max_examples=300, deadline=None)
@given(exprs, st.integers(-4, 4))
def test_the_evaluators_agree(e: Expr, p: int) -> None:
    compiled = compile_expr(e, ("x", "y", "P"))
    xs = torch.tensor([pt[0] for pt in POINTS])
    ys = torch.tensor([pt[1] for pt in POINTS])
    defined: list[expr.Val] = []
    try:
        tensor = expr.evaluate(e, {"x": xs, "y": ys, "P": p}, defined)
    except BindError:  # a division by a constant zero: the int evaluators fail at every point
        tensor = None
    ok = expr.all_defined(defined)
    for k, (x, y) in enumerate(POINTS):
        env = {"x": x, "y": y, "P": p}
        want = _int_eval(e, env)
        try:
            got_compiled: int | None = int(compiled(x, y, p))
        except EvalError:
            got_compiled = None
        assert got_compiled == want
        try:
            got_plain: int | None = int(expr.evaluate(e, env))  # type: ignore[call-overload]
        except BindError:
            got_plain = None
        if want is not None:
            # ir.eval short-circuits `and`/`or`; the plain-int visibility evaluator may then
            # still divide by zero on the skipped side. Where both are defined they agree.
            assert got_plain in (want, None)
        if tensor is None:
            continue
        cell_ok = bool(ok[k]) if isinstance(ok, torch.Tensor) else bool(ok)
        if want is None:
            assert not cell_ok, "a division by zero is undefined in the tensor evaluator"
        elif cell_ok:
            value = tensor[k] if isinstance(tensor, torch.Tensor) and tensor.dim() else tensor
            assert int(value) == want


@settings(max_examples=100, deadline=None)
@given(exprs)
def test_runtime_masks_are_the_guards_truth(e: Expr) -> None:
    """lmpm.runtime.data.texpr.mask_of (triggers, constraint cells) = bool of ir.eval where defined."""
    xs = torch.tensor([pt[0] for pt in POINTS])
    ys = torch.tensor([pt[1] for pt in POINTS])
    try:
        mask = mask_of(e, {"x": xs, "y": ys, "P": 1}, len(POINTS))
    except BindError:
        return
    defined: list[expr.Val] = []
    expr.evaluate(e, {"x": xs, "y": ys, "P": 1}, defined)
    ok = expr.all_defined(defined)
    for k, (x, y) in enumerate(POINTS):
        want = _int_eval(e, {"x": x, "y": y, "P": 1})
        cell_ok = bool(ok[k]) if isinstance(ok, torch.Tensor) else bool(ok)
        if want is not None and cell_ok:
            assert bool(mask[k]) == bool(want)
