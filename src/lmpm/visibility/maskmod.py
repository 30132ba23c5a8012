"""A FlexAttention ``mask_mod`` generated from the program's ``visible`` clauses.

``mask_mod(b, h, q_idx, kv_idx)`` is True iff the cell at sequence position ``kv_idx`` is visible
to the cell at ``q_idx`` (positions in the chosen :class:`~lmpm.visibility.layout.Layout`). It is
built only from torch ops on the index tensors — a table lookup for non-raster layouts, integer
arithmetic for coordinates, comparisons for each clause — with Python loops only over clauses and
binder offsets (unrolled at build time), so it works under ``vmap`` in ``create_block_mask``, inside
``flex_attention`` and under ``torch.compile``.

Per clause ``T[vars] <- S[axes] when guard``: q must be a cell of T, kv a cell of S, and for some
binder combination the guard holds and every axis of kv matches (``AT``: equal; ``RANGE``: inside;
``*``/region: any). Bounds need no check: kv is a real cell, so a clipped index can never match it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor

from lmpm.ir.nodes import Axis, AxisKind, Binder, Expr, Op, Program
from lmpm.visibility._expr import Val, all_defined, and_, evaluate, or_
from lmpm.visibility._stencil import (
    DimSpec,
    Space,
    binder_combos,
    cell_coords,
    dim_specs,
    strides,
)
from lmpm.visibility.layout import Layout

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True, slots=True)
class _Clause:
    specs: tuple[DimSpec, ...]
    combos: tuple[Mapping[str, int], ...]  # binder offsets, unrolled
    ranged: tuple[tuple[str, Expr, Expr], ...]  # range binders whose bounds depend on the cell
    guard: Expr | None
    vars: tuple[str, ...]


def _clause(
    env: Mapping[str, int],
    sp: Space,
    target: str,
    vars_: tuple[str, ...],
    source: str,
    axes: tuple[Axis, ...],
    binders: tuple[Binder, ...],
    guard: Expr | None,
) -> _Clause:
    # Offsets come from the same enumeration the stencil expansion uses (over all target cells),
    # so a per-cell range binder contributes the union of its ranges plus a per-cell bound check.
    full_env: dict[str, Val] = dict(env)
    if any(b.neighborhood is None for b in binders):  # only a range's bounds read the cell
        full_env.update(zip(vars_, cell_coords(sp.dims[target])))
    combos = tuple(c.values for c in binder_combos(binders, full_env))
    ranged = tuple(
        (b.vars[0], b.lo, b.hi)
        for b in binders
        if b.neighborhood is None and b.lo is not None and b.hi is not None
    )
    g = None if guard is not None and guard.op == Op.CONST and guard.value == 1 else guard
    return _Clause(dim_specs(axes, len(sp.dims[source]), source), combos, ranged, g, vars_)


def _coords(local: Tensor, dims: tuple[int, ...]) -> list[Tensor]:
    """Row-major coordinates of an in-value index with the fewest ops: the first axis needs no
    ``%`` and the last no ``//`` (garbage outside the value is masked by membership)."""
    st = strides(dims)
    out: list[Tensor] = []
    for a in range(len(dims)):
        c = local if st[a] == 1 else local // st[a]
        out.append(c if a == 0 else c % max(dims[a], 1))
    return out


def build_mask_mod(program: Program, env: Mapping[str, int], sp: Space, layout: Layout) -> MaskMod:
    """The mask_mod of every ``visible`` clause of ``program`` in ``layout``."""
    groups: dict[tuple[str, str], list[_Clause]] = {}
    for s in program.stencils:
        if s.target not in sp.dims or s.source not in sp.dims:
            continue
        groups.setdefault((s.target, s.source), []).append(
            _clause(env, sp, s.target, s.vars, s.source, s.axes, s.binders, s.guard)
        )
    params = dict(env)
    to_canon = layout.to_canon

    def member(idx: Tensor, value: str) -> tuple[Val, list[Tensor]]:
        # Fewest ops per (q, kv) pair: this runs inside every partial block of the kernel.
        base, n = sp.base[value], sp.size(value)
        local = idx - base if base else idx
        inside: Val = True if (base == 0 and n == sp.cells) else (local >= 0) & (local < n)
        return inside, _coords(local, sp.dims[value])

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q = q_idx if to_canon is None else to_canon[q_idx]
        kv = kv_idx if to_canon is None else to_canon[kv_idx]
        out: Val = False
        for (target, source), clauses in groups.items():
            in_t, qc = member(q, target)
            in_s, kc = member(kv, source)
            seen: Val = False
            for cl in clauses:
                cell_env: dict[str, Val] = dict(params)
                cell_env.update(zip(cl.vars, qc))
                for combo in cl.combos:
                    local = dict(cell_env)
                    local.update(combo)
                    defined: list[Val] = []
                    cond: Val = True
                    for var, lo, hi in cl.ranged:
                        d = combo[var]
                        cond = and_(
                            cond,
                            and_(
                                evaluate(lo, local, defined) <= d, evaluate(hi, local, defined) >= d
                            ),
                        )
                    if cl.guard is not None:
                        cond = and_(cond, evaluate(cl.guard, local, defined))
                    for spec, k in zip(cl.specs, kc):
                        if spec.kind == AxisKind.ALL:
                            continue
                        assert spec.lo is not None and spec.hi is not None
                        lo_v = evaluate(spec.lo, local, defined)
                        if spec.kind == AxisKind.AT:
                            cond = and_(cond, k == lo_v)
                        else:
                            hi_v = evaluate(spec.hi, local, defined)
                            cond = and_(cond, and_(k >= lo_v, k <= hi_v))
                    seen = or_(seen, and_(cond, all_defined(defined)))
            out = or_(out, and_(and_(in_t, in_s), seen))
        if isinstance(out, Tensor):
            return out
        # A constant answer still has to be a tensor shaped like the indices.
        return (q_idx >= 0) if out else (q_idx < 0)

    return mask_mod
