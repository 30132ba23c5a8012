"""Sequence layouts: where each cell of the program sits in the one attention sequence.

The non-Set values are laid out one after another in declaration order; value ``v`` occupies
positions ``[base(v), base(v) + cells(v))`` in every layout. Inside a value the layout permutes
cells:

- ``raster``: row-major over the declared axes (this is also the *canonical* order);
- ``tiled``: the *spatial* axes are cut into tiles (``tile``, default 8×16 = one 128-block); tiles
  are in row-major order, cells row-major inside a tile;
- ``morton``: the spatial axes follow the Z-order curve (bit interleaving), ranked so that
  positions stay dense for any size.

The spatial axes are the last two of a grid (``Grid2D``: both; ``Grid3D``: x, y). The leading axis
of a ``Grid3D`` (time) stays outermost, so a frame is contiguous in every layout and clauses over
frames (``Vid[0..t-1, *, *]``, ``Vid[t-1, x, y]``) keep their interval structure. A ``Seq`` is the
same in every layout. Encode/decode are torch integer ops (a rank table per value's spatial grid).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lmpm.errors import UsageError
from lmpm.visibility._stencil import Space, cell_coords, strides

LAYOUTS = ("raster", "tiled", "morton")
DEFAULT_TILE = (8, 16)  # 128 cells: one default FlexAttention block per tile


def spatial_axes(rank: int) -> int:
    """How many trailing axes a layout permutes: 2 for grids, 0 for sequences."""
    return 2 if rank >= 2 else 0


def _interleave(coords: list[Tensor]) -> Tensor:
    """Morton code: bit b of axis a goes to bit ``b * len(coords) + (len - 1 - a)``."""
    code = torch.zeros_like(coords[0])
    m = len(coords)
    for bit in range(31):
        for a, c in enumerate(coords):
            code |= ((c >> bit) & 1) << (bit * m + (m - 1 - a))
    return code


def _rank_of(keys: Tensor) -> Tensor:
    """(n,) keys → (n,) rank of each key in ascending order (keys distinct)."""
    order = torch.argsort(keys)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(keys.numel(), dtype=torch.long)
    return rank


def inner_rank(kind: str, dims: tuple[int, ...], tile: tuple[int, int]) -> Tensor | None:
    """For the spatial axes ``dims``: (prod(dims),) position of each raster cell, or None for
    the identity (raster, or a grid the layout does not change)."""
    if kind == "raster" or not dims:
        return None
    coords = cell_coords(dims)
    if kind == "tiled":
        ty, tx = tile
        if dims[0] <= ty and dims[1] <= tx:
            return None  # one tile: raster
        tiles_x = -(-dims[1] // tx)
        tile_id = (coords[0] // ty) * tiles_x + coords[1] // tx
        # Within-tile raster over the full tile; edge tiles leave gaps that ranking closes.
        key = tile_id * (ty * tx) + (coords[0] % ty) * tx + coords[1] % tx
    elif kind == "morton":
        key = _interleave(coords)
    else:
        raise UsageError(f"unknown layout {kind!r}; layouts: {', '.join(LAYOUTS)}", code="U010")
    rank = _rank_of(key)
    if torch.equal(rank, torch.arange(rank.numel())):
        return None
    return rank


@dataclass(frozen=True)
class Layout:
    """Positions of every cell of a :class:`Space` in one sequence.

    ``to_canon``: (cells,) int64, layout position → canonical index (None: identity).
    ``to_layout``: (cells,) int64, canonical index → layout position (None: identity).
    ``inner``: per value, the spatial rank table (None: raster inside that value).
    """

    kind: str
    space: Space
    tile: tuple[int, int]
    inner: Mapping[str, Tensor | None]
    to_canon: Tensor | None = field(repr=False)
    to_layout: Tensor | None = field(repr=False)

    def to(self, device: torch.device | str) -> Layout:
        """The same layout with its tables on ``device`` (itself when they are there already)."""
        dev = torch.device(device)
        tables = [t for t in (self.to_canon, *self.inner.values()) if t is not None]
        if all(t.device == dev for t in tables):
            return self

        def move(t: Tensor | None) -> Tensor | None:
            if t is None or dev.type != "cuda":
                return None if t is None else t.to(dev)
            # From pinned memory without waiting: a pageable copy waits for the device.
            return t.pin_memory().to(dev, non_blocking=True)

        inner = {v: move(t) for v, t in self.inner.items()}
        return Layout(
            self.kind, self.space, self.tile, inner, move(self.to_canon), move(self.to_layout)
        )

    @property
    def identity(self) -> bool:
        return self.to_canon is None

    def spatial(self, value: str) -> int:
        """Number of trailing axes of ``value`` this layout permutes (0: raster there)."""
        return spatial_axes(len(self.space.dims[value])) if self.inner[value] is not None else 0

    def encode(self, value: str, coords: list[Tensor]) -> Tensor:
        """Layout positions of cells of ``value`` given per-axis coordinate tensors.

        >>> from lmpm.visibility._stencil import Space
        >>> sp = Space(("G",), {"G": (4, 4)}, {"G": 0}, 16)
        >>> lay = make_layout(sp, "morton")
        >>> lay.encode("G", [torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 0, 0])]).tolist()
        [0, 1, 2, 8]
        """
        dims = self.space.dims[value]
        g = self.spatial(value)
        lead = len(dims) - g
        st = strides(dims)
        pos = torch.zeros_like(coords[0]) + self.space.base[value]
        if g == 0:
            for a in range(len(dims)):
                pos = pos + coords[a] * st[a]
            return pos
        table = self.inner[value]
        assert table is not None
        inner_n = math.prod(dims[lead:])
        lead_pos = torch.zeros_like(coords[0])
        for a in range(lead):
            lead_pos = lead_pos + coords[a] * (st[a] // inner_n)
        raster_inner = coords[lead] * dims[lead + 1] + coords[lead + 1]
        return pos + lead_pos * inner_n + table[raster_inner]

    def decode(self, pos: Tensor) -> tuple[Tensor, list[Tensor]]:
        """(value number in ``space.names``, per-axis coordinates padded to 3 axes with 0)."""
        canon = pos if self.to_canon is None else self.to_canon[pos]
        which = torch.zeros_like(canon)
        for v in self.space.names[1:]:
            which = which + (canon >= self.space.base[v]).long()
        coords = [torch.zeros_like(canon) for _ in range(3)]
        for k, v in enumerate(self.space.names):
            local = canon - self.space.base[v]
            for a, c in enumerate(cell_coords_of(local, self.space.dims[v])):
                coords[a] = torch.where(which == k, c, coords[a])
        return which, coords


def cell_coords_of(local: Tensor, dims: tuple[int, ...]) -> list[Tensor]:
    """Row-major coordinates of local (in-value) canonical indices."""
    st = strides(dims)
    return [(local // max(st[a], 1)) % max(dims[a], 1) for a in range(len(dims))]


def make_layout(sp: Space, kind: str, tile: tuple[int, int] = DEFAULT_TILE) -> Layout:
    """Build the layout ``kind`` of ``sp`` (see the module docstring)."""
    if kind not in LAYOUTS:
        raise UsageError(
            f"unknown layout {kind!r}; layouts: {', '.join(LAYOUTS)} (or auto)", code="U010"
        )
    if len(tile) != 2 or min(tile) < 1:
        raise UsageError(f"a tile is two positive sizes, got {tile}", code="U011")
    inner: dict[str, Tensor | None] = {}
    for v in sp.names:
        dims = sp.dims[v]
        g = spatial_axes(len(dims))
        inner[v] = inner_rank(kind, dims[len(dims) - g :], tile) if g and math.prod(dims) else None
    if all(t is None for t in inner.values()):
        return Layout(kind, sp, tile, inner, None, None)
    to_layout = torch.arange(sp.cells, dtype=torch.long)
    lay = Layout(kind, sp, tile, inner, None, None)
    for v in sp.names:
        if inner[v] is None:
            continue
        n = sp.size(v)
        to_layout[sp.base[v] : sp.base[v] + n] = lay.encode(v, cell_coords(sp.dims[v]))
    to_canon = torch.empty_like(to_layout)
    to_canon[to_layout] = torch.arange(sp.cells, dtype=torch.long)
    return Layout(kind, sp, tile, inner, to_canon, to_layout)
