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

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lmpm.visibility._stencil import Boxes, Space, cell_coords, strides
from lmpm.visibility.layout import Layout
from lmpm.visibility.maskmod import MaskMod

ROW_CHUNK = 1 << 15  # target cells processed at once; bounds memory for wide boxes


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


def block_flags(
    sp: Space, layout: Layout, boxes: list[Boxes], q_block: int, kv_block: int
) -> tuple[Tensor, Tensor]:
    """(partial, full): (q blocks, kv blocks) bool, exactly as ``create_block_mask`` finds them."""
    cells = sp.cells
    nq, nkv = -(-cells // q_block), -(-cells // kv_block)
    complete_kv = cells // kv_block  # kv blocks with no padding; only these can be full
    touch = torch.zeros(nq * (nkv + 1), dtype=torch.long)
    cover = torch.zeros(nq * (nkv + 1), dtype=torch.long)
    by_target: dict[str, list[Boxes]] = {}
    for bx in boxes:
        by_target.setdefault(bx.target, []).append(bx)
    for target, group in by_target.items():
        n = sp.size(target)
        q_pos_all = layout.encode(target, cell_coords(sp.dims[target])) if n else None
        for r0 in range(0, n, ROW_CHUNK):
            r1 = min(n, r0 + ROW_CHUNK)
            parts_s: list[Tensor] = []
            parts_e: list[Tensor] = []
            parts_v: list[Tensor] = []
            for bx in group:
                base = sp.base[bx.source]
                for b in range(bx.count):
                    s, e, v = box_runs(
                        bx.ok[b, r0:r1],
                        bx.lo[b, r0:r1],
                        bx.hi[b, r0:r1],
                        sp.dims[bx.source],
                        layout,
                        bx.source,
                    )
                    parts_s.append(s + base)
                    parts_e.append(e + base)
                    parts_v.append(v)
            if not parts_s:
                continue
            row, s, e = merge_runs(
                torch.cat(parts_s, 1), torch.cat(parts_e, 1), torch.cat(parts_v, 1)
            )
            assert q_pos_all is not None
            qb = q_pos_all[r0:r1][row] // q_block  # (M,)
            rowbase = qb * (nkv + 1)
            ones = torch.ones_like(s)
            touch.index_add_(0, rowbase + s // kv_block, ones)
            touch.index_add_(0, rowbase + e // kv_block + 1, -ones)
            f_lo = (s + kv_block - 1) // kv_block
            f_hi = torch.clamp((e + 1) // kv_block - 1, max=complete_kv - 1)
            has = f_lo <= f_hi
            cover.index_add_(0, (rowbase + f_lo)[has], ones[has])
            cover.index_add_(0, (rowbase + f_hi + 1)[has], -ones[has])
    touched = touch.view(nq, nkv + 1).cumsum(1)[:, :nkv] > 0
    full = cover.view(nq, nkv + 1).cumsum(1)[:, :nkv] == q_block
    return touched & ~full, full


def _ordered(flags: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks, indices) from dense (..., rows, cols) flags: non-empty columns first in
    ascending order, then the rest — the same stable argsort ``create_block_mask`` uses."""
    dense = flags.to(torch.int32)
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def build_block_mask(
    sp: Space,
    layout: Layout,
    boxes: list[Boxes],
    mask_mod: MaskMod,
    block_size: int | tuple[int, int] = 128,
    device: str | torch.device = "cpu",
) -> BlockMask:
    """A real :class:`BlockMask` over the whole sequence (batch 1, head 1, broadcast by FlexAttention)."""
    qbs, kvbs = (block_size, block_size) if isinstance(block_size, int) else block_size
    partial, full = block_flags(sp, layout, boxes, qbs, kvbs)
    kv_num, kv_idx = _ordered(partial[None, None])
    full_num, full_idx = _ordered(full[None, None])
    dev = torch.device(device)
    return BlockMask.from_kv_blocks(
        kv_num.to(dev),
        kv_idx.to(dev),
        full_num.to(dev),
        full_idx.to(dev),
        BLOCK_SIZE=(qbs, kvbs),
        mask_mod=mask_mod,
        seq_lengths=(sp.cells, sp.cells),
    )
