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
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lmpm.ir.nodes import Axis, Binder, Expr, Program
from lmpm.visibility._stencil import Boxes, Space, expand, space, strides


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


def enumerate_boxes(boxes: Boxes, source_dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Every cell of every box, as flat source indices: ((n, K_raw) int64, (n, K_raw) bool).

    Each box is enumerated in raster order (so ascending) over ``max box size`` slots; slot ``j`` of
    a row decodes to per-axis offsets with that row's own extents (mixed radix), so the width is the
    largest box, not the product of per-axis maxima.
    """
    n = boxes.ok.shape[1]
    sstride = strides(source_dims)
    idx_parts: list[Tensor] = []
    val_parts: list[Tensor] = []
    for b in range(boxes.count):
        ok, lo, hi = boxes.ok[b], boxes.lo[b], boxes.hi[b]  # (n,), (n, r), (n, r)
        ext = (hi - lo + 1).clamp(min=0) * ok.unsqueeze(1)  # (n, r); 0 where the box is absent
        size = ext.prod(1) if ext.shape[1] else ok.long()  # (n,); rank 0 never occurs in practice
        width = int(size.max()) if n else 0
        if width == 0:
            continue
        j = torch.arange(width, dtype=torch.long)  # (K_b,)
        valid = j.unsqueeze(0) < size.unsqueeze(1)  # (n, K_b)
        flat = torch.zeros((n, width), dtype=torch.long)
        inner = torch.ones(n, dtype=torch.long)  # running product of extents of later axes
        for a in reversed(range(ext.shape[1])):
            e = ext[:, a].clamp(min=1).unsqueeze(1)  # (n, 1)
            off = (j.unsqueeze(0) // inner.unsqueeze(1)) % e  # (n, K_b)
            flat += (lo[:, a].unsqueeze(1) + off) * sstride[a]
            inner = inner * ext[:, a].clamp(min=1)
        idx_parts.append(flat)
        val_parts.append(valid)
    if not idx_parts:
        return torch.zeros((n, 0), dtype=torch.long), torch.zeros((n, 0), dtype=torch.bool)
    return torch.cat(idx_parts, 1), torch.cat(val_parts, 1)


def dedupe_rows(index: Tensor, valid: Tensor, sentinel: int, *, presorted: bool) -> GatherTable:
    """Sort each row ascending, drop duplicates, left-pack and trim to the widest row."""
    if index.shape[1] == 0:
        return GatherTable(index, valid)
    if not presorted:
        key = torch.where(valid, index, sentinel)
        key, _ = key.sort(1)
        dup = torch.zeros_like(valid)
        dup[:, 1:] = key[:, 1:] == key[:, :-1]
        key = torch.where(dup, sentinel, key)
        key, _ = key.sort(1)  # duplicates (now sentinels) move to the end
        valid = key < sentinel
        index = key
    k = int(valid.sum(1).max()) if valid.shape[0] else 0
    index, valid = index[:, :k], valid[:, :k]
    return GatherTable(torch.where(valid, index, 0).contiguous(), valid.contiguous())


def table_from_boxes(boxes: Boxes, source_dims: tuple[int, ...]) -> GatherTable:
    index, valid = enumerate_boxes(boxes, source_dims)
    # One box per row is already ascending and duplicate-free; several may overlap or interleave.
    return dedupe_rows(index, valid, math.prod(source_dims), presorted=boxes.count <= 1)


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
    boxes = expand(program, env, target, source, axes, binders, guard, target_vars, sp)
    return table_from_boxes(boxes, sp.dims[source])


def union_boxes(
    program: Program, env: Mapping[str, int], sp: Space, target: str, source: str
) -> Boxes:
    parts = [
        expand(program, env, s.target, s.source, s.axes, s.binders, s.guard, s.vars, sp)
        for s in program.stencils
        if s.target == target and s.source == source
    ]
    return Boxes.cat(parts, target, source, sp.size(target), len(sp.dims[source]))


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
    return table_from_boxes(union_boxes(program, env, sp, target, source), sp.dims[source])
