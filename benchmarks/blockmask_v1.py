"""The analytic BlockMask build as it was before the static rewrite (issue 31, item 3): the
baseline that ``masks.py --build-counts`` (and the GPU mode) measure the rewrite against, in the
same run. Frozen: do not improve it. It sizes its run tensors from their values (``int(count.max())``,
``bool(mode.any())``), compacts merged runs with boolean masks and expands the clauses with the
value-reading simplifications, so it syncs with the device a number of times set by the program.

It cannot run on the simulated CUDA device: ``torch.tensor(dims)`` under its ``torch.device``
context reaches PyTorch's CUDA guard before any dispatch. Its ops and syncs are the same on every
device, so it is counted on the CPU there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lmpm.visibility import Masks
from lmpm.visibility._stencil import (
    Box,
    Clause,
    Space,
    cell_stencils,
    expand_stencil,
    serial,
    strides,
    vec,
)
from lmpm.visibility.blockmask import SIDES
from lmpm.visibility.layout import Layout
from lmpm.visibility.maskmod import MaskMod

# Each group costs a few host syncs per box (sizes of its run tensors): groups are large so that
# their number, and the syncs, stay small up to ~1M cells; memory per group is bounded instead.
ROW_CHUNK = 1 << 21  # query cells processed at once: a group holds ~ROW_CHUNK × runs per cell
DIFF_CAP = 1 << 27  # entries of one group's two int32 difference arrays (2 × 512 MiB at most)
ORDER_CHUNK = 1 << 24  # flag entries ordered at once (an int64 scatter index of 128 MiB at most)


class BoxesOf(Protocol):
    """Where the block structure gets its boxes: the clauses into a target, expanded at some of
    its canonical rows (so only one group of query cells is ever expanded at once)."""

    def has(self, target: str) -> bool: ...

    def __call__(self, target: str, rows: slice | Tensor) -> list[Clause]: ...


def _decode(slot: Tensor, ext: Tensor) -> Tensor:
    """Mixed-radix decode of ``slot`` (K,) with per-row extents ``ext`` (n, r), last axis
    fastest → (n, K, r) offsets."""
    n, r = ext.shape
    out = torch.zeros((n, slot.numel(), r), dtype=torch.long)
    inner = torch.ones(n, dtype=torch.long)
    for a in reversed(range(r)):
        e = ext[:, a].clamp(min=1)
        out[:, :, a] = (slot.unsqueeze(0) // inner.unsqueeze(1)) % e.unsqueeze(1)
        inner = inner * e
    return out


def box_runs(
    ok: Tensor, lo: Tensor, hi: Tensor, dims: tuple[int, ...], layout: Layout, source: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Runs of one box at each of n cells: (start, end, valid), each (n, R), positions int32 and
    local to the source value (add its base). ``ok`` (n,), ``lo``/``hi`` (n, r) clipped."""
    n, r = lo.shape
    g = layout.spatial(source)
    lead = r - g
    vol = math.prod(dims[lead:])  # cells of one spatial grid (1 when g == 0)
    ext = (hi - lo + 1).clamp(min=0)  # (n, r)
    whole = (lo == 0) & (hi == torch.tensor(dims) - 1)  # (n, r)
    mode_a = ok & whole[:, lead:].all(1)  # spatial part entirely covered (or none)
    starts: list[Tensor] = []
    ends: list[Tensor] = []
    valids: list[Tensor] = []

    # Mode A: raster runs over the leading axes with the spatial grid as one trailing axis.
    if bool(mode_a.any()):
        if lead == 0:
            starts.append(torch.zeros((n, 1), dtype=torch.long))
            ends.append(torch.full((n, 1), vol - 1, dtype=torch.long))
            valids.append(mode_a.unsqueeze(1))
        else:
            ls = torch.tensor(strides(dims[:lead]), dtype=torch.long) * vol  # (lead,)
            lead_whole = whole[:, :lead]
            axis = torch.arange(lead)
            # j: the last leading axis not entirely covered (0 when all are).
            j = torch.where(lead_whole, -1, axis).amax(1).clamp(min=0)  # (n,)
            ext_eff = torch.where(axis < j.unsqueeze(1), ext[:, :lead], 1)  # (n, lead)
            count = torch.where(mode_a, ext_eff.prod(1), 0)  # (n,)
            width = int(count.max())
            slot = torch.arange(width)
            off = _decode(slot, ext_eff)  # (n, K, lead)
            start = ((lo[:, :lead].unsqueeze(1) + off) * ls).sum(-1)  # (n, K)
            lo_j = lo.gather(1, j.unsqueeze(1))
            hi_j = hi.gather(1, j.unsqueeze(1))
            span = (hi_j - lo_j + 1) * ls[j].unsqueeze(1)  # (n, 1)
            starts.append(start)
            ends.append(start + span - 1)
            valids.append(slot.unsqueeze(0) < count.unsqueeze(1))

    # Mode B: the spatial grid is partly covered — every covered cell is its own run.
    mode_b = ok & ~mode_a
    if bool(mode_b.any()):
        count = torch.where(mode_b, ext.prod(1), 0)
        width = int(count.max())
        slot = torch.arange(width)
        coords = lo.unsqueeze(1) + _decode(slot, ext)  # (n, K, r)
        # Slots of absent boxes hold garbage; keep them in bounds for the table lookup.
        coords = torch.minimum(coords.clamp(min=0), torch.tensor(dims) - 1)
        flat = [coords[:, :, a].reshape(-1) for a in range(r)]
        pos = layout.encode(source, flat).view(n, width) - layout.space.base[source]
        starts.append(pos)
        ends.append(pos)
        valids.append(slot.unsqueeze(0) < count.unsqueeze(1))

    if not starts:
        z = torch.zeros((n, 0), dtype=torch.int32)
        return z, z, torch.zeros((n, 0), dtype=torch.bool)
    # int32 from here on: positions are < cells, and the group's runs are its largest tensors.
    return (
        torch.cat(starts, 1).to(torch.int32),
        torch.cat(ends, 1).to(torch.int32),
        torch.cat(valids, 1),
    )


def merge_runs(start: Tensor, end: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merge each row's runs into disjoint maximal runs (touching runs merge too).

    Returns (row, start, end), each (M,) — every merged run, row-major."""
    n, width = start.shape
    s, order = torch.where(valid, start, torch.iinfo(start.dtype).max).sort(1)
    e = end.gather(1, order)
    v = valid.gather(1, order)  # valid runs first in each row
    del order
    reach = torch.where(v, e, -2).cummax(1).values  # furthest end so far, (n, R)
    del e
    first = v.clone()  # a run that starts a new merged run: past everything before it
    first[:, 1:] &= s[:, 1:] > reach[:, :-1] + 1
    last = v.clone()  # the last run of a merged run: the next one starts anew (or is absent)
    last[:, :-1] &= first[:, 1:] | ~v[:, 1:]
    rows = torch.arange(n).unsqueeze(1).expand(n, width)
    return rows[first], s[first], reach[last]


def _one_box(cl: Clause, box: Box) -> tuple[Tensor, Tensor, Tensor]:
    """One box of ``cl`` as (ok (n,), lo (n, r), hi (n, r)), clipped — ``Clause.materialize``
    for a single box, so a group never holds every box of a clause at once."""
    n = cl.n
    lo = [vec(x, n).clamp(min=0) for x in box.lo]
    hi = [vec(x, n).clamp(max=size - 1) for x, size in zip(box.hi, cl.sdims)]
    empty = torch.zeros((n, 0), dtype=torch.long)
    return (
        vec(box.ok, n, torch.bool),
        torch.stack(lo, -1) if lo else empty,
        torch.stack(hi, -1) if hi else empty,
    )


def _groups(
    sp: Space, layout: Layout, boxes_of: BoxesOf, q_block: int, kv_block: int
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """(first q block, partial, full) per group of q blocks (about ``ROW_CHUNK`` query cells, in
    layout order), each flag array (q blocks of the group, kv blocks) bool, exactly as
    ``create_block_mask`` finds them.

    ``boxes_of(target, rows)``: the clauses into ``target`` expanded at its canonical ``rows``.
    Only the group's boxes are expanded, turned into runs and counted into small int32 difference
    arrays, so the work never holds more than one group."""
    cells = sp.cells
    nq, nkv = -(-cells // q_block), -(-cells // kv_block)
    complete_kv = cells // kv_block  # kv blocks with no padding; only these can be full
    targets = [v for v in sp.names if boxes_of.has(v)]
    group = max(1, min(ROW_CHUNK // q_block, DIFF_CAP // (nkv + 1)))
    for qb0 in range(0, nq, group):
        qb1 = min(nq, qb0 + group)
        p0, p1 = qb0 * q_block, min(cells, qb1 * q_block)
        g = qb1 - qb0
        touch = torch.zeros(g * (nkv + 1), dtype=torch.int32)
        cover = torch.zeros(g * (nkv + 1), dtype=torch.int32)
        for target in targets:
            b0, n = sp.base[target], sp.size(target)
            lo_p, hi_p = max(p0, b0), min(p1, b0 + n)
            if lo_p >= hi_p:
                continue
            # The target's cells at layout positions [lo_p, hi_p), as canonical rows.
            rows: slice | Tensor
            if layout.inner[target] is None or layout.to_canon is None:
                rows = slice(lo_p - b0, hi_p - b0)
            else:
                rows = layout.to_canon[lo_p:hi_p] - b0
            parts_s: list[Tensor] = []
            parts_e: list[Tensor] = []
            parts_v: list[Tensor] = []
            for cl in boxes_of(target, rows):
                base = sp.base[cl.source]
                for box in cl.boxes:
                    s, e, v = box_runs(*_one_box(cl, box), cl.sdims, layout, cl.source)
                    parts_s.append(s + base)
                    parts_e.append(e + base)
                    parts_v.append(v)
            if not parts_s:
                continue
            start, end, valid = (torch.cat(p, 1) for p in (parts_s, parts_e, parts_v))
            del parts_s, parts_e, parts_v
            row, s, e = merge_runs(start, end, valid)
            del start, end, valid
            # Row i sits at layout position lo_p + i.
            rowbase = ((row + lo_p) // q_block - qb0) * (nkv + 1)
            ones = torch.ones(s.shape, dtype=torch.int32)
            touch.index_add_(0, rowbase + s // kv_block, ones)
            touch.index_add_(0, rowbase + e // kv_block + 1, -ones)
            f_lo = (s + kv_block - 1) // kv_block
            f_hi = torch.clamp((e + 1) // kv_block - 1, max=complete_kv - 1)
            has = f_lo <= f_hi
            cover.index_add_(0, (rowbase + f_lo)[has], ones[has])
            cover.index_add_(0, (rowbase + f_hi + 1)[has], -ones[has])
        touched = touch.view(g, nkv + 1).cumsum_(1)[:, :nkv] > 0
        covered = cover.view(g, nkv + 1).cumsum_(1)[:, :nkv] == q_block
        yield qb0, touched & ~covered, covered


@serial
def block_flags(
    sp: Space, layout: Layout, boxes_of: BoxesOf, q_block: int, kv_block: int
) -> tuple[Tensor, Tensor]:
    """(partial, full): (q blocks, kv blocks) bool, exactly as ``create_block_mask`` finds them."""
    nq, nkv = -(-sp.cells // q_block), -(-sp.cells // kv_block)
    partial = torch.zeros((nq, nkv), dtype=torch.bool)
    full = torch.zeros((nq, nkv), dtype=torch.bool)
    for qb0, p, f in _groups(sp, layout, boxes_of, q_block, kv_block):
        partial[qb0 : qb0 + p.shape[0]] = p
        full[qb0 : qb0 + f.shape[0]] = f
    return partial, full


def _ordered(flags: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks (1, 1, rows) int32, indices (1, 1, rows, cols) int32, contiguous) from dense
    (rows, cols) bool flags, on their device: each row the non-empty columns ascending, then the
    empty ones ascending — exactly ``create_block_mask``'s stable descending argsort, computed by
    a prefix sum and a scatter (no sort), ``ORDER_CHUNK`` entries at a time into reused buffers.

    Contiguous on purpose: the compiled CUDA kernel misread rows that overlap (an earlier layout
    gave row ``r`` stride = the most blocks in any row, so a row's undefined tail aliased the next
    rows: max error 0.84 against SDPA on an H200, docs/visibility.md). The cost is the dense
    layout's: ``rows × cols × 4`` bytes per side, four sides."""
    flags = flags.contiguous()
    rows, cols = flags.shape
    dev = flags.device
    num = flags.sum(1, dtype=torch.int32)
    idx = torch.empty((rows, cols), dtype=torch.int32, device=dev)
    col = torch.arange(cols, dtype=torch.int32, device=dev)
    step = max(1, min(rows, ORDER_CHUNK // max(cols, 1)))
    cs_buf = torch.empty((step, cols), dtype=torch.int32, device=dev)
    zero_buf = torch.empty((step, cols), dtype=torch.int32, device=dev)
    pos_buf = torch.empty((step, cols), dtype=torch.long, device=dev)
    for r0 in range(0, rows, step):  # rows × cols / ORDER_CHUNK steps, no host sync
        f = flags[r0 : r0 + step]
        k = f.shape[0]
        cs, zero, pos = cs_buf[:k], zero_buf[:k], pos_buf[:k]
        torch.cumsum(f, 1, dtype=torch.int32, out=cs)  # non-empty columns up to here
        torch.sub(col, cs, out=zero)
        zero += num[r0 : r0 + k].unsqueeze(1)  # an empty column's place: after every non-empty
        cs -= 1  # a non-empty column's place
        torch.where(f, cs, zero, out=zero)
        pos.copy_(zero)
        idx[r0 : r0 + k].scatter_(1, pos, col.expand(k, cols))
    return num[None, None], idx[None, None]


@serial
def build_block_mask(
    sp: Space,
    layout: Layout,
    boxes_of: BoxesOf,
    mask_mod: MaskMod,
    block_size: int | tuple[int, int] = 128,
    device: str | torch.device = "cpu",
) -> BlockMask:
    """A real :class:`BlockMask` over the whole sequence (batch 1, head 1, broadcast by
    FlexAttention), built on ``device``.

    Its tensors are those of ``create_block_mask(mask_mod, 1, 1, cells, cells, BLOCK_SIZE=…)``,
    exactly: ``*_num_blocks`` and contiguous ``(1, 1, rows, cols)`` int32 ``*_indices`` (each row
    the non-empty blocks ascending, then the empty ones). The q-side tensors (``q_num_blocks``,
    ``q_indices``, …, read by the backward pass) come from the transposed flags — what
    ``BlockMask.from_kv_blocks`` derives. Every step runs on ``device`` (a ``torch.device``
    context makes the builders' factory calls allocate there), with a number of host syncs that
    depends on the program, not on the number of cells."""
    qbs, kvbs = (block_size, block_size) if isinstance(block_size, int) else block_size
    dev = torch.device(device)
    with dev:
        partial, full = block_flags(sp, layout.to(dev), boxes_of, qbs, kvbs)
        sides = {
            "kv": _ordered(partial),
            "full_kv": _ordered(full),
            "q": _ordered(partial.t()),
            "full_q": _ordered(full.t()),
        }
    return _assemble(sides, (sp.cells, sp.cells), (qbs, kvbs), mask_mod)


def _assemble(
    sides: Mapping[str, tuple[Tensor | None, Tensor | None]],
    seq_lengths: tuple[int, int],
    block: tuple[int, int],
    mask_mod: MaskMod,
) -> BlockMask:
    """A BlockMask from its (num_blocks, indices) pair per side of ``SIDES``."""
    kw: dict[str, Any] = {}
    for side in SIDES:
        kw[f"{side}_num_blocks"], kw[f"{side}_indices"] = sides[side]
    return BlockMask(seq_lengths=seq_lengths, BLOCK_SIZE=block, mask_mod=mask_mod, **kw)


class Expanded:
    """The clauses of a :class:`~lmpm.visibility.Masks`, expanded as they were (reading values to
    drop empty boxes and needless clips), a group of rows at a time."""

    def __init__(self, m: Masks) -> None:
        self.m = m
        self.stencils = cell_stencils(m.program, m.space)

    def has(self, target: str) -> bool:
        return any(s.target == target for s in self.stencils)

    def __call__(self, target: str, rows: slice | Tensor) -> list[Clause]:
        m = self.m
        return [
            expand_stencil(m.program, m.env, s, m.space, rows)
            for s in self.stencils
            if s.target == target
        ]


def build(m: Masks, block: int, device: str | torch.device = "cpu") -> BlockMask:
    """``m.block_mask(block, device, cache=False)`` as it was built before."""
    return build_block_mask(
        m.space, m.layout_of(), Expanded(m), m.mask_mod_on(device), block, device
    )
