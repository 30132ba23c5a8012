"""Visibility of reads: every cell a rule reads must be visible to the cell it proposes for (E201),
decided by probing the read and the `visible` clauses at the probe cells where the rule fires."""

from __future__ import annotations

from lmpm.ir import memo
from lmpm.ir.check.facts import Facts, axes_using, vars_of
from lmpm.ir.check.firing import epochs_of, fires_at, trigger
from lmpm.ir.eval import EvalError, compile_expr
from lmpm.ir.nodes import Expr, Read, ReadKind, Rule
from lmpm.ir.printer import axis_str, binder_str, read_str
from lmpm.ir.probe import Compiled, probe_cells

_Hit = tuple[tuple[int, ...], tuple[int, ...]] | None  # (probe cell, offending source cell)
# per read and clause structure, shared by every check
_READS: dict[tuple[object, ...], _Hit] = memo.cache()


def check_reads(f: Facts, r: Rule) -> None:
    tgt = f.dims[r.target]
    trig = trigger(f, r)
    tvars = vars_of(trig)
    for rd in r.reads:
        if rd.source not in f.dims:
            continue
        if rd.kind == ReadKind.VISIBLE:
            if (r.target, rd.source) not in f.into:
                f.sink.error(
                    "E201",
                    f"rule `{r.name}` reads `{rd.source}`, but no `visible` "
                    f"clause lets `{r.target}` see `{rd.source}`",
                    rd.span,
                    f"add `visible {pattern(r)} <- {rd.source}[...]`",
                )
            continue
        want = f.shape(r.vars, rd.axes, rd.binders, None, rd.source)
        have = tuple(
            c for s in f.into.get((r.target, rd.source), ()) if (c := f.stencil(s)) is not None
        )
        key = ("read", trig, want.shape, tuple(h.shape for h in have), tgt)
        if key in _READS:
            miss = _READS[key]
        else:
            miss = _READS[key] = _uncovered(r.vars, trig, tvars, want, have, tgt)
        if miss is not None:
            cell, bad = miss
            at = f"{r.target}[{', '.join(map(str, cell))}]"
            f.sink.error(
                "E201",
                f"rule `{r.name}` reads `{read_str(rd)}`, which is not visible to "
                f"`{pattern(r)}`: e.g. {at} would read {rd.source}[{', '.join(map(str, bad))}]",
                rd.span,
                f"add a clause: `{_clause(r, rd)}`",
            )


def _clause(r: Rule, rd: Read) -> str:
    """The `visible` clause (source syntax) that makes read ``rd`` of rule ``r`` visible."""
    when = [binder_str(b) for b in rd.binders]
    if rd.kind == ReadKind.PREV:
        when.append(f"{r.vars[0]} > 0")
    src = f"{rd.source}[{', '.join(axis_str(a) for a in rd.axes)}]"
    return f"visible {pattern(r)} <- {src}" + (f" when {' and '.join(when)}" if when else "")


def pattern(r: Rule) -> str:
    return f"{r.target}[{','.join(r.vars)}]" if r.vars else r.target


def _uncovered(
    vars_: tuple[str, ...],
    trig: Expr,
    tvars: set[str],
    want: Compiled,
    have: tuple[Compiled, ...],
    tgt: tuple[int, ...],
) -> _Hit:
    """A probe cell where the read wants a cell no clause makes visible, and that cell; or None."""
    relevant = set(want.relevant_axes()) | axes_using(vars_, tvars)
    for h in have:
        relevant |= h.relevant_axes()
    fn = compile_expr(trig, (*vars_, "e"))
    epochs = epochs_of(trig)
    for cell in probe_cells(tgt, frozenset(relevant)):
        if not fires_at(fn, cell, epochs):
            continue
        try:
            wanted = want.cells(cell)
        except EvalError:
            continue
        if not wanted:
            continue
        visible: set[tuple[int, ...]] = set()
        for h in have:
            try:
                visible |= h.cells(cell)
            except EvalError:
                continue
        if not wanted <= visible:
            return cell, min(wanted - visible)
    return None
