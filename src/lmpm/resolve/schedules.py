"""Schedules: which cells are open in each epoch (the MaskPlan). Vectorized per value.

A schedule rule proposes the open set, e.g.::

    rule Schedule:
      on MaskPlan
      emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)

Strategies: ``all``, ``raster`` (``k`` first unset cells), ``red-black`` (parity of the coordinate
sum: no two axis-adjacent cells open together), ``independent`` (a colouring of the visibility graph,
so no two mutually visible cells are open together), ``random`` (``k`` cells), ``confidence``
(MaskGIT: every unset cell proposes; the most confident commit, a cosine-scheduled share per epoch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lmpm.errors import BindError
from lmpm.signatures import STRATEGIES  # one list, also read by the checker


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    strategy: str = "all"
    k: int = 1  # raster / random: cells opened per value per epoch
    steps: int | None = None  # confidence: epochs to commit everything in (default: --epochs)
    options: dict[str, object] = field(default_factory=dict)


def sample_tiles(
    strategy: str = "all", epoch: int = 0, k: int = 1, steps: int | None = None, **options: object
) -> ScheduleSpec:
    """The built-in schedule proposer `SampleTiles(strategy=..., epoch=e, k=..., steps=...)`."""
    if strategy not in STRATEGIES:
        raise BindError(
            f"unknown schedule strategy {strategy!r}",
            code="B040",
            hint="strategies: " + ", ".join(STRATEGIES),
        )
    if int(k) < 1:
        raise BindError(f"SampleTiles: k must be at least 1, got {k}", code="B041")
    return ScheduleSpec(strategy, int(k), None if steps is None else int(steps), dict(options))


def color_graph(index: Tensor, valid: Tensor) -> Tensor:
    """Colour a graph given as padded adjacency ``index``/``valid`` (N, K); symmetrized first.

    Jones–Plassmann: each round colours every uncoloured node whose (fixed, pseudo-random) priority
    beats all its uncoloured neighbours, with the smallest colour its coloured neighbours lack.
    Deterministic; O(rounds × edges) tensor work, no per-node Python loop. Returns (N,) int64.
    """
    n = index.shape[0]
    src = torch.arange(n).unsqueeze(1).expand_as(index)[valid]
    dst = index[valid]
    keep = src != dst
    src, dst = src[keep], dst[keep]
    a = torch.cat([src, dst])
    b = torch.cat([dst, src])
    pair = torch.unique(a * n + b)
    a, b = pair // n, pair % n  # sorted by a
    deg = torch.bincount(a, minlength=n)
    width = int(deg.max()) if n and a.numel() else 0
    offsets = torch.cumsum(deg, 0) - deg
    pos = torch.arange(a.numel()) - offsets[a]
    adj = torch.full((n, max(width, 1)), -1, dtype=torch.int64)
    adj[a, pos] = b
    has = adj >= 0
    nbr = adj.clamp(min=0)
    gen = torch.Generator().manual_seed(0x5EED)
    prio = torch.randperm(n, generator=gen)
    color = torch.full((n,), -1, dtype=torch.int64)
    while bool((color < 0).any()):
        un = color < 0
        nbr_prio = torch.where(has & un[nbr], prio[nbr], torch.full_like(nbr, -1))
        pick = un & (prio > nbr_prio.max(dim=1).values)
        rows = pick.nonzero().squeeze(1)
        ncol = torch.where(has[rows], color[nbr[rows]], torch.full_like(nbr[rows], -1))  # (r, W)
        used = torch.zeros(rows.numel(), width + 2, dtype=torch.bool)
        used.scatter_(1, (ncol + 1).clamp(min=0), True)  # column 0 collects the "-1" entries
        free = ~used[:, 1:]
        color[rows] = free.to(torch.uint8).argmax(dim=1)
    return color


def red_black(coords: Tensor) -> Tensor:
    """Parity of the coordinate sum, (cells,) int64 in {0, 1}."""
    return coords.sum(dim=1) % 2


def confidence_quota(epoch: int, steps: int, total: int, committed: int) -> int:
    """MaskGIT cosine schedule: how many more cells may commit in ``epoch`` (0-based)."""
    frac = 1.0 - math.cos(math.pi / 2 * min(epoch + 1, steps) / steps)
    target = total if epoch + 1 >= steps else math.ceil(total * frac)
    return max(target - committed, 0)
