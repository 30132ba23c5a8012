"""Schedules: which cells are open in each epoch (the MaskPlan). Vectorized per value.

A schedule rule proposes the open set, e.g.::

    rule Schedule:
      on MaskPlan
      emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)

Strategies: ``all``, ``raster`` (``k`` first unset cells), ``frontier`` (the ``k`` first unset cells of
every row: ``B`` sequences of a ``Grid2D(B, N)`` generated side by side), ``red-black`` (parity of the coordinate
sum: no two axis-adjacent cells open together), ``independent`` (a colouring of the visibility graph,
so no two mutually visible cells are open together), ``random`` (``k`` cells), ``confidence``
(MaskGIT: every unset cell proposes; the most confident commit, a cosine-scheduled share per epoch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from lmpm.errors import BindError
from lmpm.ir.nodes import Expr, Op
from lmpm.runtime.data.texpr import Val, eval_tensor, mask_of
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
    """MaskGIT cosine schedule: how many more cells may commit in ``epoch`` (0-based).

    At least one while a cell is left (as MaskGIT's ``max(1, ...)``): the cosine's first steps
    round below one new cell on small values, and an epoch that may commit nothing would look like
    the end of the run (no commit) while the schedule is still holding cells back."""
    frac = 1.0 - math.cos(math.pi / 2 * min(epoch + 1, steps) / steps)
    target = total if epoch + 1 >= steps else math.ceil(total * frac)
    return max(target - committed, 1 if committed < total else 0)


# ---- schedules as objects -------------------------------------------------------------------------
# The control plane asks its schedule which cells are open in each epoch. A schedule sees metadata
# only (committed flags, coordinates, colours) and answers with sorted, unique flat cell ids.


class Schedule:
    """Which cells of each proposed value are open in epoch ``e``.

    ``period``: epochs without a commit that prove stability (one full cycle of the schedule).
    ``opens_committed``: the schedule may open committed cells (else it opens unset cells only, so
    no proposal can fold into keep-current and every commit is a first commit).
    ``has_quota``: :meth:`quota` may limit an epoch's commits (else it is always None, and the
    control plane need not count the committed cells to ask).
    ``phased``: :meth:`phase` may name a phase (else it is always None, and the owner need not ask
    it every epoch).
    """

    name = "all"
    period = 1
    opens_committed = True
    has_quota = False  # quota() limits the commits of an epoch
    phased = True  # phase() may return a phase

    def open_cells(
        self, value: str, committed: Tensor, e: int, skip: int = 0, start: int | None = None
    ) -> Tensor:
        """(n,) int64 open cells of ``value`` (``committed``: (ncells,) bool). ``skip``: slices of
        cells already tried without a commit in the current pass, which began at epoch ``start``
        (the schedules that open a few unset cells move past them; see :meth:`stable_after`)."""
        return self._all(value, committed.numel())

    def stable_after(self, unset: int) -> int:
        """Epochs without a commit that prove stability for a value with ``unset`` unset cells:
        enough for the schedule to open every cell it can open (one full cycle)."""
        return self.period

    def quota(self, e: int, ncells: int, ncommitted: int) -> int | None:
        """At most this many cells may commit in epoch ``e`` (None: no limit)."""
        return None

    def phase(self, value: str, e: int) -> int | None:
        """The fixed cell set ``open_cells`` returns in epoch ``e`` (cyclic schedules: the same
        phase, the same cells), or None when the open cells depend on the state."""
        return 0

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int], Tensor] = {}

    def _all(self, value: str, n: int) -> Tensor:
        hit = self._cache.get((value, -1))
        if hit is None:
            hit = self._cache[(value, -1)] = torch.arange(n)
        return hit


class _Cyclic(Schedule):
    """Fixed cell sets visited in turn (red-black parities, independent-set colours): each phase's
    cells are computed once, so the same tensor comes back every cycle (callers may cache by it)."""

    def __init__(self, phases: dict[str, Tensor]) -> None:
        super().__init__()
        self._phases = phases  # value -> (ncells,) int64 phase of each cell
        self._count = {v: int(p.max()) + 1 if p.numel() else 1 for v, p in phases.items()}
        self.period = max(self._count.values(), default=1)
        for value, p in phases.items():  # each phase's cells, made once, before the first epoch
            for phase in range(max(self._count[value], 2)):
                self._cache[(value, phase)] = (p == phase).nonzero().squeeze(1)

    def phase(self, value: str, e: int) -> int | None:
        return e % self._count[value] if value in self._phases else 0

    def open_cells(
        self, value: str, committed: Tensor, e: int, skip: int = 0, start: int | None = None
    ) -> Tensor:
        if value not in self._phases:
            return self._all(value, committed.numel())
        return self._cache[(value, e % self._count[value])]  # (made in __init__)


class RedBlack(_Cyclic):
    name = "red-black"

    def __init__(self, coords: dict[str, Tensor]) -> None:
        super().__init__({v: red_black(c) for v, c in coords.items()})
        self._count = dict.fromkeys(coords, 2)  # two phases even where one parity is empty
        self.period = 2


class Independent(_Cyclic):
    name = "independent"


class Raster(Schedule):
    """The first ``k`` unset cells in row-major order (causal generation with k = 1)."""

    name = "raster"
    opens_committed = False

    phased = False

    def phase(self, value: str, e: int) -> int | None:
        return None

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        # per value: (its committed flags, a numpy view of them or None, every cell's id as a
        # NumPy array)
        self._views: dict[str, tuple[Tensor, np.ndarray | None, np.ndarray]] = {}

    def open_cells(
        self, value: str, committed: Tensor, e: int, skip: int = 0, start: int | None = None
    ) -> Tensor:
        # cells tried without a commit are passed over: the next k unset cells after them
        # The control plane's flags are host tensors: numpy reads them through a view in a
        # fraction of the time of torch's nonzero (this runs every epoch of causal generation).
        hit = self._views.get(value)
        if hit is None or hit[0] is not committed:
            hit = self._flags(value, committed)
        flags = hit[1]
        if flags is None:  # flags on an accelerator
            return (~committed).nonzero().squeeze(1)[skip * self.k : (skip + 1) * self.k]
        if self.k == 1 and not skip:
            first = int(flags.argmin())  # the first unset cell (0 when every cell is committed)
            # (a NumPy slice of every cell's id: after a forward has flushed the caches, a
            # fraction of Tensor.narrow's cost; none when every cell is committed)
            return torch.from_numpy(hit[2][first : first + (not flags[first])])
        unset = np.flatnonzero(~flags)[skip * self.k : (skip + 1) * self.k]
        return torch.from_numpy(unset.astype(np.int64, copy=False))

    def _flags(self, value: str, committed: Tensor) -> tuple[Tensor, np.ndarray | None, np.ndarray]:
        """(``committed``, a numpy view of it or None when the flags are not on the host, every
        cell's id), made once per tensor (the view sees in-place writes)."""
        view = committed.numpy() if committed.device.type == "cpu" else None
        ids = self._all(value, committed.shape[0]).numpy()
        hit = self._views[value] = (committed, view, ids)
        return hit

    def stable_after(self, unset: int) -> int:
        return max(1, -(-unset // self.k))  # every unset cell opened once


class Frontier(Schedule):
    """Per row, its first ``k`` unset cells: a value's rows (every axis but the last) are
    generated side by side, each in causal order (``Grid2D(B, N)``: ``B`` sequences, one token of
    each per epoch with k = 1, whatever their prompts' lengths). A value of one axis is one row
    (as ``raster``)."""

    name = "frontier"
    opens_committed = False

    phased = False

    def phase(self, value: str, e: int) -> int | None:
        return None

    def __init__(self, k: int, width: dict[str, int]) -> None:
        super().__init__()
        self.k = k
        self._width = width  # value -> cells per row (the last axis; every cell for a Set)
        self._longest = max(width.values(), default=1)

    def open_cells(
        self, value: str, committed: Tensor, e: int, skip: int = 0, start: int | None = None
    ) -> Tensor:
        # each row passes over the cells it tried without a commit (as raster, row by row)
        n = committed.numel()
        width = self._width.get(value, n) or 1
        unset = ~committed.view(-1, width)  # (rows, width)
        rank = unset.cumsum(1) - 1  # (rows, width): the unset cell's place in its row
        lo = skip * self.k
        pick = unset & (rank >= lo) & (rank < lo + self.k)
        return pick.view(-1).nonzero().squeeze(1)

    def stable_after(self, unset: int) -> int:
        # every unset cell opened once: the longest row's unset cells, k an epoch
        return max(1, -(-min(unset, self._longest) // self.k))


class Random(Schedule):
    """``k`` unset cells drawn by counter-based noise keyed by (seed, value, cell, epoch)."""

    name = "random"
    opens_committed = False

    phased = False

    def phase(self, value: str, e: int) -> int | None:
        return None

    def __init__(self, k: int, seed: int) -> None:
        super().__init__()
        self.k, self.seed = k, seed

    def open_cells(
        self, value: str, committed: Tensor, e: int, skip: int = 0, start: int | None = None
    ) -> Tensor:
        from lmpm.workers import rng

        # A pass without commits keeps the order drawn at its first epoch ``start`` and moves past
        # the cells it tried (``skip`` slices of k); after a commit a new pass draws anew.
        n = committed.numel()
        key = e if start is None else start
        u = rng.uniform(self.seed, value, self._all(value, n), key, "schedule")[:, 0]
        u = torch.where(committed, torch.full_like(u, 2.0), u)
        m = torch.zeros(n, dtype=torch.bool)
        m[u.argsort()[skip * self.k : (skip + 1) * self.k]] = True
        return (m & ~committed).nonzero().squeeze(1)

    def stable_after(self, unset: int) -> int:
        return max(1, -(-unset // self.k))  # every unset cell opened once


class Confidence(Schedule):
    """MaskGIT: every unset cell proposes; the most confident commit, a cosine share per epoch."""

    name = "confidence"
    opens_committed = False
    has_quota = True

    phased = False

    def phase(self, value: str, e: int) -> int | None:
        return None

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def open_cells(
        self, value: str, committed: Tensor, e: int, skip: int = 0, start: int | None = None
    ) -> Tensor:
        return (~committed).nonzero().squeeze(1)

    def quota(self, e: int, ncells: int, ncommitted: int) -> int | None:
        return confidence_quota(e, self.steps, ncells, ncommitted)


def make_schedule(
    spec: ScheduleSpec, coords: dict[str, Tensor], colors: dict[str, Tensor], seed: int
) -> Schedule:
    """The schedule object of a plan's spec; ``coords`` and ``colors`` cover the proposed values."""
    match spec.strategy:
        case "raster":
            return Raster(spec.k)
        case "frontier":
            return Frontier(spec.k, {v: _row_width(c) for v, c in coords.items()})
        case "random":
            return Random(spec.k, seed)
        case "confidence":
            return Confidence(spec.steps or 1)
        case "red-black":
            return RedBlack(coords)
        case "independent":
            return Independent({v: colors[v] for v in coords if v in colors})
        case _:
            return Schedule()


def _row_width(coords: Tensor) -> int:
    """Cells per row of a value with ``coords`` (ncells, rank): its last axis's size (a value of
    no axis: one row of every cell)."""
    if coords.shape[1] == 0 or coords.shape[0] == 0:
        return max(int(coords.shape[0]), 1)
    return int(coords[:, -1].max()) + 1


# ---- epoch-guarded triggers ----------------------------------------------------------------------
# A rule's `when` guard may read the epoch `e` (`when e >= 3`, `when e % 2 == 1`). The run may only
# be called stable once no such guard can still change its truth: ``epoch_horizon`` finds the epoch
# from which every guard repeats with a fixed cycle.

HORIZON_CAP = 100_000  # epochs scanned at most for one guard (a guard changing later is ignored)


def _mentions_epoch(x: Expr) -> bool:
    return (x.op == Op.VAR and x.value == "e") or any(_mentions_epoch(a) for a in x.args)


def _epoch_free_bound(x: Expr, env: Mapping[str, Val]) -> tuple[int, int]:
    """(largest |value| of an epoch-free subexpression over the cells, lcm of constant moduli
    applied to epoch-dependent operands)."""
    bound, cycle = 0, 1
    if not _mentions_epoch(x):
        v = eval_tensor(x, env)
        if isinstance(v, Tensor):
            top = int(v.long().abs().max()) if v.numel() else 0
        else:
            top = abs(int(v))
        return top, 1
    if x.op == Op.MOD and not _mentions_epoch(x.args[1]):
        m = eval_tensor(x.args[1], env)
        if isinstance(m, Tensor):
            ms = {abs(int(v)) for v in m.unique().tolist() if int(v) != 0}
        else:
            ms = {abs(int(m))} if int(m) else set()
        for v in ms:
            cycle = math.lcm(cycle, v)
    for a in x.args:
        b, c = _epoch_free_bound(a, env)
        bound, cycle = max(bound, b), math.lcm(cycle, c)
    return bound, cycle


def epoch_horizon(trigger: Expr, env: Mapping[str, Val], ncells: int) -> tuple[int, int]:
    """``(until, cycle)`` of a rule's trigger: from epoch ``until`` on, the trigger's truth at every
    cell repeats every ``cycle`` epochs (``(0, 1)``: it does not read ``e``). ``env`` binds the
    params and the rule's index variables to (ncells,) coordinate tensors.

    Found by evaluating the trigger at every epoch up to a bound derived from its constants (the
    largest epoch-free operand, plus two cycles), so `e >= 3` gives ``(3, 1)``, `e % 2 == 1` gives
    ``(0, 2)`` and `e >= t` on ``Seq(8)`` gives ``(7, 1)``."""
    if not _mentions_epoch(trigger):
        return 0, 1
    bound, cycle = _epoch_free_bound(trigger, env)
    cap = min(bound + 2 * cycle + 2, HORIZON_CAP)
    ring = [mask_of(trigger, {**env, "e": e}, ncells) for e in range(cycle)]  # the last cycle
    until = 0
    for e in range(cycle, cap + cycle):
        now = mask_of(trigger, {**env, "e": e}, ncells)
        if not torch.equal(now, ring[e % cycle]):  # truth at e differs from e - cycle
            until = e - cycle + 1
        ring[e % cycle] = now
    return until, cycle
