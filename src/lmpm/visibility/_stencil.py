"""Stencils expanded into boxes: the one representation every visibility product is built from.

A clause ``visible T[vars] <- S[axes] when guard`` with binders is, for every target cell and every
binder combination, a *box* in the source's coordinates: per source axis an inclusive interval
(``AT`` gives ``[i, i]``, ``RANGE`` gives ``[lo, hi]``, ``*`` and region calls the whole axis),
clipped to the source's bounds, and present where the guard holds. The visible set of a cell is the
union of its boxes. Expanding costs O(target cells × binder combinations): tensors, no per-cell
Python.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lmpm.errors import BindError
from lmpm.ir.eval import evaluate as eval_int
from lmpm.ir.nodes import NEIGHBORHOODS, Axis, AxisKind, Binder, Expr, Program, ShapeKind
from lmpm.visibility._expr import Val, all_defined, and_, evaluate


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


def cell_coords(dims: tuple[int, ...]) -> list[Tensor]:
    """Row-major coordinates of every cell: one (cells,) int64 tensor per axis."""
    n = math.prod(dims)
    flat = torch.arange(n, dtype=torch.long)
    out: list[Tensor] = []
    for k in range(len(dims)):
        stride = math.prod(dims[k + 1 :])
        out.append((flat // max(stride, 1)) % max(dims[k], 1))
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


def binder_combos(binders: tuple[Binder, ...], env: Mapping[str, Val]) -> list[Combo]:
    """Every binder combination. A range binder `d in lo..hi` whose bounds vary per cell is
    enumerated over the union of its ranges with a per-cell existence condition."""
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
            z = torch.zeros((0, n, rank), dtype=torch.long)
            return Boxes(target, source, torch.zeros((0, n), dtype=torch.bool), z, z, ())
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
    return torch.full((n,), int(x), dtype=torch.long)


def _full_bool(x: Val, n: int) -> Tensor:
    if isinstance(x, Tensor):
        x = x if x.dtype == torch.bool else x != 0
        return x.expand(n) if x.dim() == 0 else x
    return torch.full((n,), bool(x), dtype=torch.bool)


def expand(
    program: Program,
    env: Mapping[str, int],
    target: str,
    source: str,
    axes: tuple[Axis, ...],
    binders: tuple[Binder, ...],
    guard: Expr | None,
    target_vars: tuple[str, ...],
    sp: Space | None = None,
) -> Boxes:
    """The boxes of one clause (or rule read) at every cell of ``target``."""
    sp = sp if sp is not None else space(program, env)
    if target not in sp.dims or source not in sp.dims:
        missing = target if target not in sp.dims else source
        raise BindError(f"`{missing}` has no cells (a Set value or unknown)", code="B014")
    tdims, sdims = sp.dims[target], sp.dims[source]
    n = math.prod(tdims)
    if len(target_vars) != len(tdims):
        raise BindError(
            f"`{target}` has {len(tdims)} axes but {len(target_vars)} variables were given",
            code="B013",
        )
    specs = dim_specs(axes, len(sdims), source)
    base_env: dict[str, Val] = dict(env)
    base_env.update(zip(target_vars, cell_coords(tdims)))
    whole = tuple(s.kind == AxisKind.ALL for s in specs)
    oks: list[Tensor] = []
    los: list[Tensor] = []
    his: list[Tensor] = []
    for combo in binder_combos(binders, base_env):
        local = dict(base_env)
        local.update(combo.values)
        defined: list[Val] = []
        ok: Val = combo.exists
        if guard is not None:
            ok = and_(ok, evaluate(guard, local, defined))
        lo_k: list[Tensor] = []
        hi_k: list[Tensor] = []
        for spec, size in zip(specs, sdims):
            if spec.kind == AxisKind.ALL:
                lo_v: Val = 0
                hi_v: Val = size - 1
            else:
                assert spec.lo is not None and spec.hi is not None
                lo_v = evaluate(spec.lo, local, defined)
                hi_v = lo_v if spec.kind == AxisKind.AT else evaluate(spec.hi, local, defined)
            lo_t = _full(lo_v, n).clamp(min=0)
            hi_t = _full(hi_v, n).clamp(max=size - 1)
            ok = and_(ok, lo_t <= hi_t)
            lo_k.append(lo_t)
            hi_k.append(hi_t)
        ok = and_(ok, all_defined(defined))
        oks.append(_full_bool(ok, n))
        los.append(torch.stack(lo_k, -1) if lo_k else torch.zeros((n, 0), dtype=torch.long))
        his.append(torch.stack(hi_k, -1) if hi_k else torch.zeros((n, 0), dtype=torch.long))
    if not oks:  # an empty binder domain: the clause selects nothing
        z = torch.zeros((0, n, len(sdims)), dtype=torch.long)
        return Boxes(target, source, torch.zeros((0, n), dtype=torch.bool), z, z, ())
    return Boxes(
        target,
        source,
        torch.stack(oks),
        torch.stack(los),
        torch.stack(his),
        tuple(whole for _ in oks),
    )


def clause_boxes(program: Program, env: Mapping[str, int], sp: Space) -> list[Boxes]:
    """One :class:`Boxes` per ``visible`` clause, in source order (Set targets/sources skipped)."""
    out: list[Boxes] = []
    for s in program.stencils:
        if s.target not in sp.dims or s.source not in sp.dims:
            continue
        out.append(expand(program, env, s.target, s.source, s.axes, s.binders, s.guard, s.vars, sp))
    return out
