"""Firing: a rule whose `on ... when` guard is false at every probed cell (and epoch) can never
fire (W205). Guards that use the epoch `e` are probed over :data:`PROBE_EPOCHS`."""

from __future__ import annotations

from lmpm.ir import memo
from lmpm.ir.check.facts import Facts, axes_using, vars_of
from lmpm.ir.eval import EvalError, compile_expr, fold, names_in
from lmpm.ir.nodes import Expr, Op, Rule
from lmpm.ir.probe import probe_cells

# Epochs at which a guard using the epoch `e` is probed: a rule guarded by `e >= 3` fires later.
PROBE_EPOCHS = (0, 1, 2, 3, 4, 5, 7, 8, 10, 16, 32, 64, 100, 1000, 10**6)

# per guard structure, shared by every check
_FIRES: dict[tuple[object, ...], bool] = memo.cache()


def trigger(f: Facts, r: Rule) -> Expr:
    """The rule's `when` guard with the parameters bound."""
    return fold(r.trigger, f.env)


def check_firing(f: Facts, r: Rule) -> None:
    tgt = f.dims[r.target]
    trig = trigger(f, r)
    key = ("fires", r.vars, trig, tgt)
    fires = _FIRES.get(key)
    if fires is None:
        fires = _FIRES[key] = _firing(r.vars, trig, tgt, axes_using(r.vars, vars_of(trig)))
    if not fires:
        f.sink.warning(
            "W205",
            f"rule `{r.name}` can never fire: its `on ... when` guard is "
            "false at every probed cell" + (" and epoch" if epochs_of(trig) != (0,) else ""),
            f.ast_guards.get(r.name, r.span),
        )


def _firing(
    vars_: tuple[str, ...], trig: Expr, tgt: tuple[int, ...], relevant: frozenset[int]
) -> bool:
    if trig == Expr.const(1):
        return True
    fn = compile_expr(trig, (*vars_, "e"))
    epochs = epochs_of(trig)
    return any(fires_at(fn, cell, epochs) for cell in probe_cells(tgt, relevant))


def epochs_of(guard: Expr) -> tuple[int, ...]:
    """The epochs to probe ``guard`` at: only epoch 0 unless it uses the epoch variable `e`."""
    uses_e = any(op == Op.VAR and n == "e" for op, n in names_in(guard))
    return PROBE_EPOCHS if uses_e else (0,)


def fires_at(trig: object, cell: tuple[int, ...], epochs: tuple[int, ...]) -> bool:
    for ep in epochs:
        try:
            if trig(*cell, ep):  # type: ignore[operator]
                return True
        except EvalError:
            continue
    return False
