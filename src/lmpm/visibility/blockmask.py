"""The analytic BlockMask: FlexAttention's block structure computed from the stencils.

``create_block_mask`` evaluates the mask at all N² (q, kv) pairs and sums each block. We know each
cell's visible set as a union of boxes, so we work with *runs* (maximal intervals of sequence
positions) instead:

1. **Runs per box.** A box in a value laid out raster is a set of contiguous runs: enumerate the
   leading axes up to the last axis ``j`` the box does not cover entirely; every run spans
   ``[lo_j, hi_j]`` × the (whole) later axes. ``Txt[0..t-1]`` and ``Txt[*]`` are one run per cell,
   whatever N. In a tiled/morton value the permuted spatial axes are one run when the box covers
   them entirely (a frame is contiguous in every layout); otherwise each covered cell is a run of
   length 1 (stencil boxes are small). Cost: O(cells × runs per cell).
2. **Merge per cell.** Sort a cell's runs by start and merge overlapping or touching runs
   (``cummax`` of the ends): the merged runs are disjoint, so a kv block is fully visible to a cell
   iff it lies inside exactly one of them.
3. **Count per block pair with difference arrays.** Each merged run ``[s, e]`` of a cell in q block
   ``qb`` *touches* kv blocks ``s//B .. e//B`` and *covers* the complete blocks inside it; both are
   ranges, added as +1/−1 to two (q blocks, kv blocks + 1) arrays and prefix-summed. A block is
   non-empty iff touched, and full iff all ``B_q`` cells of a complete q block cover it. Cost:
   O(runs + q blocks × kv blocks) — the size of the BlockMask itself.

Edge blocks (a partial last block) are never full, as in ``create_block_mask`` (it pads with
False). The result is built exactly as ``create_block_mask`` builds its own (stable descending
argsort of the dense block flags), so the tensors are identical, not just equivalent.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lmpm.visibility._stencil import Clause, Space, serial, strides
from lmpm.visibility.layout import Layout
from lmpm.visibility.maskmod import MaskMod

ROW_CHUNK = 1 << 12  # query cells processed at once; bounds memory for wide boxes
DIFF_CAP = 1 << 15  # entries of one group's difference arrays
ORDER_CHUNK = 1 << 15  # flag entries ordered at once


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
    """Runs of one box at each of n cells: (start, end, valid), each (n, R), positions local to
    the source value (add its base). ``ok`` (n,), ``lo``/``hi`` (n, r) clipped."""
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
        z = torch.zeros((n, 0), dtype=torch.long)
        return z, z, torch.zeros((n, 0), dtype=torch.bool)
    return torch.cat(starts, 1), torch.cat(ends, 1), torch.cat(valids, 1)


def merge_runs(start: Tensor, end: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merge each row's runs into disjoint maximal runs (touching runs merge too).

    Returns (row, start, end), each (M,) — every merged run, row-major."""
    n, width = start.shape
    big = torch.iinfo(torch.long).max // 4
    s = torch.where(valid, start, big)
    s, order = s.sort(1)
    e = end.gather(1, order)
    v = valid.gather(1, order)  # valid runs first in each row
    reach = torch.where(v, e, -2).cummax(1).values  # furthest end so far, (n, R)
    prev = torch.cat([torch.full((n, 1), -2, dtype=torch.long), reach[:, :-1]], 1)
    first = v & (s > prev + 1)  # a run that starts a new merged run
    nxt_breaks = torch.cat([first[:, 1:] | ~v[:, 1:], torch.ones((n, 1), dtype=torch.bool)], 1)
    last = v & nxt_breaks  # the last run of a merged run
    rows = torch.arange(n).unsqueeze(1).expand(n, width)
    return rows[first], s[first], reach[last]


@serial
def block_flags(
    sp: Space, layout: Layout, boxes_of: BoxesOf, q_block: int, kv_block: int
) -> tuple[Tensor, Tensor]:
    """(partial, full): (q blocks, kv blocks) bool, exactly as ``create_block_mask`` finds them.

    ``boxes_of(target, rows)``: the clauses into ``target`` expanded at its canonical ``rows``.
    Streams over groups of q blocks (about ``ROW_CHUNK`` query cells each, in layout order): the
    boxes of just those cells are expanded, turned into runs and counted into small int32
    difference arrays, so peak memory is the two flag arrays plus one group's work."""
    cells = sp.cells
    nq, nkv = -(-cells // q_block), -(-cells // kv_block)
    complete_kv = cells // kv_block  # kv blocks with no padding; only these can be full
    partial = torch.zeros((nq, nkv), dtype=torch.bool)
    full = torch.zeros((nq, nkv), dtype=torch.bool)
    targets = [v for v in sp.names if boxes_of.has(v)]
    if not targets:
        return partial, full
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
                bx = cl.materialize()
                base = sp.base[cl.source]
                for b in range(bx.count):
                    s, e, v = box_runs(bx.ok[b], bx.lo[b], bx.hi[b], cl.sdims, layout, cl.source)
                    parts_s.append(s + base)
                    parts_e.append(e + base)
                    parts_v.append(v)
            if not parts_s:
                continue
            row, s, e = merge_runs(
                torch.cat(parts_s, 1), torch.cat(parts_e, 1), torch.cat(parts_v, 1)
            )
            del parts_s, parts_e, parts_v
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
        partial[qb0:qb1] = touched & ~covered
        full[qb0:qb1] = covered
    return partial, full


def _ordered(flags: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks, indices) from dense (rows, cols) bool flags: non-empty columns first in
    ascending order, then the rest — what ``create_block_mask``'s stable descending argsort
    gives, computed by a prefix sum and a scatter, a few rows at a time, into reused int32
    buffers (no sort, no (rows, cols) temporaries)."""
    flags = flags.contiguous()
    rows, cols = flags.shape
    num = flags.sum(1, dtype=torch.int32)
    idx = torch.empty((rows, cols), dtype=torch.int32)
    col = torch.arange(cols, dtype=torch.int32)
    step = max(1, min(rows, ORDER_CHUNK // max(cols, 1)))
    cs_buf = torch.empty((step, cols), dtype=torch.int32)
    zero_buf = torch.empty((step, cols), dtype=torch.int32)
    pos_buf = torch.empty((step, cols), dtype=torch.long)
    for r0 in range(0, rows, step):
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
    """A real :class:`BlockMask` over the whole sequence (batch 1, head 1, broadcast by FlexAttention).

    The q-side tensors (``q_num_blocks``, ``q_indices``, …) are ordered from the transposed flags
    directly — the same tensors ``BlockMask.from_kv_blocks`` would derive, without its dense
    round trip."""
    qbs, kvbs = (block_size, block_size) if isinstance(block_size, int) else block_size
    partial, full = block_flags(sp, layout, boxes_of, qbs, kvbs)
    dev = torch.device(device)
    kv_num, kv_idx = (x.to(dev) for x in _ordered(partial))
    full_num, full_idx = (x.to(dev) for x in _ordered(full))
    q_num, q_idx = (x.to(dev) for x in _ordered(partial.t()))
    full_q_num, full_q_idx = (x.to(dev) for x in _ordered(full.t()))
    return BlockMask(
        seq_lengths=(sp.cells, sp.cells),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_num,
        full_kv_indices=full_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(qbs, kvbs),
        mask_mod=mask_mod,
    )
