"""The memory a plan needs, counted before anything is allocated (no torch unless a plan is big).

`lmpm check`, `lmpm run` and the API refuse a plan past the machine's memory (or ``--max-memory``)
with the number: first the values' cells (U043), then the gather tables (U049). The tables are
bounded here from the sizes alone (a box is clipped to its source, so a row of a table is at most
``boxes x the cells one box covers`` wide); only when that bound does not fit are the exact widths counted
from the clauses' boxes (:func:`lmpm.visibility.gather.table_costs`, which imports torch), so a
plain `lmpm check` of a small program stays light.

>>> from lmpm.ir import compile_source
>>> ir = compile_source("param N = 6\\nvalue T : Token[Byte] shape Seq(N)\\n"
...                     "visible T[t] <- T[0..t-1] when t > 0\\n").ir
>>> table_bound(ir, {"N": 6})  # one table of 6 rows, at most 6 columns, 26 bytes an entry
936
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from lmpm.errors import UsageError
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.nodes import NEIGHBORHOODS, Axis, AxisKind, Binder, Program, ReadKind, ShapeKind

BYTES_PER_CELL = 64  # control-plane metadata + payload + coordinates per cell, a lower bound
# Peak bytes per table entry (row x column) while a table is built: the int64 slots being decoded,
# their int64 clone, the bool row mask and the final int64 index and bool valid (_box_cells,
# table_from_clauses). Measured: a causal Seq(20000) union took 10.4 GB, 26 bytes per entry.
TABLE_BYTES_PER_ENTRY = 26


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def value_dims(program: Program, env: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """The dimensions of every value that has cells (Set values have none)."""
    return {
        v.name: tuple(evaluate(d, env) for d in v.dims)
        for v in program.values
        if v.shape != ShapeKind.SET
    }


def _width(axes: tuple[Axis, ...], sdims: tuple[int, ...], env: Mapping[str, int]) -> int:
    """The most source cells one box of an access covers (boxes are clipped to the source, as
    :func:`lmpm.visibility._stencil.dim_specs` reads the axes): one index on an AT axis, the
    axis on ``*`` or a region, a range's length where its ends are constants, else the axis."""
    if len(axes) == 1 and axes[0].kind == AxisKind.ALL:
        return math.prod(sdims)  # `S[*]`: every axis
    width, a = 1, 0
    for ax in axes:
        if ax.kind == AxisKind.REGION:
            width *= math.prod(sdims[a : a + ax.width])
            a += ax.width
            continue
        size = sdims[a] if a < len(sdims) else 1
        a += 1
        if ax.kind == AxisKind.AT:
            continue
        if ax.kind == AxisKind.RANGE and ax.lo is not None and ax.hi is not None:
            try:
                size = min(size, max(evaluate(ax.hi, env) - evaluate(ax.lo, env) + 1, 0))
            except EvalError:  # the ends move with the target cell (`0..t-1`): the whole axis
                pass
        width *= size
    return width


def _combos(binders: tuple[Binder, ...], env: Mapping[str, int]) -> int | None:
    """How many binder combinations (boxes) a clause has at most; None when a range's ends
    depend on the target cell (then only the boxes themselves say)."""
    n = 1
    for b in binders:
        if b.neighborhood is not None:
            n *= len(NEIGHBORHOODS[b.neighborhood])
            continue
        assert b.lo is not None and b.hi is not None
        try:
            n *= max(evaluate(b.hi, env) - evaluate(b.lo, env) + 1, 0)
        except EvalError:
            return None
    return n


def table_bound(program: Program, env: Mapping[str, int]) -> int | None:
    """An upper bound of the bytes :func:`lmpm.visibility.gather.table_costs` counts, from the
    sizes alone: per clause or rule read, target cells x boxes x the most cells a box covers x
    TABLE_BYTES_PER_ENTRY. None when a clause's box count is not known without its boxes."""
    dims = value_dims(program, env)
    accesses = [(s.target, s.source, s.axes, s.binders) for s in program.stencils]
    accesses += [
        (r.target, rd.source, rd.axes, rd.binders)
        for r in program.rules
        for rd in r.reads
        if rd.kind != ReadKind.VISIBLE
    ]
    entries = 0
    for target, source, axes, binders in accesses:
        if target not in dims or source not in dims:
            continue
        boxes = _combos(binders, env)
        if boxes is None:
            return None
        entries += math.prod(dims[target]) * boxes * _width(axes, dims[source], env)
    return entries * TABLE_BYTES_PER_ENTRY


def check_memory(program: Program, env: Mapping[str, int], limit: int | None = None) -> None:
    """Refuse a plan too big for ``limit`` bytes (default: this machine's memory) *before*
    allocating anything: the values' cells (U043; a huge ``--set`` would otherwise try an absurd
    allocation, or swap the machine to a halt), then the gather tables the plan builds (U049;
    ``param N = 20000`` with a causal ``visible`` needs 19 GiB), counted from the clauses' boxes
    when their bound from the cell counts does not fit."""
    ram = machine_memory() if limit is None else limit
    if ram is None:
        return
    what = "this machine has" if limit is None else "--max-memory allows"
    sizes = {name: math.prod(d) for name, d in value_dims(program, env).items()}
    total = sum(sizes.values())
    if total * BYTES_PER_CELL > ram:
        big = max(sizes, key=lambda k: sizes[k])
        raise UsageError(
            f"the values have {total:,} cells in all (`{big}`: {sizes[big]:,}); that needs at "
            f"least {total * BYTES_PER_CELL / 2**30:,.1f} GiB, and {what} "
            f"{ram / 2**30:,.1f} GiB",
            code="U043",
            hint="--set smaller dimensions",
        )
    bound = table_bound(program, env)
    if bound is not None and bound + total * BYTES_PER_CELL <= ram:
        return
    from lmpm.visibility.gather import table_costs  # imports torch: only for a big plan

    costs = table_costs(program, env)
    need = sum(c.nbytes() for c in costs) + total * BYTES_PER_CELL
    if need > ram:
        top = max(costs, key=lambda c: c.nbytes())
        raise UsageError(
            f"the plan's gather tables need about {need / 2**30:,.1f} GiB ({need:,} bytes) and "
            f"{what} {ram / 2**30:,.1f} GiB: `{top.target}` reads up to {top.columns:,} cells "
            f"of `{top.source}` at each of its {top.rows:,} cells ({top.nbytes() / 2**30:,.1f} "
            "GiB)",
            code="U049",
            hint="--set smaller dimensions, or narrow the `visible` clause (a window "
            "`t-W..t-1` instead of `0..t-1`)",
        )
