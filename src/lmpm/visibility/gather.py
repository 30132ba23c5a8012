"""Gather tables: for each target cell, the padded list of source cells it may read.

A local rule reads its inputs through these: ``payload[table.index]`` gathers every visible source
cell for every target cell at once, and ``table.valid`` masks the padding. Built from the clause's
boxes (:mod:`lmpm.visibility._stencil`) with tensor ops over all target cells; Python loops only run
over binder combinations and clauses.

Contract (the runtime depends on it):

- rows are the target value's cells in canonical raster order (row-major over its declared axes);
- ``index[c]`` holds flat row-major indices into the *source* value's cells, sorted ascending and
  de-duplicated over the valid entries, padded with 0; ``valid[c]`` marks the real entries;
- ``K`` (the width) is the largest visible count of any target cell (0 when nothing is visible);
- source indices outside the source's bounds are dropped; region calls select their whole axes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lmpm.ir.nodes import Axis, Binder, Expr, Program
from lmpm.resolve.budget import TABLE_BYTES_PER_ENTRY
from lmpm.visibility._stencil import (
    Box,
    Clause,
    ClauseSpec,
    Space,
    expand_clause,
    serial,
    space,
    strides,
    vec,
)
from lmpm.visibility.expr import Val


@dataclass(frozen=True, slots=True)
class GatherTable:
    """Visible source cells per target cell.

    ``index``: (target_cells, K) int64, flat row-major index into the source value, padded with 0.
    ``valid``: (target_cells, K) bool.

    >>> import torch
    >>> t = GatherTable(torch.tensor([[0, 1], [2, 0]]), torch.tensor([[True, True], [True, False]]))
    >>> t.K, t.counts.tolist()
    (2, [2, 1])
    """

    index: Tensor
    valid: Tensor

    @property
    def K(self) -> int:
        return int(self.index.shape[1])

    @property
    def counts(self) -> Tensor:
        """(target_cells,) int64: visible source cells per target cell."""
        return self.valid.sum(1)


def _box_cells(box: Box, sdims: tuple[int, ...], n: int) -> tuple[Tensor, Tensor | None] | None:
    """Every cell of one box, in raster order (so ascending and distinct per row), as flat source
    indices: ``(flat, valid)`` with ``flat`` (n or 1, w) int64 and ``valid`` (n, w) bool, or None
    when valid everywhere. None when the box is empty at every cell.

    Constants stay constants: when every extent is static (``AT`` axes, ``*``, ranges with constant
    ends) the offsets of the box's cells are the same for every row, so the table is one
    broadcast add ``base[:, None] + offsets[None, :]`` — and nothing per row at all when the base
    is constant too (``Txt[*]``). Only ranges with per-cell extents (``Txt[0..t-1]``) decode each
    slot with the row's own extents (mixed radix), so the width is the largest box.
    """
    sstride = strides(sdims)
    r = len(sdims)
    ext = [box.extent(a) for a in range(r)]
    base: Val = 0
    for a in range(r):
        lo = box.lo[a]
        if sstride[a] and not (isinstance(lo, int) and lo == 0):
            base = base + lo * sstride[a]
    ok = box.ok
    if not any(isinstance(e, Tensor) for e in ext):
        width = math.prod(int(e) for e in ext)
        if width <= 0:
            return None
        j = torch.arange(width, dtype=torch.long)
        off = torch.zeros(width, dtype=torch.long)
        step = 1
        for a in reversed(range(r)):
            e_s = int(ext[a])
            if e_s > 1:
                off += ((j // step) % e_s) * sstride[a]
                step *= e_s
        if isinstance(base, Tensor):
            flat = base.long().unsqueeze(1) + off
        else:
            flat = (off + int(base)).unsqueeze(0)
        valid = None if not isinstance(ok, Tensor) else ok.unsqueeze(1).expand(n, width)
        return flat, valid
    # Per-cell extents: decode slot j of each row with that row's extents, last axis fastest.
    size: Tensor = torch.ones(n, dtype=torch.long)
    exts: list[Val] = []
    for e_x in ext:
        e_v: Val = e_x.clamp(min=0) if isinstance(e_x, Tensor) else max(int(e_x), 0)
        exts.append(e_v)
        size = size * e_v
    if isinstance(ok, Tensor):
        size = size * ok
    width = int(size.max()) if n else 0
    if width == 0:
        return None
    j = torch.arange(width, dtype=torch.long)
    flat = vec(base, n).unsqueeze(1).expand(n, width).clone()
    inner: Val = 1
    for a in reversed(range(r)):
        e_a = exts[a]
        if isinstance(e_a, int):
            if e_a == 1:
                continue
            e_c: Val = max(e_a, 1)
        else:
            e_c = e_a.clamp(min=1).unsqueeze(1)
        q = j // inner if isinstance(inner, int) else j.unsqueeze(0) // inner
        flat += (q % e_c) * sstride[a]
        inner = inner * e_c
    return flat, j.unsqueeze(0) < size.unsqueeze(1)


@serial
def table_from_clauses(
    clauses: Sequence[Clause], n: int, source_dims: tuple[int, ...]
) -> GatherTable:
    """The gather table of the union of ``clauses`` (all from one source into one target of
    ``n`` cells): each row sorted ascending, de-duplicated, left-packed, padded with 0, trimmed
    to the widest row."""
    parts = []
    if n:
        for cl in clauses:
            for box in cl.boxes:
                p = _box_cells(box, source_dims, n)
                if p is not None:
                    parts.append(p)
    if not parts:
        return GatherTable(
            torch.zeros((n, 0), dtype=torch.long), torch.zeros((n, 0), dtype=torch.bool)
        )
    if len(parts) == 1:
        # One box, enumerated in raster order: already ascending and distinct per row.
        flat, valid = parts[0]
        w = flat.shape[1]
        if valid is None:
            return GatherTable(flat.expand(n, w).contiguous(), torch.ones((n, w), dtype=torch.bool))
        valid = valid.expand(n, w).contiguous()
        return GatherTable(torch.where(valid, flat, 0).contiguous(), valid)
    # Several boxes: sort each row once, drop repeats, left-pack with a scatter.
    uniform = all(f.shape[0] == 1 and v is None for f, v in parts)
    m = 1 if uniform else n  # every row the same (constant boxes): work on one row
    sentinel = math.prod(source_dims)
    dt = torch.int32 if sentinel < 2**31 - 1 else torch.long
    keys = [
        (f if v is None else torch.where(v, f, sentinel)).to(dt).expand(m, f.shape[1])
        for f, v in parts
    ]
    key = torch.cat(keys, 1).sort(1).values  # (m, W)
    keep = key != sentinel
    keep[:, 1:] &= key[:, 1:] != key[:, :-1]
    count = keep.sum(1)
    k = int(count.max())
    pos = torch.where(keep, keep.cumsum(1) - 1, k)  # repeats and padding go to column k
    out = torch.zeros((m, k + 1), dtype=torch.long)
    out.scatter_(1, pos, key.long())
    index = out[:, :k]
    valid = torch.arange(k) < count.unsqueeze(1)
    if uniform:
        return GatherTable(index.expand(n, k).contiguous(), valid.expand(n, k).contiguous())
    return GatherTable(index.contiguous(), valid)


@serial
def gather_table(
    program: Program,
    env: Mapping[str, int],
    target: str,
    source: str,
    axes: tuple[Axis, ...],
    binders: tuple[Binder, ...],
    guard: Expr | None,
    target_vars: tuple[str, ...],
) -> GatherTable:
    """The gather table of one access (a ``visible`` clause or a rule read) at every target cell.

    >>> from lmpm.ir import compile_source
    >>> p = compile_source("param N = 4\\nvalue Txt : Token[Byte] shape Seq(N)\\n"
    ...                    "visible Txt[t] <- Txt[0..t-1] when t > 0\\n").ir
    >>> s = p.stencils[0]
    >>> g = gather_table(p, {"N": 4}, "Txt", "Txt", s.axes, s.binders, s.guard, s.vars)
    >>> g.index.tolist(), g.valid.sum(1).tolist()
    ([[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 1, 2]], [0, 1, 2, 3])
    """
    sp = space(program, env)
    spec = ClauseSpec(target, source, axes, binders, guard, target_vars)
    cl = expand_clause(program, env, spec, sp)
    return table_from_clauses([cl], sp.size(target), sp.dims[source])


def union_clauses(
    program: Program, env: Mapping[str, int], sp: Space, target: str, source: str
) -> list[Clause]:
    return [
        expand_clause(program, env, ClauseSpec.of(s), sp)
        for s in program.stencils
        if s.target == target and s.source == source
    ]


@serial
def visible_union(
    program: Program, env: Mapping[str, int], target: str, source: str
) -> GatherTable:
    """Every cell of ``source`` visible to each cell of ``target`` (the union of all clauses).

    >>> from lmpm.ir import compile_source
    >>> p = compile_source("value A : Token[Byte] shape Seq(3)\\nvalue B : Token[Byte] shape Seq(2)\\n"
    ...                    "visible A[i] <- B[i]\\nvisible A[i] <- B[0]\\n").ir
    >>> g = visible_union(p, {}, "A", "B")
    >>> g.index.tolist(), g.valid.tolist()
    ([[0, 0], [0, 1], [0, 0]], [[True, False], [True, True], [True, False]])
    """
    sp = space(program, env)
    clauses = union_clauses(program, env, sp, target, source)
    return table_from_clauses(clauses, sp.size(target), sp.dims[source])


# ---- the bytes before any table is built ----------------------------------------------------------
# (TABLE_BYTES_PER_ENTRY, the peak bytes per entry while a table is built, lives in the torch-free
# lmpm.resolve.budget, which bounds the tables from cell counts before it needs these boxes.)


def box_width(box: Box, n: int) -> int:
    """The widest row of one box over ``n`` target cells (the columns :func:`_box_cells` makes),
    computed from the extents alone: (n,) integers, no table."""
    ext = [box.extent(a) for a in range(len(box.lo))]
    if not any(isinstance(e, Tensor) for e in ext):
        return max(math.prod(int(e) for e in ext), 0)
    size: Tensor = torch.ones(n, dtype=torch.long)
    for e in ext:
        size = size * (e.clamp(min=0) if isinstance(e, Tensor) else max(int(e), 0))
    if isinstance(box.ok, Tensor):
        size = size * box.ok
    return int(size.max()) if n else 0


@dataclass(frozen=True, slots=True)
class TableCost:
    """What building one gather table takes: ``entries`` (rows x columns) and peak ``nbytes``."""

    target: str
    source: str
    rows: int
    columns: int  # the widest rows of all its boxes, added up (before de-duplication)

    def nbytes(self) -> int:
        return self.rows * self.columns * TABLE_BYTES_PER_ENTRY


def table_costs(program: Program, env: Mapping[str, int]) -> list[TableCost]:
    """The cost of every gather table a plan builds: each (target, source) union of ``visible``
    clauses and each rule read through an explicit access, from the clauses' boxes (one (n,)
    vector per box at most, never a table). ``lmpm run`` refuses a plan past the memory with
    these numbers (:func:`lmpm.resolve.budget.check_memory`)."""
    sp = space(program, env)
    out: list[TableCost] = []
    for target, source in dict.fromkeys((s.target, s.source) for s in program.stencils):
        n = sp.size(target)
        cols = sum(
            box_width(b, n)
            for cl in union_clauses(program, env, sp, target, source)
            for b in cl.boxes
        )
        out.append(TableCost(target, source, n, cols))
    for r in program.rules:
        for rd in r.reads:
            if rd.kind.value == "visible" or r.target not in sp.dims or rd.source not in sp.dims:
                continue
            n = sp.size(r.target)
            spec = ClauseSpec(r.target, rd.source, rd.axes, rd.binders, None, r.vars)
            cl = expand_clause(program, env, spec, sp)
            out.append(TableCost(r.target, rd.source, n, sum(box_width(b, n) for b in cl.boxes)))
    return out
