"""Clauses compiled for probing: the checker's fast, cached evaluation of accesses at probe cells.

An access (a `visible` clause, a rule read, a constraint's cells) is folded with the bound parameters,
its index expressions are compiled to Python closures (:func:`lmpm.ir.eval.compile_expr`), and the
facts the checker derives from it are cached per *structure*: the folded axes, binders and guard with
the concrete dims, without names or spans. Programs repeat clause structures (every causal mask, every
N8 neighbourhood), so each distinct structure is probed once per process.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lmpm.ir import memo
from lmpm.ir.eval import EvalError, compile_expr, fold
from lmpm.ir.nodes import NEIGHBORHOODS, TRUE, Axis, AxisKind, Binder, Expr, Op

Cell = tuple[int, ...]

# Accesses bigger than this at one probe cell are not enumerated (the checks that need them are
# skipped for that cell): a check must stay instant even for a Seq(10**9).
MAX_PROBE_CELLS = 200_000


def probe_indices(n: int) -> list[int]:
    """Indices probed on an axis of size ``n``: both edges (where clauses change behaviour) and the
    middle."""
    picks = {0, 1, 2, n // 2, n - 3, n - 2, n - 1}
    return sorted(i for i in picks if 0 <= i < n)


def probe_cells(dims: tuple[int, ...], relevant: frozenset[int] | None = None) -> list[Cell]:
    """Probe cells of a value; axes not in ``relevant`` (when given) are pinned to their middle,
    because nothing being probed depends on them."""
    axes = [
        probe_indices(n) if relevant is None or k in relevant else [n // 2]
        for k, n in enumerate(dims)
    ]
    return list(itertools.product(*axes))


def _vars(e: Expr | None, out: set[str]) -> None:
    stack = [e] if e is not None else []
    while stack:
        x = stack.pop()
        if x.op == Op.VAR:
            assert isinstance(x.value, str)
            out.add(x.value)
        stack.extend(x.args)


@dataclass(frozen=True, slots=True)
class Shape:
    """The computation-relevant structure of an access: hashable, with no names or spans."""

    vars: tuple[str, ...]  # the target's index variables
    axes: tuple[Axis, ...]  # folded; REGION axes lose their call (they cover their axes)
    binders: tuple[Binder, ...]
    guard: Expr
    dims: tuple[int, ...]  # of the source value


def shape_of(
    vars_: tuple[str, ...],
    axes: tuple[Axis, ...],
    binders: tuple[Binder, ...],
    guard: Expr | None,
    env: Mapping[str, int],
    dims: tuple[int, ...],
) -> Shape:
    faxes = tuple(
        Axis(AxisKind.REGION, width=a.width)
        if a.kind == AxisKind.REGION
        else Axis(
            a.kind,
            fold(a.lo, env) if a.lo is not None else None,
            fold(a.hi, env) if a.hi is not None else None,
            None,
            a.width,
        )
        for a in axes
    )
    fbinders = tuple(
        Binder(
            b.vars,
            b.neighborhood,
            fold(b.lo, env) if b.lo is not None else None,
            fold(b.hi, env) if b.hi is not None else None,
        )
        for b in binders
    )
    fguard = fold(guard, env) if guard is not None else TRUE
    return Shape(vars_, faxes, fbinders, fguard, dims)


class Compiled:
    """One :class:`Shape`, ready to list its source cells at a target cell."""

    def __init__(self, s: Shape) -> None:
        self.shape = s
        bvars = tuple(v for b in s.binders for v in b.vars)
        order = s.vars + bvars
        self.order = order
        self.binder_vars = frozenset(bvars)
        used: set[str] = set()
        for a in s.axes:
            _vars(a.lo, used)
            _vars(a.hi, used)
        for b in s.binders:
            _vars(b.lo, used)
            _vars(b.hi, used)
        _vars(s.guard, used)
        self.used = frozenset(used)
        self.guard: Callable[..., int] | None = (
            None if s.guard == TRUE else compile_expr(s.guard, order)
        )
        # The guard without binder variables, for bounds probing (None: it uses binder variables).
        gvars: set[str] = set()
        _vars(s.guard, gvars)
        self.target_guard = (
            compile_expr(s.guard, s.vars) if not (gvars & self.binder_vars) else None
        )
        self.axes: list[tuple[AxisKind, Callable[..., int] | None, Callable[..., int] | None, int]]
        self.axes = [
            (
                a.kind,
                compile_expr(a.lo, order) if a.lo is not None else None,
                compile_expr(a.hi, order) if a.hi is not None else None,
                a.width,
            )
            for a in s.axes
        ]
        self.binders: list[Callable[[Cell], list[Cell]]] = [self._binder(b) for b in s.binders]

    def _binder(self, b: Binder) -> Callable[[Cell], list[Cell]]:
        if b.neighborhood is not None:
            offsets = list(NEIGHBORHOODS[b.neighborhood])
            return lambda cell: offsets
        assert b.lo is not None and b.hi is not None
        lo = compile_expr(b.lo, self.shape.vars)
        hi = compile_expr(b.hi, self.shape.vars)

        def values(cell: Cell) -> list[Cell]:
            a, b_ = lo(*cell), hi(*cell)
            if b_ - a >= MAX_PROBE_CELLS:
                raise EvalError(f"a binder range of more than {MAX_PROBE_CELLS} values")
            return [(v,) for v in range(a, b_ + 1)]

        return values

    def relevant_axes(self) -> set[int]:
        """Target axes whose index variable this access uses."""
        return {k for k, v in enumerate(self.shape.vars) if v in self.used}

    def cells(self, cell: Cell) -> set[Cell]:
        """Source cells visible from ``cell`` (out-of-bounds indices dropped). Raises EvalError."""
        dims = self.shape.dims
        out: set[Cell] = set()
        combos = itertools.product(*(b(cell) for b in self.binders)) if self.binders else [()]
        for combo in combos:
            args = cell + tuple(itertools.chain.from_iterable(combo))
            if self.guard is not None and not self.guard(*args):
                continue
            ranges: list[range | list[int]] = []
            k = 0
            for kind, lo, hi, width in self.axes:
                if kind == AxisKind.REGION:
                    for _ in range(width):
                        ranges.append(range(dims[k]))
                        k += 1
                    continue
                n = dims[k]
                if kind == AxisKind.ALL:
                    ranges.append(range(n))
                elif kind == AxisKind.AT:
                    assert lo is not None
                    i = lo(*args)
                    if not 0 <= i < n:
                        break
                    ranges.append((i,))  # type: ignore[arg-type]
                else:
                    assert lo is not None and hi is not None
                    a, b = max(lo(*args), 0), min(hi(*args), n - 1)
                    if a > b:
                        break
                    ranges.append(range(a, b + 1))
                k += 1
            else:
                size = 1
                for r in ranges:
                    size *= len(r)
                if size + len(out) > MAX_PROBE_CELLS:
                    raise EvalError(f"more than {MAX_PROBE_CELLS} cells to probe")
                out.update(itertools.product(*ranges))
        return out


_COMPILED: dict[Shape, Compiled] = memo.cache()


def compiled(s: Shape) -> Compiled:
    c = _COMPILED.get(s)
    if c is None:
        if len(_COMPILED) > 20_000:
            _COMPILED.clear()
        c = _COMPILED[s] = Compiled(s)
    return c


__all__ = ["Cell", "Compiled", "EvalError", "Shape", "compiled", "probe_cells", "shape_of"]
