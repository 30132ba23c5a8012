"""Host bounds of index expressions (``lmpm.visibility.expr.bounds``): the static BlockMask build
sizes its tensors with them, so they must contain every value the expression takes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from lmpm.ir.eval import evaluate as eval_int
from lmpm.ir.nodes import Expr, Op
from lmpm.visibility.expr import bounds, difference

NAMES = ("x", "y", "P")
ARITH = (Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MOD)
COMPARE = (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE)


@st.composite
def exprs(draw: st.DrawFn, depth: int = 3) -> Expr:
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        if draw(st.booleans()):
            return Expr.var(draw(st.sampled_from(NAMES)))
        return Expr.const(draw(st.integers(-4, 6)))
    op = draw(st.sampled_from((*ARITH, *COMPARE, Op.NEG, Op.AND, Op.NOT)))
    if op in (Op.NEG, Op.NOT):
        return Expr(op, (draw(exprs(depth - 1)),))
    return Expr(op, (draw(exprs(depth - 1)), draw(exprs(depth - 1))))


def _values(e: Expr, env: dict[str, tuple[int, int]]) -> list[int] | None:
    """Every value of ``e`` over the names' ranges; None where a division by zero happens."""
    out = []
    names = sorted(env)
    for point in itertools.product(*(range(env[n][0], env[n][1] + 1) for n in names)):
        try:
            out.append(int(eval_int(e, dict(zip(names, point)))))
        except Exception:  # a division by zero: the cell is undefined, bounds say nothing
            return None
    return out


SPANS = st.fixed_dictionaries(
    {
        "x": st.tuples(st.integers(0, 0), st.integers(0, 5)),
        "y": st.tuples(st.integers(0, 0), st.integers(0, 3)),
        "P": st.integers(-2, 4).map(lambda p: (p, p)),
    }
)


@settings(max_examples=300)
@given(exprs(), SPANS)
def test_bounds_contain_every_value(e: Expr, spans: dict[str, tuple[int, int]]) -> None:
    span = bounds(e, spans)
    values = _values(e, spans)
    if span is None or values is None:
        return
    assert span[0] <= min(values) and max(values) <= span[1], (e, spans, span)


@settings(max_examples=300)
@given(exprs(), exprs(), SPANS)
def test_difference_contains_every_difference(
    hi: Expr, lo: Expr, spans: dict[str, tuple[int, int]]
) -> None:
    span = difference(hi, lo, spans)
    values = _values(Expr(Op.SUB, (hi, lo)), spans)
    if span is None or values is None:
        return
    assert span[0] <= min(values) and max(values) <= span[1], (hi, lo, spans, span)


def test_shared_names_cancel() -> None:
    """``x-2..x+2`` spans 5 cells whatever x: the build enumerates 5 slots, not the axis."""
    x = Expr.var("x")
    lo, hi = Expr(Op.SUB, (x, Expr.const(2))), Expr(Op.ADD, (x, Expr.const(2)))
    assert difference(hi, lo, {"x": (0, 1000)}) == (4, 4)
    assert bounds(Expr(Op.DIV, (x, Expr.const(8))), {"x": (0, 63)}) == (0, 7)
    assert bounds(Expr(Op.DIV, (x, Expr.var("y"))), {"x": (0, 9), "y": (-1, 1)}) is None
