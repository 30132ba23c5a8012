"""The visibility compiler: ``visible`` clauses → masks, BlockMasks, gather tables, layouts.

Every product is derived from one representation, the clause *boxes* (per target cell and binder
combination, an interval per source axis; :mod:`lmpm.visibility._stencil`):

- :mod:`~lmpm.visibility.layout`: the cells of all non-Set values in one sequence (raster, tiled,
  morton);
- :mod:`~lmpm.visibility.maskmod`: the FlexAttention ``mask_mod``;
- :mod:`~lmpm.visibility.blockmask`: the analytic ``BlockMask`` (no N×N tensor);
- :mod:`~lmpm.visibility.dense`: the dense mask and an SDPA fallback;
- :mod:`~lmpm.visibility.gather`: gather tables for local rules.

>>> m = compile_masks("param N = 6\\nvalue Txt : Token[Byte] shape Seq(N)\\n"
...                   "visible Txt[t] <- Txt[0..t-1] when t > 0\\n", N=4)
>>> m.cells, m.layout
(4, 'raster')
>>> m.dense().int().tolist()
[[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
>>> m.degenerate[0].pattern
'Txt[0]'
>>> bm = m.block_mask(block_size=2)
>>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
([[[1, 1]]], [[[0, 1]]])
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lmpm.errors import UsageError
from lmpm.ir.eval import bind_params
from lmpm.ir.nodes import Program
from lmpm.visibility._stencil import (
    Clause,
    ClauseSpec,
    Space,
    cell_coords,
    cell_stencils,
    expand,
    expand_stencil,
    space,
)
from lmpm.visibility.blockmask import block_flags, build_block_mask
from lmpm.visibility.dense import dense_mask, sdpa
from lmpm.visibility.gather import GatherTable, gather_table, table_from_clauses, visible_union
from lmpm.visibility.layout import DEFAULT_TILE, LAYOUTS, Layout, make_layout
from lmpm.visibility.maskmod import MaskMod, build_mask_mod

SPARSITY_BLOCK = 128  # block size at which `sparsity` is reported and `auto` chooses a layout


@dataclass(frozen=True, slots=True)
class Degenerate:
    """Cells of ``value`` that can see nothing (their attention rows are empty)."""

    value: str
    count: int  # how many cells
    pattern: str  # e.g. "Txt[0]" or "Vid[0, 0..31, 0..31]" (bounding box; see ``exact``)
    exact: bool  # True when the cells are exactly the pattern's box
    reason: str  # "no visible clause" or "every clause is empty here"


@dataclass(frozen=True, slots=True)
class BlockCounts:
    partial: int
    full: int
    empty: int

    @property
    def sparsity(self) -> float:
        """Fraction of (q block, kv block) pairs that are empty (skipped by FlexAttention)."""
        total = self.partial + self.full + self.empty
        return self.empty / total if total else 0.0


class Masks:
    """Everything visibility compiles to, for one program with bound parameters.

    ``layout``: "auto" (default: the layout with the highest block sparsity at ``auto_block``
    blocks, 128 by default; raster on ties), "raster", "tiled" or "morton". ``tile``: the tile of the tiled layout (rows, cols of
    the spatial axes).

    >>> from lmpm.ir import compile_file
    >>> prog = compile_file("examples/video.lmpm").ir
    >>> m = Masks(prog, bind_params(prog, {"T": 2, "W": 8, "H": 8, "N": 4}))
    >>> m.cells, sorted(m.sparsity) == sorted(LAYOUTS)
    (134, True)
    >>> sorted(m.gather("Vid"))
    ['Vid<-Coarse', 'Vid<-Coarse#3', 'Vid<-Txt', 'Vid<-Txt#2', 'Vid<-Vid', 'Vid<-Vid#0', 'Vid<-Vid#1']
    >>> m.gather("Vid")["Vid<-Txt"].index.shape
    torch.Size([128, 4])
    """

    def __init__(
        self,
        program: Program,
        env: Mapping[str, int],
        layout: str = "auto",
        tile: tuple[int, int] = DEFAULT_TILE,
        auto_block: int = SPARSITY_BLOCK,
    ) -> None:
        if layout != "auto" and layout not in LAYOUTS:
            raise UsageError(
                f"unknown layout {layout!r}; layouts: auto, {', '.join(LAYOUTS)}", code="U010"
            )
        self.program = program
        self.env: dict[str, int] = dict(env)
        self.tile = tuple(tile)
        self.space: Space = space(program, self.env)
        # The clauses every product derives from. Their boxes (O(cells × stencil size), constants
        # kept as constants) are expanded on first use; the BlockMask streams them instead.
        self._stencils = cell_stencils(program, self.space)
        self._clauses: list[Clause] | None = None
        self._layouts: dict[str, Layout] = {}
        self._on_device: dict[torch.device, Layout] = {}  # the chosen layout, tables moved
        self._counts: dict[tuple[str, int, int], BlockCounts] = {}
        self._mask_mods: dict[torch.device, MaskMod] = {}  # per device of its layout table
        # per (block sizes, device): a BlockMask is a constant of the program and its sizes
        self._block_masks: dict[tuple[tuple[int, int], torch.device], BlockMask] = {}
        if layout == "auto":
            sp = self.sparsity_at(auto_block)
            layout = max(LAYOUTS, key=lambda k: (sp[k], -LAYOUTS.index(k)))
        self.layout: str = layout

    # ---- the sequence ----------------------------------------------------------------------
    @property
    def cells(self) -> int:
        """Cells in the attention sequence (all non-Set values, declaration order)."""
        return self.space.cells

    def layout_of(self, kind: str | None = None) -> Layout:
        kind = kind or self.layout
        if kind not in self._layouts:
            self._layouts[kind] = make_layout(self.space, kind, (self.tile[0], self.tile[1]))
        return self._layouts[kind]

    def _layout_on(self, device: torch.device) -> Layout:
        """The chosen layout with its tables on ``device`` (moved once)."""
        if device not in self._on_device:
            self._on_device[device] = self.layout_of().to(device)
        return self._on_device[device]

    @property
    def _boxes(self) -> list[Clause]:
        """Every clause's boxes at every target cell (expanded once, on first use)."""
        if self._clauses is None:
            self._clauses = [
                expand_stencil(self.program, self.env, s, self.space) for s in self._stencils
            ]
        return self._clauses

    @property
    def degenerate(self) -> tuple[Degenerate, ...]:
        """Cells that can see nothing, per value (their rows of the mask are all False)."""
        out: list[Degenerate] = []
        for v in self.space.names:
            n = self.space.size(v)
            if n == 0:
                continue
            mine = [b for b in self._boxes if b.target == v]
            if not mine:
                out.append(
                    _describe(
                        v, self.space.dims[v], torch.ones(n, dtype=torch.bool), "no visible clause"
                    )
                )
                continue
            sees = torch.zeros(n, dtype=torch.bool)
            for b in mine:
                sees |= b.sees()
            if not bool(sees.all()):
                out.append(_describe(v, self.space.dims[v], ~sees, "every clause is empty here"))
        return tuple(out)

    # ---- attention masks --------------------------------------------------------------------
    @property
    def mask_mod(self) -> MaskMod:
        """``mask_mod(b, h, q_idx, kv_idx)`` for FlexAttention, positions in ``self.layout``
        (its layout table, if any, on the CPU; :meth:`mask_mod_on` for another device)."""
        return self.mask_mod_on("cpu")

    def mask_mod_on(self, device: str | torch.device) -> MaskMod:
        """:attr:`mask_mod` with its layout table (tiled/morton) on ``device``: a compiled
        kernel reads the table where the indices are."""
        dev = _device_key(device)
        if dev not in self._mask_mods:
            lay = self._layout_on(dev)
            self._mask_mods[dev] = build_mask_mod(self.program, self.env, self.space, lay)
        return self._mask_mods[dev]

    def block_mask(
        self,
        block_size: int | tuple[int, int] = 128,
        device: str | torch.device = "cpu",
        *,
        cache: bool = True,
    ) -> BlockMask:
        """The analytic BlockMask, built on ``device`` without an N×N tensor: the tensors of
        ``create_block_mask(self.mask_mod, 1, 1, cells, cells, BLOCK_SIZE=block_size)``, exactly
        (same partial and full blocks, same order, contiguous indices; docs/visibility.md).

        Visibility depends on the program and its sizes only, never on the data, so the mask is
        built once per block size and device and kept (a training loop that asks every step pays
        a dictionary lookup); ``cache=False`` builds anew and keeps nothing. Treat the returned
        BlockMask as read-only: its tensors are shared by every caller."""
        if self.cells == 0:
            raise UsageError("the program has no cells to attend over", code="U012")
        dev = _device_key(device)
        blocks = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        key = ((int(blocks[0]), int(blocks[1])), dev)
        if cache and key in self._block_masks:
            return self._block_masks[key]
        bm = build_block_mask(
            self.space,
            self._layout_on(dev),
            _Streamed(self),
            self.mask_mod_on(dev),
            key[0],
            dev,
        )
        if cache:
            self._block_masks[key] = bm
        return bm

    def block_flags(
        self, block_size: int | tuple[int, int] = 128, layout: str | None = None
    ) -> tuple[Tensor, Tensor]:
        """(partial, full): (q blocks, kv blocks) bool in ``layout`` (default: the chosen one)."""
        qbs, kvbs = (block_size, block_size) if isinstance(block_size, int) else block_size
        return block_flags(self.space, self.layout_of(layout), _Streamed(self), qbs, kvbs)

    def block_counts(
        self, block_size: int = SPARSITY_BLOCK, layout: str | None = None
    ) -> BlockCounts:
        """Partial / full / empty block pairs in ``layout`` (default: the chosen one)."""
        kind = layout or self.layout
        key = (kind, block_size, block_size)
        if key not in self._counts:
            if self.cells == 0:
                self._counts[key] = BlockCounts(0, 0, 0)
            else:
                partial, full = self.block_flags(block_size, kind)
                total = partial.numel()
                p, f = int(partial.sum()), int(full.sum())
                self._counts[key] = BlockCounts(p, f, total - p - f)
        return self._counts[key]

    @property
    def sparsity(self) -> dict[str, float]:
        """Block sparsity (fraction of empty 128×128 block pairs) for every layout."""
        return self.sparsity_at(SPARSITY_BLOCK)

    def sparsity_at(self, block_size: int) -> dict[str, float]:
        """Block sparsity for every layout at ``block_size``."""
        return {k: self.block_counts(block_size, k).sparsity for k in LAYOUTS}

    def dense(self, canonical: bool = True) -> Tensor:
        """(cells, cells) bool, ``mask[q, k]`` iff k is visible to q. Canonical order (values in
        declaration order, each row-major) unless ``canonical=False`` (then layout order, the
        order ``mask_mod`` and ``block_mask`` use). Memory is cells²: keep it small."""
        boxes = [c.materialize() for c in self._boxes]
        return dense_mask(self.space, boxes, None if canonical else self.layout_of())

    # ---- gather tables ----------------------------------------------------------------------
    def gather(self, value: str) -> dict[str, GatherTable]:
        """Gather tables into ``value``: one per clause (``"Vid<-Vid#0"``, numbered by the
        clause's position among all ``visible`` clauses) and one merged table per source value
        (``"Vid<-Coarse"``, the union of that source's clauses)."""
        if value not in self.space.dims:
            raise UsageError(f"`{value}` is not a value with cells", code="U013")
        out: dict[str, GatherTable] = {}
        by_source: dict[str, list[Clause]] = {}
        k = 0
        for i, s in enumerate(self.program.stencils):
            if s.target not in self.space.dims or s.source not in self.space.dims:
                continue
            bx = self._boxes[k]
            k += 1
            if s.target != value:
                continue
            n, sdims = self.space.size(value), self.space.dims[s.source]
            out[f"{value}<-{s.source}#{i}"] = table_from_clauses([bx], n, sdims)
            by_source.setdefault(s.source, []).append(bx)
        for src, parts in by_source.items():
            n, sdims = self.space.size(value), self.space.dims[src]
            out[f"{value}<-{src}"] = table_from_clauses(parts, n, sdims)
        return out


class _Streamed:
    """The boxes of a :class:`Masks` for :func:`block_flags`, expanded statically (sizes known on
    the host) a group of rows at a time."""

    def __init__(self, m: Masks) -> None:
        self.m = m

    def has(self, target: str) -> bool:
        return any(s.target == target for s in self.m._stencils)

    def __call__(self, target: str, rows: slice | Tensor) -> list[Clause]:
        m = self.m
        coords = cell_coords(m.space.dims[target], rows)  # shared by the target's clauses
        return [
            expand_stencil(m.program, m.env, s, m.space, rows, static=True, coords=coords)
            for s in m._stencils
            if s.target == target
        ]


def _device_key(device: str | torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` and ``cuda:0`` are one cache entry."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _describe(value: str, dims: tuple[int, ...], empty: Tensor, reason: str) -> Degenerate:
    """Bounding box of the cells flagged in ``empty`` (n,) as an access pattern."""
    idx = torch.nonzero(empty).squeeze(1)
    count = int(idx.numel())
    parts: list[str] = []
    box = 1
    for a in range(len(dims)):
        st = math.prod(dims[a + 1 :])
        c = (idx // st) % dims[a]
        lo, hi = int(c.min()), int(c.max())
        box *= hi - lo + 1
        parts.append(
            "*"
            if (lo, hi) == (0, dims[a] - 1) and dims[a] > 1
            else str(lo)
            if lo == hi
            else f"{lo}..{hi}"
        )
    return Degenerate(value, count, f"{value}[{', '.join(parts)}]", box == count, reason)


def masks(
    program: Program,
    params: Mapping[str, int] | None = None,
    layout: str = "auto",
    *,
    tile: tuple[int, int] = DEFAULT_TILE,
    auto_block: int = SPARSITY_BLOCK,
) -> Masks:
    """:class:`Masks` of ``program`` with ``params`` over its declared defaults.

    >>> from lmpm.ir import compile_file
    >>> masks(compile_file("examples/gpt.lmpm").ir, {"N": 256}).block_counts(128)
    BlockCounts(partial=2, full=1, empty=1)
    """
    return Masks(program, bind_params(program, params), layout, tile, auto_block)


def compile_masks(src: str | Path, *, layout: str = "auto", **params: int) -> Masks:
    """Masks of a program given as source text or a path to a ``.lmpm`` file.

    >>> compile_masks("examples/gpt.lmpm", N=8).dense().sum().item()
    28
    """
    from lmpm.ir import compile_file, compile_source

    text = str(src)
    is_path = isinstance(src, Path) or ("\n" not in text and text.endswith(".lmpm"))
    front = (
        compile_file(text, overrides=params) if is_path else compile_source(text, overrides=params)
    )
    return masks(front.ir, params, layout)


__all__ = [
    "BlockCounts",
    "ClauseSpec",
    "Degenerate",
    "GatherTable",
    "Layout",
    "Masks",
    "compile_masks",
    "expand",
    "gather_table",
    "masks",
    "sdpa",
    "visible_union",
]
