"""The analytic BlockMask: FlexAttention's block structure computed from the stencils.

``create_block_mask`` evaluates the mask at all N² (q, kv) pairs and sums each block. We know each
cell's visible set as a union of boxes, so we work with *runs* (intervals of sequence positions)
instead:

1. **Runs per box** (:func:`box_runs`). A box in a value laid out raster is a set of contiguous
   runs: enumerate the leading axes up to the last axis ``j`` that is not ``*``; every run spans
   ``[lo_j, hi_j]`` × the (whole) later axes. ``Txt[0..t-1]`` and ``Txt[*]`` are one run per
   cell, whatever N. In a tiled/morton value the permuted spatial axes are one run when the box
   covers them entirely (a frame is contiguous in every layout); otherwise each covered cell is a
   run of length 1 (stencil boxes are small). Cost: O(cells × runs per cell).
2. **Merge per cell** (:func:`merge_runs`). Sort a cell's runs by start and merge overlapping or
   touching runs (``cummax`` of the ends): the merged runs are disjoint, so a kv block is fully
   visible to a cell iff it lies inside exactly one of them.
3. **Count per block pair with difference arrays.** Each merged run ``[s, e]`` of a cell in q block
   ``qb`` *touches* kv blocks ``s//B .. e//B`` and *covers* the complete blocks inside it; both are
   ranges, added as +1/−1 to two (q blocks, kv blocks + 1) arrays and prefix-summed. A block is
   non-empty iff touched, and full iff all ``B_q`` cells of a complete q block cover it. Cost:
   O(runs + q blocks × kv blocks) time (prefix sums), memory one group's rows of the arrays.
4. **Index tensors** (:func:`_ordered`): from the (q blocks, kv blocks) flags, per row the
   non-empty blocks ascending then the empty ones — ``create_block_mask``'s exact tensors,
   contiguous (the compiled CUDA kernel misreads overlapping rows); the q side, for the backward
   pass, from the transposed flags.

**Static shapes, no host sync.** Every tensor's size is known on the host from the program and its
sizes, never read from a tensor: the clauses are expanded statically (``expand_clause(...,
static=True)``: host bounds of the index expressions decide clips and tests, and bound each box's
extent, ``Box.most``), a cell's runs are a fixed number of slots (absent ones masked by ``valid``,
with weight 0 in the counts), and no step compacts with a boolean mask. On a GPU the build is a
fixed sequence of kernels that the host queues without waiting (the simulated CUDA device of
``lmpm.workers.simcuda`` checks it: tests/visibility/test_blockmask_device.py), and it traces
into one static graph. The price: a cell's slots that a box leaves empty are still computed
(``Box.most`` is a bound, not the count).

Edge blocks (a partial last block) are never full, as in ``create_block_mask`` (it pads with
False). Groups are large (``ROW_CHUNK`` query cells, ``DIFF_CAP`` difference-array entries), so a
1M-cell video is one group. :func:`block_sets` compares block sets whatever the layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lmpm.visibility._stencil import Box, Clause, Space, dev, on_device, serial, strides
from lmpm.visibility.expr import Val, and_, not_
from lmpm.visibility.layout import Layout
from lmpm.visibility.maskmod import MaskMod

# Groups bound the memory of one step (every op of a group is a kernel, whatever its size: groups
# are large so that their number, and the kernels, stay small up to ~1M cells).
ROW_CHUNK = 1 << 21  # query cells processed at once: a group holds ~ROW_CHUNK × runs per cell
DIFF_CAP = 1 << 27  # entries of one group's two int32 difference arrays (2 × 512 MiB at most)
ORDER_CHUNK = 1 << 24  # flag entries ordered at once (an int64 index of 128 MiB at most)


class BoxesOf(Protocol):
    """Where the block structure gets its boxes: the clauses into a target, expanded statically
    (``Box.most`` set, nothing read from a tensor) at some of its canonical rows (so only one
    group of query cells is ever expanded at once)."""

    def has(self, target: str) -> bool: ...

    def __call__(self, target: str, rows: slice | Tensor) -> list[Clause]: ...


# Position parts shared by the boxes of one target's cells, by their linear form's coefficients:
# (n, 1) int64 tensors.
Shared = dict[tuple[tuple[str, int], ...], Tensor]


class Runs(NamedTuple):
    """Runs of sequence positions, per query cell: (n, R) each, ``R`` known on the host."""

    start: Tensor  # (n, R) int64, first position (absolute, in layout order)
    end: Tensor  # (n, R) int64, last position
    valid: Tensor | None  # (n, R) bool: the run exists (others hold anything); None: all do


def _cell(x: Val) -> Val:
    """A per-cell value as an (n, 1) column (a constant stays one), to broadcast against slots."""
    return x.unsqueeze(1) if isinstance(x, Tensor) else x


def _plus(x: Val, y: Val) -> Val:
    """``x + y``, no op where one is the constant 0."""
    if isinstance(y, int) and y == 0:
        return x
    if isinstance(x, int) and x == 0:
        return y
    return x + y


def _times(x: Val, k: int) -> Val:
    """``x * k``, no op where ``k`` is 1."""
    return x if k == 1 else x * k


def _runs(start: Val, end: Val, valid: Val, n: int, width: int) -> Runs:
    """Runs from values that broadcast to (n, width) (python constants included)."""

    def full(x: Val, dtype: torch.dtype) -> Tensor:
        t = x if isinstance(x, Tensor) else torch.full((1, 1), x, dtype=dtype, device=dev())
        return t.expand(n, width)

    mask = None if valid is True else full(valid, torch.bool)
    return Runs(full(start, torch.long), full(end, torch.long), mask)


def _extent(box: Box, a: int) -> Val:
    """Cells of ``box`` along axis ``a``, at least 1 (slots of absent boxes are decoded too)."""
    e = box.extent(a)
    return e.clamp(min=1) if isinstance(e, Tensor) else max(e, 1)


def _linear_start(cl: Clause, box: Box, ls: list[int], base: int, cache: Shared) -> Val | None:
    """``base + sum(lo[a] * ls[a])`` over the first ``len(ls)`` axes, from the boxes' linear
    forms (None where one has none): a constant plus a combination of the target's variables
    that ``cache`` keeps, so boxes differing by constants (``x + dx``) share it (one add each)."""
    if len(box.lo_linear) < len(ls) or any(f is None for f in box.lo_linear[: len(ls)]):
        return None
    const, coef = base, dict[str, int]()
    for form, stride in zip(box.lo_linear, ls):
        assert form is not None
        const += form[0] * stride
        for var, c in form[1]:
            coef[var] = coef.get(var, 0) + c * stride
    key = tuple(sorted((v, c) for v, c in coef.items() if c))
    if key and key not in cache:
        acc: Val = 0
        for var, c in key:
            acc = _plus(acc, _times(cl.coords[var], c))
        assert isinstance(acc, Tensor)
        cache[key] = acc.unsqueeze(1)
    return _plus(cache[key], const) if key else const


def _raster_runs(
    cl: Clause,
    box: Box,
    valid: Val,
    lead: int,
    vol: int,
    base: int,
    cache: Shared,
) -> Runs:
    """Mode A of :func:`box_runs`: raster runs over the leading axes, the spatial grid (``vol``
    cells, covered entirely) as one trailing axis. ``j``, the last leading axis not statically
    whole, spans each run; every axis before it is enumerated (``Box.most`` bounds the slots).
    A ``j`` past the last axis not covered at some cell only splits a run into touching ones,
    which :func:`merge_runs` joins again."""
    n = cl.n
    if lead == 0:
        return _runs(base, base + vol - 1, _cell(valid), n, 1)
    ls = [s * vol for s in strides(cl.sdims[:lead])]
    j = max((a for a in range(lead) if not _whole(cl, box, a)), default=0)
    slots = math.prod(box.most[:j])
    if slots == 1:  # every axis before j is one index where the box exists
        start = _linear_start(cl, box, ls[: j + 1], base, cache)
        if start is not None:  # shared with the target's other boxes: the end from the extent
            span = 0 if box.point[j] else _times(_cell(box.hi[j] - box.lo[j]), ls[j])
            return _runs(start, _plus(start, _plus(span, ls[j] - 1)), _cell(valid), n, 1)
    head: Val = base  # the position of a run's first cell, less axis j's part
    if slots == 1:
        for a in range(j):
            head = _plus(head, _times(_cell(box.lo[a]), ls[a]))
        mask = _cell(valid)
    else:
        slot = torch.arange(slots, device=dev())
        inner: Val = 1
        for a in reversed(range(j)):  # mixed radix, last axis fastest
            e = _cell(_extent(box, a))
            head = _plus(head, (_cell(box.lo[a]) + (slot // inner) % e) * ls[a])
            inner = inner * e
        mask = and_(_cell(valid), slot < inner)
    start = _plus(head, _times(_cell(box.lo[j]), ls[j]))
    last = start if box.point[j] else _plus(head, _times(_cell(box.hi[j]), ls[j]))
    return _runs(start, _plus(last, ls[j] - 1), mask, n, slots)


def _cell_runs(cl: Clause, box: Box, valid: Val, layout: Layout) -> Runs:
    """Mode B of :func:`box_runs`: the spatial grid partly covered, every covered cell its own
    run (stencil boxes are small: ``Box.most`` bounds them)."""
    slots = math.prod(box.most)
    slot = torch.arange(slots, device=dev())
    coords: list[Tensor] = []
    inner: Val = 1
    for a in reversed(range(len(cl.sdims))):
        e = _cell(_extent(box, a))
        c = _cell(box.lo[a]) + (slot // inner) % e
        # Slots of absent boxes hold anything; keep them in bounds for the table lookup.
        coords.append(c.clamp(0, cl.sdims[a] - 1))
        inner = inner * e
    pos = layout.encode(cl.source, coords[::-1])
    return _runs(pos, pos, and_(_cell(valid), slot < inner), cl.n, slots)


def box_runs(
    cl: Clause,
    box: Box,
    layout: Layout,
    cache: Shared | None = None,
) -> list[Runs]:
    """The runs of one box of ``cl`` (a static expansion: ``Box.most`` set) at each of its cells,
    absolute positions, without reading a tensor on the host: (n, slots) tensors, ``slots``
    bounded from the program.

    A box whose spatial grid (tiled/morton layouts) is entirely covered is raster runs (mode A);
    otherwise each covered cell is a run (mode B). Which one is decided from the clause where it
    can be (``*`` axes, single indices), and per cell otherwise (both, with complementary
    ``valid``). ``cache``: position parts shared by the boxes of one target's cells."""
    assert len(box.most) == len(cl.sdims), "box_runs sizes by Box.most: a static expansion"
    cache = {} if cache is None else cache
    dims = cl.sdims
    g = layout.spatial(cl.source)
    lead = len(dims) - g
    vol = math.prod(dims[lead:])  # cells of one spatial grid (1 when g == 0)
    base = layout.space.base[cl.source]
    spatial = range(lead, len(dims))
    if all(_whole(cl, box, a) for a in spatial):
        return [_raster_runs(cl, box, box.ok, lead, vol, base, cache)]
    if any(box.point[a] and dims[a] > 1 for a in spatial):
        return [_cell_runs(cl, box, box.ok, layout)]
    covered: Val = box.ok
    for a in spatial:
        covered = and_(covered, and_(box.lo[a] == 0, box.hi[a] == dims[a] - 1))
    rest = and_(box.ok, not_(covered))
    runs = [] if covered is False else [_raster_runs(cl, box, covered, lead, vol, base, cache)]
    return runs + ([] if rest is False else [_cell_runs(cl, box, rest, layout)])


def _whole(cl: Clause, box: Box, a: int) -> bool:
    """Axis ``a`` of ``box`` statically the whole axis: ``*``, or ``0..n-1`` in constants."""
    lo, hi = box.lo[a], box.hi[a]
    whole_range = isinstance(lo, int) and isinstance(hi, int) and (lo, hi) == (0, cl.sdims[a] - 1)
    return cl.whole[a] or whole_range


def _joined(parts: list[Runs]) -> Runs:
    """The runs of several boxes side by side, (n, R) with R the sum of their widths."""
    if len(parts) == 1:
        return parts[0]
    masks = [p.valid for p in parts]
    valid = None
    if any(m is not None for m in masks):
        valid = torch.cat(
            [
                m if m is not None else torch.ones(p.start.shape, dtype=torch.bool, device=dev())
                for m, p in zip(masks, parts)
            ],
            1,
        )
    return Runs(torch.cat([p.start for p in parts], 1), torch.cat([p.end for p in parts], 1), valid)


def merge_runs(runs: Runs) -> Runs:
    """Each row's runs merged into disjoint maximal runs (touching runs merge too), same shape:
    a merged run sits at the entry of its last part (``valid``), from ``start`` to ``end``; the
    other entries hold positions of the sequence (0 or a valid run's), so that any block number
    made from them is in range."""
    n, width = runs.start.shape
    if runs.valid is None:
        if width == 1:
            return runs
        v = torch.ones((n, width), dtype=torch.bool, device=dev())
        runs = Runs(runs.start, runs.end, v)
    assert runs.valid is not None
    if width == 1:
        return Runs(
            torch.where(runs.valid, runs.start, 0), torch.where(runs.valid, runs.end, 0), runs.valid
        )
    s, order = torch.where(runs.valid, runs.start, torch.iinfo(torch.long).max).sort(1)
    v = runs.valid.gather(1, order)  # valid runs first in each row
    reach = torch.where(v, runs.end.gather(1, order), 0).cummax(1).values  # furthest end so far
    yes = torch.ones((n, 1), dtype=torch.bool, device=dev())
    # A run that starts a merged run: past everything before it.
    first = v & torch.cat([yes, s[:, 1:] > reach[:, :-1] + 1], 1)
    # The last part of a merged run: the next run starts anew (or is absent).
    last = v & torch.cat([first[:, 1:] | ~v[:, 1:], yes], 1)
    begin = torch.where(first, s, 0).cummax(1).values  # the start of the merged run so far
    return Runs(begin, reach, last)


def _count(
    touch: Tensor, cover: Tensor, merged: Runs, rowbase: Tensor, kv_block: int, complete_kv: int
) -> None:
    """Add one target's merged runs to a group's int32 difference arrays: the kv blocks each run
    touches (``touch``) and those it covers entirely (``cover``), as +1 at the first block and
    −1 past the last, per q block row (``rowbase`` (n, 1): the row's offset)."""
    s, e, w = merged
    exists = (
        torch.ones(1, dtype=torch.int32, device=dev()).expand(s.numel())
        if w is None
        else w.view(-1)
    )
    one = exists.to(torch.int32)  # absent runs count 0
    touch.index_add_(0, (rowbase + s // kv_block).view(-1), one)
    touch.index_add_(0, (rowbase + e // kv_block + 1).view(-1), one, alpha=-1)
    c0 = rowbase + (s + (kv_block - 1)) // kv_block  # the first complete kv block inside
    c1 = rowbase + ((e + 1) // kv_block).clamp(max=complete_kv)  # past the last one
    covers = c0 < c1 if w is None else w & (c0 < c1)  # at least one complete kv block
    some = covers.view(-1).to(torch.int32)
    cover.index_add_(0, c0.view(-1), some)
    cover.index_add_(0, c1.view(-1), some, alpha=-1)


def _groups(
    sp: Space, layout: Layout, boxes_of: BoxesOf, q_block: int, kv_block: int, out: Tensor
) -> None:
    """Write (partial, full) into ``out`` (2, q blocks, kv blocks) bool, exactly as
    ``create_block_mask`` finds them, a group of q blocks at a time (about ``ROW_CHUNK`` query
    cells, in layout order).

    ``boxes_of(target, rows)``: the clauses into ``target`` statically expanded at its canonical
    ``rows``. Only the group's boxes are expanded, turned into runs and counted into small int32
    difference arrays, so the work never holds more than one group. Every size is known on the
    host: nothing here reads a tensor."""
    cells = sp.cells
    nq, nkv = -(-cells // q_block), -(-cells // kv_block)
    complete_kv = cells // kv_block  # kv blocks with no padding; only these can be full
    targets = [v for v in sp.names if boxes_of.has(v)]
    group = max(1, min(ROW_CHUNK // q_block, DIFF_CAP // (nkv + 1)))
    for qb0 in range(0, nq, group):
        qb1 = min(nq, qb0 + group)
        p0, p1 = qb0 * q_block, min(cells, qb1 * q_block)
        g = qb1 - qb0
        buf = torch.zeros((2, g * (nkv + 1)), dtype=torch.int32, device=dev())
        touch, cover = buf  # the difference arrays of touched and of covered blocks
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
            shared: Shared = {}
            parts = [
                r
                for cl in boxes_of(target, rows)
                for box in cl.boxes
                for r in box_runs(cl, box, layout, shared)
            ]
            if not parts:
                continue
            runs = _joined(parts)
            del parts
            # Row i sits at layout position lo_p + i.
            q_row = torch.arange(lo_p, hi_p, device=dev()) // q_block
            rowbase = (q_row - qb0 if qb0 else q_row) * (nkv + 1)
            _count(touch, cover, merge_runs(runs), rowbase.unsqueeze(1), kv_block, complete_kv)
        counts = buf.view(2, g, nkv + 1).cumsum_(2)[:, :, :nkv]
        partial, full = out[:2, qb0:qb1]
        torch.gt(counts[0], 0, out=partial)  # touched...
        torch.eq(counts[1], q_block, out=full)
        partial ^= full  # ...and not covered (a covered block is touched)


@serial
def block_flags(
    sp: Space, layout: Layout, boxes_of: BoxesOf, q_block: int, kv_block: int
) -> tuple[Tensor, Tensor]:
    """(partial, full): (q blocks, kv blocks) bool, exactly as ``create_block_mask`` finds them."""
    out = _flags(sp, layout, boxes_of, q_block, kv_block, 2)
    return out[0], out[1]


def _flags(
    sp: Space, layout: Layout, boxes_of: BoxesOf, q_block: int, kv_block: int, k: int
) -> Tensor:
    """(k, q blocks, kv blocks) bool, (partial, full) in the first two."""
    nq, nkv = -(-sp.cells // q_block), -(-sp.cells // kv_block)
    out = torch.empty((k, nq, nkv), dtype=torch.bool, device=dev())
    _groups(sp, layout, boxes_of, q_block, kv_block, out)
    return out


def _ordered(flags: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per (rows, cols) bool flag array of ``flags`` (k, rows, cols): (num_blocks (1, 1, rows)
    int32, indices (1, 1, rows, cols) int32, contiguous, its own storage), on their device: each
    row the non-empty columns ascending, then the empty ones ascending — exactly
    ``create_block_mask``'s stable descending argsort. Up to ``ORDER_CHUNK`` entries in all, that
    argsort, once for the k arrays (few kernels: small masks are launch-bound); past it, a prefix
    sum and a scatter per chunk of rows (linear work, reused buffers: large masks are
    bandwidth-bound, and a sort of 8k-long rows is not).

    Contiguous on purpose: the compiled CUDA kernel misread rows that overlap (an earlier layout
    gave row ``r`` stride = the most blocks in any row, so a row's undefined tail aliased the next
    rows: max error 0.84 against SDPA on an H200, docs/visibility.md). The cost is the dense
    layout's: ``rows × cols × 4`` bytes per side, four sides."""
    k, rows, cols = flags.shape
    num = flags.sum(2, dtype=torch.int32)  # (k, rows)
    sides = num.view(k, 1, 1, rows)
    if k * rows * cols <= ORDER_CHUNK:  # each side's indices a fresh tensor by one conversion
        order = torch.argsort(flags, dim=2, descending=True, stable=True).view(k, 1, 1, rows, cols)
        return [(sides[i], order[i].to(torch.int32)) for i in range(k)]
    idx = [torch.empty((1, 1, rows, cols), dtype=torch.int32, device=dev()) for _ in range(k)]
    col = torch.arange(cols, dtype=torch.int32, device=dev())
    step = max(1, min(rows, ORDER_CHUNK // max(cols, 1)))
    cs_buf = torch.empty((step, cols), dtype=torch.int32, device=dev())
    place_buf = torch.empty((step, cols), dtype=torch.int32, device=dev())
    pos_buf = torch.empty((step, cols), dtype=torch.long, device=dev())
    for i in range(k):
        for r0 in range(0, rows, step):  # rows × cols / ORDER_CHUNK steps, no host sync
            f = flags[i, r0 : r0 + step]
            n = f.shape[0]
            cs, place, pos = cs_buf[:n], place_buf[:n], pos_buf[:n]
            torch.cumsum(f, 1, dtype=torch.int32, out=cs)  # non-empty columns up to here
            torch.sub(col, cs, out=place)
            place += num[i, r0 : r0 + n].unsqueeze(1)  # an empty column: after every non-empty
            cs -= 1  # a non-empty column's place
            torch.where(f, cs, place, out=place)
            pos.copy_(place)
            idx[i][0, 0, r0 : r0 + n].scatter_(1, pos, col.expand(n, cols))
    return [(sides[i], idx[i]) for i in range(k)]


def _sides(
    sp: Space, layout: Layout, boxes_of: BoxesOf, q_block: int, kv_block: int
) -> dict[str, tuple[Tensor, Tensor]]:
    """The four (num_blocks, indices) pairs of ``SIDES``; the q sides (for the backward pass)
    from the transposed flags, in the same ordering when the shapes agree (square)."""
    nq, nkv = -(-sp.cells // q_block), -(-sp.cells // kv_block)
    flags = _flags(sp, layout, boxes_of, q_block, kv_block, 4 if nq == nkv else 2)
    if nq == nkv:
        flags[2:].copy_(flags[:2].transpose(1, 2))
        pairs = _ordered(flags)
    else:
        pairs = _ordered(flags) + _ordered(flags.transpose(1, 2).contiguous())
    return dict(zip(SIDES, pairs))


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
    ``BlockMask.from_kv_blocks`` derives. Every step runs on ``device`` (the builders' factory
    calls allocate where :func:`~lmpm.visibility._stencil.on_device` says) with sizes known on
    the host: no host sync (nothing reads a tensor's value, no output's size depends on the
    data)."""
    qbs, kvbs = (block_size, block_size) if isinstance(block_size, int) else block_size
    where = torch.device(device)
    with on_device(where):
        sides = _sides(sp, layout.to(where), boxes_of, qbs, kvbs)
    return _assemble(sides, (sp.cells, sp.cells), (qbs, kvbs), mask_mod)


SIDES = ("kv", "full_kv", "q", "full_q")  # a BlockMask's (num_blocks, indices) pairs


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


def _listed(num: Tensor, idx: Tensor) -> Tensor:
    """(rows, cols) bool: the blocks in each row's defined prefix of one (1, 1, …) pair."""
    n, i = num[0, 0].cpu().long(), idx[0, 0].cpu()
    rows, cols = i.shape
    width = int(n.max()) if rows else 0
    listed = torch.arange(width) < n.unsqueeze(1)  # (rows, width)
    flags = torch.zeros((rows, cols), dtype=torch.bool)
    flags[listed.nonzero()[:, 0], i[:, :width][listed].long()] = True
    return flags


def block_sets(bm: BlockMask) -> dict[str, Tensor]:
    """The blocks ``bm`` (batch 1, head 1) lists, per side (``SIDES``) that it has: (rows, cols)
    bool flags, whatever the index layout — two BlockMasks visit the same blocks iff these are
    equal (``kv``/``full_kv``: rows are q blocks; ``q``/``full_q``: rows are kv blocks)."""
    out: dict[str, Tensor] = {}
    for side in SIDES:
        num, idx = getattr(bm, f"{side}_num_blocks"), getattr(bm, f"{side}_indices")
        if num is not None and idx is not None:
            out[side] = _listed(num, idx)
    return out


def with_dense_indices(bm: BlockMask) -> BlockMask:
    """``bm`` (batch 1, head 1) with its index tensors laid out as ``create_block_mask`` lays
    them out: contiguous (rows, cols), each row the non-empty columns ascending, then the empty
    ones ascending — for code that reads past ``num_blocks`` or compares raw tensors
    (FlexAttention does neither). Memory: four dense (rows × cols) int32 tensors."""
    dev = bm.kv_indices.device
    dense: dict[str, tuple[Tensor | None, Tensor | None]] = dict.fromkeys(SIDES, (None, None))
    for side, flags in block_sets(bm).items():
        [(num, idx)] = _ordered(flags[None])
        dense[side] = num.to(dev), idx.to(dev)
    assert dense["kv"][0] is not None and dense["kv"][1] is not None
    return _assemble(dense, bm.seq_lengths, bm.BLOCK_SIZE, bm.mask_mod)
