"""Stencils expanded into boxes: the one representation every visibility product is built from.

A clause ``visible T[vars] <- S[axes] when guard`` with binders is, for every target cell and every
binder combination, a *box* in the source's coordinates: per source axis an inclusive interval
(``AT`` gives ``[i, i]``, ``RANGE`` gives ``[lo, hi]``, ``*`` and region calls the whole axis),
clipped to the source's bounds, and present where the guard holds. The visible set of a cell is the
union of its boxes. Expanding costs O(target cells × binder combinations): tensors, no per-cell
Python.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast

import torch
from torch import Tensor

from lmpm.errors import BindError
from lmpm.ir.eval import evaluate as eval_int
from lmpm.ir.nodes import (
    NEIGHBORHOODS,
    Axis,
    AxisKind,
    Binder,
    Expr,
    Program,
    ShapeKind,
    Stencil,
)
from lmpm.visibility.expr import (
    Linear,
    Span,
    Val,
    all_defined,
    and_,
    bounds,
    difference,
    evaluate,
    linear,
)

F = TypeVar("F", bound=Callable[..., Any])


def serial(fn: F) -> F:
    """Run ``fn`` with torch's intra-op pool at one thread (restored afterwards).

    The builders here issue many small tensor ops (chunks of a few thousand rows). On a CPU
    shared with other processes every parallel region can wait a scheduler slice for its
    second thread, which made a 60 ms BlockMask build take seconds; the ops are too small to
    gain from threads anyway."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        if threads == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return cast(F, run)


# The device the builders' factory calls allocate on (``on_device``); None: torch's default. A
# context variable that each factory call reads (``device=dev()``), where torch's ``with device:``
# mode would send every torch call of a build through Python: a quarter of a small mask's build
# time on the host, which is what a cold build on a GPU costs (docs/visibility.md).
_DEVICE: ContextVar[torch.device | None] = ContextVar("lmpm_visibility_device", default=None)


def dev() -> torch.device | None:
    """The device the builders allocate on now."""
    return _DEVICE.get()


@contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """The builders called inside allocate on ``device``."""
    token = _DEVICE.set(device)
    try:
        yield
    finally:
        _DEVICE.reset(token)


@dataclass(frozen=True, slots=True)
class Space:
    """The bound shapes of a program's cell-bearing values (Set values have no cells)."""

    names: tuple[str, ...]  # non-Set values, declaration order
    dims: Mapping[str, tuple[int, ...]]
    base: Mapping[str, int]  # first canonical index of each value
    cells: int  # total cells in the sequence

    def size(self, value: str) -> int:
        return math.prod(self.dims[value])


def space(program: Program, env: Mapping[str, int]) -> Space:
    names: list[str] = []
    dims: dict[str, tuple[int, ...]] = {}
    base: dict[str, int] = {}
    total = 0
    for v in program.values:
        if v.shape == ShapeKind.SET:
            continue
        try:
            d = tuple(eval_int(x, env) for x in v.dims)
        except Exception as e:  # EvalError: an unbound dim
            raise BindError(
                f"cannot size `{v.name}`: {e}", span=v.span, hint="bind it with --set", code="B012"
            ) from None
        if any(n < 0 for n in d):
            raise BindError(f"`{v.name}` has a negative dimension {d}", span=v.span, code="B012")
        names.append(v.name)
        dims[v.name] = d
        base[v.name] = total
        total += math.prod(d)
    return Space(tuple(names), dims, base, total)


def cell_coords(dims: tuple[int, ...], rows: slice | Tensor | None = None) -> list[Tensor]:
    """Row-major coordinates of every cell (or of the canonical ``rows`` only): one (cells,)
    int64 tensor per axis."""
    n = math.prod(dims)
    if rows is None:
        flat = torch.arange(n, dtype=torch.long, device=dev())
    elif isinstance(rows, slice):
        flat = torch.arange(*rows.indices(n), dtype=torch.long, device=dev())
    else:
        flat = rows.long()
    out: list[Tensor] = []
    for k in range(len(dims)):
        stride = math.prod(dims[k + 1 :])
        c = flat // stride if stride > 1 else flat
        out.append(c % max(dims[k], 1) if k > 0 else c)  # (axis 0: flat < cells already)
    return out


def strides(dims: Sequence[int]) -> list[int]:
    return [math.prod(dims[k + 1 :]) for k in range(len(dims))]


@dataclass(frozen=True, slots=True)
class DimSpec:
    """One source axis of a clause after region calls are expanded to the axes they cover."""

    kind: AxisKind  # AT, RANGE or ALL (REGION is lowered to ALL: whole covered axes)
    lo: Expr | None
    hi: Expr | None


def dim_specs(axes: tuple[Axis, ...], rank: int, source: str) -> tuple[DimSpec, ...]:
    out: list[DimSpec] = []
    for ax in axes:
        if ax.kind == AxisKind.REGION:
            out.extend(DimSpec(AxisKind.ALL, None, None) for _ in range(ax.width))
        elif ax.kind == AxisKind.ALL:
            out.append(DimSpec(AxisKind.ALL, None, None))
        elif ax.kind == AxisKind.AT:
            out.append(DimSpec(AxisKind.AT, ax.lo, ax.lo))
        else:
            out.append(DimSpec(AxisKind.RANGE, ax.lo, ax.hi))
    if len(out) == 1 and out[0].kind == AxisKind.ALL and rank > 1:
        out = out * rank  # `S[*]` on a grid: every axis
    if len(out) != rank:
        raise BindError(
            f"an access to `{source}` gives {len(out)} axes, it has {rank}", code="B013"
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Combo:
    """One binder combination: binder variables bound to ints, plus the condition (a (n,) bool
    tensor or a python bool) under which this combination exists for each target cell — only not
    constant when a range binder's bounds depend on the target's variables."""

    values: Mapping[str, int]
    exists: Val


def _extreme(x: Val, which: object) -> int:
    """min or max of an evaluated bound over all cells (an empty tensor: an empty range)."""
    if not isinstance(x, Tensor):
        return int(x)
    if x.numel() == 0:
        return 0 if which is min else -1
    return int(x.min()) if which is min else int(x.max())


def binder_combos(
    binders: tuple[Binder, ...], env: Mapping[str, Val], spans: Mapping[str, Span] | None = None
) -> list[Combo]:
    """Every binder combination. A range binder `d in lo..hi` whose bounds vary per cell is
    enumerated over the union of its ranges with a per-cell existence condition — a union read
    from the bounds' values, or bounded from ``spans`` (no tensor read) when given and the bounds
    have host bounds (not when a divisor may be 0: then the values are read after all)."""
    per: list[list[tuple[dict[str, int], Val]]] = []
    for b in binders:
        opts: list[tuple[dict[str, int], Val]] = []
        if b.neighborhood is not None:
            for off in NEIGHBORHOODS[b.neighborhood]:
                opts.append((dict(zip(b.vars, off)), True))
        else:
            assert b.lo is not None and b.hi is not None
            lo, hi = evaluate(b.lo, env), evaluate(b.hi, env)
            # The union of every cell's range; cells outside their own range drop the combo.
            lo_span = bounds(b.lo, spans) if spans is not None else None
            hi_span = bounds(b.hi, spans) if spans is not None else None
            if lo_span is not None and hi_span is not None:
                lo_min, hi_max = lo_span[0], hi_span[1]
            else:
                lo_min, hi_max = _extreme(lo, min), _extreme(hi, max)
            for d in range(lo_min, hi_max + 1):
                opts.append(({b.vars[0]: d}, and_(lo <= d, hi >= d)))
        per.append(opts)
    out: list[Combo] = []
    for combo in itertools.product(*per):
        values: dict[str, int] = {}
        exists: Val = True
        for vals, ex in combo:
            values.update(vals)
            exists = and_(exists, ex)
        out.append(Combo(values, exists))
    return out


@dataclass(frozen=True, slots=True)
class Boxes:
    """The boxes of one or more clauses from one source into one target, stacked.

    ``ok``: (boxes, target_cells) bool — the box exists (guard holds, defined, non-empty after
    clipping). ``lo``/``hi``: (boxes, target_cells, source_rank) int64, clipped to the source's
    bounds (meaningless where not ``ok``). ``whole``: per box, per source axis, True when the axis is
    statically the whole axis (``*`` or a region call).
    """

    target: str
    source: str
    ok: Tensor
    lo: Tensor
    hi: Tensor
    whole: tuple[tuple[bool, ...], ...]

    @property
    def count(self) -> int:
        return int(self.ok.shape[0])

    @staticmethod
    def cat(parts: Sequence[Boxes], target: str, source: str, n: int, rank: int) -> Boxes:
        if not parts:
            z = torch.zeros((0, n, rank), dtype=torch.long, device=dev())
            return Boxes(
                target, source, torch.zeros((0, n), dtype=torch.bool, device=dev()), z, z, ()
            )
        return Boxes(
            target,
            source,
            torch.cat([p.ok for p in parts]),
            torch.cat([p.lo for p in parts]),
            torch.cat([p.hi for p in parts]),
            tuple(w for p in parts for w in p.whole),
        )


def _full(x: Val, n: int) -> Tensor:
    if isinstance(x, Tensor):
        x = x.long()
        return x.expand(n) if x.dim() == 0 else x
    return torch.full((n,), int(x), dtype=torch.long, device=dev())


def _full_bool(x: Val, n: int) -> Tensor:
    if isinstance(x, Tensor):
        x = x if x.dtype == torch.bool else x != 0
        return x.expand(n) if x.dim() == 0 else x
    return torch.full((n,), bool(x), dtype=torch.bool, device=dev())


def _scalar(x: Val) -> Val:
    """A 0-d tensor becomes a python int/bool (so it broadcasts and folds like a constant)."""
    if isinstance(x, Tensor) and x.dim() == 0:
        return bool(x) if x.dtype == torch.bool else int(x)
    return x


def pick(x: Val, rows: slice | Tensor | None) -> Val:
    """``x`` restricted to ``rows`` (a constant stays a constant)."""
    if not isinstance(x, Tensor) or rows is None:
        return x
    return x[rows]


def vec(x: Val, n: int, dtype: torch.dtype = torch.long) -> Tensor:
    """``x`` as an (n,) tensor of ``dtype`` (a constant is broadcast without copying)."""
    if isinstance(x, Tensor):
        x = x.to(dtype)
        return x.expand(n) if x.dim() == 0 else x
    return torch.full((), x, dtype=dtype, device=dev()).expand(n)


@dataclass(frozen=True, slots=True)
class Box:
    """One binder combination of a clause at every target cell, compactly: each field is a python
    constant where it does not depend on the cell (``Txt[*]``: all constants) or an (n,) tensor.

    ``ok``: the box exists (guard, binder range, definedness, non-empty after clipping).
    ``lo``/``hi``: per source axis, the interval, clipped to the source's bounds where ``ok``
    (meaningless elsewhere). ``point``: per axis, statically a single index (``AT``: lo is hi).
    ``most``: per axis, at most this many cells along it where ``ok``, known on the host (a
    static expansion sets it; empty: not known). ``lo_linear``: per axis, ``lo`` as a linear
    form in the target's variables (:func:`~lmpm.visibility.expr.linear`; None: not one, or
    clipped), so positions of boxes that differ by constants share one tensor.
    """

    ok: Val
    lo: tuple[Val, ...]
    hi: tuple[Val, ...]
    point: tuple[bool, ...]
    most: tuple[int, ...] = ()
    lo_linear: tuple[Linear | None, ...] = ()

    def extent(self, a: int) -> Val:
        """Cells along axis ``a`` where ``ok`` (anything elsewhere)."""
        if self.point[a]:
            return 1
        return self.hi[a] - self.lo[a] + 1


@dataclass(frozen=True, slots=True)
class Clause:
    """The compact boxes of one clause (or rule read) from ``source`` into ``target``; boxes that
    are statically absent are dropped. ``n``: target cells; ``whole``: per source axis, statically
    the whole axis (``*`` or a region call). ``coords``: the target's variables at its cells
    (what ``Box.lo_linear`` is written in)."""

    target: str
    source: str
    n: int
    sdims: tuple[int, ...]
    boxes: tuple[Box, ...]
    whole: tuple[bool, ...]
    coords: Mapping[str, Tensor] = field(default_factory=dict)

    def sees(self) -> Tensor:
        """(n,) bool: the cells with at least one box."""
        out = torch.zeros(self.n, dtype=torch.bool, device=dev())
        for b in self.boxes:
            out |= vec(b.ok, self.n, torch.bool)
        return out

    def materialize(self, rows: slice | Tensor | None = None) -> Boxes:
        """The dense :class:`Boxes` (optionally of some target ``rows`` only)."""
        if rows is None:
            m = self.n
        elif isinstance(rows, slice):
            m = len(range(*rows.indices(self.n)))
        else:
            m = int(rows.numel())
        r = len(self.sdims)
        if not self.boxes:
            z = torch.zeros((0, m, r), dtype=torch.long, device=dev())
            return Boxes(
                self.target,
                self.source,
                torch.zeros((0, m), dtype=torch.bool, device=dev()),
                z,
                z,
                (),
            )
        oks, los, his = [], [], []
        for b in self.boxes:
            oks.append(vec(pick(b.ok, rows), m, torch.bool))
            lo = [vec(pick(x, rows), m).clamp(min=0) for x in b.lo]
            hi = [vec(pick(x, rows), m).clamp(max=s - 1) for x, s in zip(b.hi, self.sdims)]
            los.append(
                torch.stack(lo, -1) if lo else torch.zeros((m, 0), dtype=torch.long, device=dev())
            )
            his.append(
                torch.stack(hi, -1) if hi else torch.zeros((m, 0), dtype=torch.long, device=dev())
            )
        return Boxes(
            self.target,
            self.source,
            torch.stack(oks),
            torch.stack(los),
            torch.stack(his),
            tuple(self.whole for _ in self.boxes),
        )


def _inside(v: Val, size: int) -> Val:
    """``0 <= v < size`` (a python bool when it holds, or fails, for every cell)."""
    if not isinstance(v, Tensor):
        return 0 <= v < size
    if v.numel() == 0:
        return True
    lo, hi = int(v.min()), int(v.max())
    if lo >= 0 and hi < size:
        return True
    if hi < 0 or lo >= size:
        return False
    return (v >= 0) & (v < size)


def _clip_lo(v: Val) -> Val:
    if not isinstance(v, Tensor):
        return max(v, 0)
    return v if v.numel() == 0 or int(v.min()) >= 0 else v.clamp(min=0)


def _clip_hi(v: Val, size: int) -> Val:
    if not isinstance(v, Tensor):
        return min(v, size - 1)
    return v if v.numel() == 0 or int(v.max()) <= size - 1 else v.clamp(max=size - 1)


@dataclass(frozen=True, slots=True)
class ClauseSpec:
    """One ``visible`` clause or rule read before expansion: each cell ``target[vars]`` sees the
    boxes ``source[axes]`` for every binding of ``binders`` where ``guard`` holds."""

    target: str
    source: str
    axes: tuple[Axis, ...]  # one per source axis
    binders: tuple[Binder, ...]
    guard: Expr | None  # None: every cell (a rule read)
    vars: tuple[str, ...]  # the target's variables, one per target axis

    @classmethod
    def of(cls, s: Stencil) -> ClauseSpec:
        """The spec of a ``visible`` clause."""
        return cls(s.target, s.source, s.axes, s.binders, s.guard, s.vars)


def expand_clause(
    program: Program,
    env: Mapping[str, int],
    clause: ClauseSpec,
    sp: Space | None = None,
    rows: slice | Tensor | None = None,
    static: bool = False,
    coords: Sequence[Tensor] | None = None,
) -> Clause:
    """The compact boxes of one clause (or rule read) at every cell of ``target`` — or at the
    canonical ``rows`` of ``target`` only (a slice or an index tensor), for streaming.
    ``coords``: ``cell_coords(target dims, rows)``, when the caller has them (several clauses
    into one target share them).

    ``static``: decide what can be decided from the program and its sizes alone (bounds of the
    expressions, :func:`~lmpm.visibility.expr.bounds`) and never read a tensor's value: no
    host sync on a GPU, and the same boxes for any ``rows`` (none dropped for being empty there);
    each box carries ``most``, the host bound of its extents."""
    target, source, guard, target_vars = clause.target, clause.source, clause.guard, clause.vars
    sp = sp if sp is not None else space(program, env)
    if target not in sp.dims or source not in sp.dims:
        missing = target if target not in sp.dims else source
        raise BindError(f"`{missing}` has no cells (a Set value or unknown)", code="B014")
    tdims, sdims = sp.dims[target], sp.dims[source]
    if len(target_vars) != len(tdims):
        raise BindError(
            f"`{target}` has {len(tdims)} axes but {len(target_vars)} variables were given",
            code="B013",
        )
    specs = dim_specs(clause.axes, len(sdims), source)
    coords = list(coords) if coords is not None else cell_coords(tdims, rows)
    n = int(coords[0].numel()) if coords else math.prod(tdims)
    base_env: dict[str, Val] = dict(env)
    base_env.update(zip(target_vars, coords))
    whole = tuple(s.kind == AxisKind.ALL for s in specs)
    point = tuple(s.kind == AxisKind.AT for s in specs)
    spans: dict[str, Span] | None = None
    if static:  # host bounds of every name: params are points, target variables span their axis
        spans = {k: (v, v) for k, v in env.items()}
        spans.update((v, (0, max(d - 1, 0))) for v, d in zip(target_vars, tdims))
    boxes: list[Box] = []
    for combo in binder_combos(clause.binders, base_env, spans):
        local = dict(base_env)
        local.update(combo.values)
        defined: list[Val] = []
        ok: Val = _scalar(combo.exists)
        if guard is not None:
            ok = and_(ok, _scalar(evaluate(guard, local, defined)))
        lo_k: list[Val] = []
        hi_k: list[Val] = []
        most: list[int] = []
        forms: list[Linear | None] = []
        local_spans = None if spans is None else {**spans, **_points(combo.values)}
        for spec, size in zip(specs, sdims):
            if ok is False:
                break
            if spec.kind == AxisKind.ALL:
                lo_v: Val = 0
                hi_v: Val = size - 1
                ok = and_(ok, size > 0)
                most.append(size)
                forms.append((0, ()))
            elif local_spans is not None:
                axis = _static_axis(spec, size, local, local_spans, defined)
                lo_v, hi_v = axis.lo, axis.hi
                ok = and_(ok, axis.fits)
                most.append(axis.most)
                forms.append(axis.lo_linear)
            elif spec.kind == AxisKind.AT:
                assert spec.lo is not None
                lo_v = hi_v = _scalar(_int_val(evaluate(spec.lo, local, defined)))
                ok = and_(ok, _inside(lo_v, size))
            else:
                assert spec.lo is not None and spec.hi is not None
                lo_v = _clip_lo(_scalar(_int_val(evaluate(spec.lo, local, defined))))
                hi_v = _clip_hi(_scalar(_int_val(evaluate(spec.hi, local, defined))), size)
                le = lo_v <= hi_v
                ok = and_(ok, _scalar(le) if isinstance(le, Tensor) else bool(le))
            lo_k.append(lo_v)
            hi_k.append(hi_v)
        if ok is False:
            continue
        ok = and_(ok, _scalar(all_defined(defined)))
        if static:
            if isinstance(ok, Tensor) and ok.shape != (n,):
                ok = ok.expand(n)
            if ok is not False:
                boxes.append(Box(ok, tuple(lo_k), tuple(hi_k), point, tuple(most), tuple(forms)))
            continue
        if isinstance(ok, Tensor):
            if ok.shape != (n,):
                ok = ok.expand(n)
            if not bool(ok.any()):
                continue
            if bool(ok.all()):
                ok = True
        if ok is False:
            continue
        boxes.append(Box(ok, tuple(lo_k), tuple(hi_k), point))
    return Clause(target, source, n, sdims, tuple(boxes), whole, dict(zip(target_vars, coords)))


def _points(values: Mapping[str, int]) -> dict[str, Span]:
    return {k: (v, v) for k, v in values.items()}


class StaticAxis(NamedTuple):
    """One AT or RANGE axis of a box, expanded with host bounds only."""

    lo: Val  # clipped where the bounds say it may leave the axis
    hi: Val
    fits: Val  # inside and non-empty (a python bool where the bounds decide it)
    most: int  # at most this many cells
    lo_linear: Linear | None  # ``lo`` as a linear form (None: not one, or clipped)


def _static_axis(
    spec: DimSpec, size: int, env: Mapping[str, Val], spans: Mapping[str, Span], defined: list[Val]
) -> StaticAxis:
    """One AT or RANGE axis of a static expansion. Tests and clips that the bounds prove
    needless are left out: they would be kernels on a GPU."""
    assert spec.lo is not None
    lo_e, hi_e = spec.lo, spec.hi if spec.kind == AxisKind.RANGE else None
    lo_v = _linear_value(lo_e, env, spans, defined)
    lo_s = bounds(lo_e, spans) or (-(2**62), 2**62)
    if not isinstance(lo_v, Tensor):
        lo_s = (lo_v, lo_v)
    form = linear(lo_e, spans) if lo_s[0] >= 0 or hi_e is None else None  # (unclipped)
    if hi_e is None:  # AT: one index, inside [0, size)
        if lo_s[0] >= 0 and lo_s[1] < size:
            return StaticAxis(lo_v, lo_v, True, 1, form)
        if lo_s[1] < 0 or lo_s[0] >= size:
            return StaticAxis(lo_v, lo_v, False, 1, form)
        assert isinstance(lo_v, Tensor)
        # Only the side the bounds leave open (x + 1 can only pass the end).
        below: Val = True if lo_s[0] >= 0 else lo_v >= 0
        return StaticAxis(lo_v, lo_v, and_(below, True if lo_s[1] < size else lo_v < size), 1, form)
    hi_v = _linear_value(hi_e, env, spans, defined)
    hi_s = bounds(hi_e, spans) or (-(2**62), 2**62)
    if not isinstance(hi_v, Tensor):
        hi_s = (hi_v, hi_v)
    if lo_s[0] < 0:
        lo_v = lo_v.clamp(min=0) if isinstance(lo_v, Tensor) else max(lo_v, 0)
    if hi_s[1] > size - 1:
        hi_v = hi_v.clamp(max=size - 1) if isinstance(hi_v, Tensor) else min(hi_v, size - 1)
    lo_c = (max(lo_s[0], 0), max(lo_s[1], 0))  # the clipped bounds
    hi_c = (min(hi_s[0], size - 1), min(hi_s[1], size - 1))
    width = difference(hi_e, lo_e, spans)  # hi - lo, shared names cancelled
    most = max(0, min(size, hi_c[1] - lo_c[0] + 1, size if width is None else width[1] + 1))
    # Non-empty after clipping: max(lo, 0) <= min(hi, size - 1).
    always = lo_c[1] <= hi_c[0] or (
        width is not None and width[0] >= 0 and lo_s[1] < size and hi_s[0] >= 0 and size > 0
    )
    never = lo_c[0] > hi_c[1] or (width is not None and width[1] < 0)
    fits: Val = True if always else False if never else lo_v <= hi_v
    return StaticAxis(lo_v, hi_v, fits, most, form)


def _linear_value(
    e: Expr, env: Mapping[str, Val], spans: Mapping[str, Span], defined: list[Val]
) -> Val:
    """``e`` evaluated, from its linear form where it has one (``t - Wnd + 1`` is one add:
    constants folded first)."""
    form = linear(e, spans)
    if form is None:
        return _int_val(evaluate(e, env, defined))
    out: Val = form[0]
    for var, coef in form[1]:
        term = env[var] if coef == 1 else env[var] * coef
        out = term if isinstance(out, int) and out == 0 else out + term
    return _int_val(out)


def _int_val(x: Val) -> Val:
    """Booleans in index position become 0/1; tensors become int64 (n,)."""
    if isinstance(x, Tensor):
        return x.long() if x.dtype != torch.long else x
    return int(x)


def expand(
    program: Program, env: Mapping[str, int], clause: ClauseSpec, sp: Space | None = None
) -> Boxes:
    """The boxes of one clause (or rule read) at every cell of its target (dense form)."""
    return expand_clause(program, env, clause, sp).materialize()


def cell_stencils(program: Program, sp: Space) -> list[Stencil]:
    """The ``visible`` clauses between values with cells, in source order."""
    return [s for s in program.stencils if s.target in sp.dims and s.source in sp.dims]


def expand_stencil(
    program: Program,
    env: Mapping[str, int],
    s: Stencil,
    sp: Space,
    rows: slice | Tensor | None = None,
    static: bool = False,
    coords: Sequence[Tensor] | None = None,
) -> Clause:
    """:func:`expand_clause` of a ``visible`` clause."""
    return expand_clause(program, env, ClauseSpec.of(s), sp, rows, static, coords)


def clause_boxes(program: Program, env: Mapping[str, int], sp: Space) -> list[Clause]:
    """One :class:`Clause` per ``visible`` clause, in source order (Set targets/sources skipped)."""
    return [expand_stencil(program, env, s, sp) for s in cell_stencils(program, sp)]
