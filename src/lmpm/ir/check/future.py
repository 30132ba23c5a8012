"""Future reads: `forbid read_future(V[...])` is proved or refuted from the `visible` clauses
(E204); the constraint leaves the check with its status decided."""

from __future__ import annotations

import itertools
from dataclasses import replace

from lmpm.ir import memo
from lmpm.ir.check.facts import Facts
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.nodes import Axis, AxisKind, Constraint, Op, PredKind, ShapeKind, Status, Value
from lmpm.ir.probe import Compiled, probe_indices, shape_of

_Hit = tuple[tuple[int, ...], tuple[int, ...]] | None  # (probe cell, the later source cell)
# per clause structure, shared by every check
_FUTURE: dict[tuple[object, ...], _Hit] = memo.cache()


def check_future(f: Facts, c: Constraint) -> Constraint:
    """``c`` with its status: refuted or proved when it is a `read_future` constraint."""
    if c.pred != PredKind.READ_FUTURE or c.access is None:
        return c
    target = f.values[c.access.value]
    tgt = f.dims.get(target.name)
    if tgt is None or target.shape not in (ShapeKind.SEQ, ShapeKind.GRID3D):
        f.sink.error(
            "E204",
            f"`read_future` needs a value with a time axis (Seq or Grid3D); "
            f"`{target.name}` is {target.shape.value}",
            c.access.span,
        )
        return replace(c, status=Status.REFUTED)
    cover = shape_of(target.axis_names, c.access.axes, (), None, f.env, tgt)
    for s in f.by_target.get(target.name, ()):
        if not _time_aligned(target, f.values[s.source]):
            continue
        sc = f.stencil(s)
        if sc is None:
            continue
        key = ("future", cover.axes, sc.shape, tgt)
        if key in _FUTURE:
            hit = _FUTURE[key]
        else:
            hit = _FUTURE[key] = _reads_later(cover.axes, sc, tgt)
        if hit is not None:
            cell, later = hit
            t = target.axis_names[0]
            f.sink.error(
                "E204",
                f"constraint `{c.name}` (forbid read_future) is refuted: this clause lets "
                f"{target.name}[{', '.join(map(str, cell))}] read "
                f"{s.source}[{', '.join(map(str, later))}], a later {t}",
                s.span,
                f"restrict the clause to earlier {t} (e.g. `when` or an index ≤ {t}), or drop "
                f"`{c.name}`",
            )
            return replace(c, status=Status.REFUTED)
    if c.kind == "forbid":
        return replace(c, status=Status.PROVED)
    return c


def _time_aligned(target: Value, source: Value) -> bool:
    if source.name == target.name:
        return True
    if source.shape not in (ShapeKind.SEQ, ShapeKind.GRID3D):
        return False
    return source.shape == target.shape or source.dims[0] == target.dims[0]


def _cover_axes(axes: tuple[Axis, ...], dims: tuple[int, ...]) -> dict[int, list[int]]:
    """Target axes a constraint's access restricts, with their in-bounds endpoints as extra probes."""
    out: dict[int, list[int]] = {}
    k = 0
    for ax in axes:
        if ax.kind in (AxisKind.ALL, AxisKind.REGION):
            k += ax.width
            continue
        if not (ax.kind == AxisKind.AT and ax.lo is not None and ax.lo.op == Op.VAR):
            picks = []
            for e in (ax.lo, ax.hi):
                if e is not None and e.op == Op.CONST and isinstance(e.value, int):
                    picks.append(e.value)
            out[k] = [i for i in picks if 0 <= i < dims[k]] if k < len(dims) else []
        k += 1
    return out


def _covers(axes: tuple[Axis, ...], cell: tuple[int, ...]) -> bool:
    """Whether a constraint's (folded) access includes ``cell``; pattern variables match anything."""
    k = 0
    for ax in axes:
        if ax.kind in (AxisKind.ALL, AxisKind.REGION):
            k += ax.width
            continue
        if ax.kind == AxisKind.AT and ax.lo is not None and ax.lo.op == Op.VAR:
            k += 1
            continue
        try:
            if ax.kind == AxisKind.AT:
                assert ax.lo is not None
                if evaluate(ax.lo, {}) != cell[k]:
                    return False
            else:
                assert ax.lo is not None and ax.hi is not None
                if not evaluate(ax.lo, {}) <= cell[k] <= evaluate(ax.hi, {}):
                    return False
        except EvalError:
            pass
        k += 1
    return True


def _reads_later(cover: tuple[Axis, ...], sc: Compiled, tgt: tuple[int, ...]) -> _Hit:
    """A covered probe cell from which the clause reads a later index on the time axis."""
    extra = _cover_axes(cover, tgt)
    relevant = set(sc.relevant_axes()) | {0} | set(extra)
    axes = [
        sorted(set(probe_indices(n)) | set(extra.get(k, ()))) if k in relevant else [n // 2]
        for k, n in enumerate(tgt)
    ]
    for cell in itertools.product(*axes):
        if not _covers(cover, cell):
            continue
        try:
            cells = sc.cells(cell)
        except EvalError:
            continue
        later = min((x for x in cells if x[0] > cell[0]), default=None)
        if later is not None:
            return cell, later
    return None
