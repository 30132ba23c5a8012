"""The topology: every value's cells over W workers, and the routes between them (pure, no state).

A value is either *partitioned* (each cell owned by one worker, which proposes, checks and applies
it) or *replicated* (every worker keeps every cell: values no rule writes, e.g. inputs, and small
values; a small written value is proposed by worker 0 and routed to every other worker).

A partitioned value is split by one of a few candidate layouts: contiguous ranges of the raster
order (ranges of a sequence, tiles along the leading axis of a grid), or tiles along one other axis.
The candidate chosen is the one minimising the halo, computed from the plan's gather tables: the
rule reads (which source cells each target cell reads) and the constraints' extra accesses.

A route ``(value, sender, receiver)`` holds the sorted source cells that the receiver's owned target
cells read and that the sender owns: after a commit, the sender sends the changed ones of those.

A value committed by ``quorum(k of n, ...)`` runs replica p of each of its rules on worker p
(:attr:`Topology.spread`): it is replicated, and so is every written value its rules read, so
every worker can compute any replica. Its cells are applied by the worker whose replica won, which
then sends them to every other worker: the value has a route from each of the n replica workers to
every other worker, all cells (a route's cells are what it *may* carry; only changed ones move).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lmpm.errors import UsageError
from lmpm.resolve.plan import Gather, Plan, ValuePlan
from lmpm.resolve.policies import aggregates, spread

REPLICATE_BYTES = 4096  # a value whose payload is at most this many bytes is kept on every worker


@dataclass(frozen=True, slots=True)
class Topology:
    workers: int
    owner: dict[str, Tensor]  # per value: (ncells,) int64, the worker that proposes/applies a cell
    replicated: dict[str, bool]  # per value: every worker keeps every cell
    layout: dict[str, str]  # per value: how it is split ("ranges", "axis 1 tiles", "replicated")
    routes: dict[tuple[str, int, int], Tensor]  # (value, sender, receiver) -> sorted source cells
    cell_bytes: dict[str, int]  # payload bytes of one cell
    # per value: the workers its quorum replicas run on, replica p on worker p (n for a
    # `quorum(k of n)` value spread over the workers; 1: every replica on the cell's owner)
    spread: dict[str, int] = field(default_factory=dict)

    def workers_of(self, value: str) -> int:
        """How many workers run replicas of ``value`` (1 unless it is a spread quorum value)."""
        return self.spread.get(value, 1)

    def owned(self, value: str, worker: int) -> Tensor:
        """The sorted cells ``worker`` proposes, checks and applies."""
        return torch.nonzero(self.owner[value] == worker).flatten()

    def route_bytes(self, key: tuple[str, int, int]) -> int:
        return int(self.routes[key].numel()) * self.cell_bytes[key[0]]

    def halo_bytes(self, value: str | None = None) -> int:
        """Payload bytes that cross between workers if every routed cell changes once."""
        return sum(self.route_bytes(k) for k in self.routes if value is None or k[0] == value)

    def halo_cells(self, value: str, worker: int) -> Tensor:
        """The sorted cells ``worker`` reads but does not own (its halo), over every sender."""
        parts = [c for (v, _, r), c in self.routes.items() if v == value and r == worker]
        if not parts:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat(parts).unique()


def _cell_bytes(vp: ValuePlan) -> int:
    return torch.empty((), dtype=vp.dtype).element_size() * math.prod(vp.cell_shape)


def _candidates(vp: ValuePlan, workers: int) -> list[tuple[str, Tensor]]:
    """Owner arrays to choose from, in order of preference (ties keep the earlier one)."""
    n = vp.ncells
    ids = torch.arange(n, dtype=torch.int64)
    out = [("ranges", ids * workers // max(n, 1))]
    for a in range(1, len(vp.dims)):
        if vp.dims[a] >= workers:
            out.append((f"axis {a} tiles", vp.coords[:, a] * workers // vp.dims[a]))
    return out


def _pairs(acc: Gather) -> tuple[Tensor, Tensor]:
    """(target cell, source cell) of every valid read."""
    if acc.uniform:
        row = acc.index[0][acc.valid[0]].unique()
        nt = acc.index.shape[0]
        t = torch.arange(nt, dtype=torch.int64).repeat_interleave(row.numel())
        return t, row.repeat(nt)
    t = torch.arange(acc.index.shape[0], dtype=torch.int64).unsqueeze(1).expand_as(acc.index)
    return t[acc.valid], acc.index[acc.valid]


def _needs(
    pairs: list[tuple[str, str, Tensor, Tensor]],
    owner: dict[str, Tensor],
    static: set[str],
    nsource: dict[str, int],
    workers: int,
) -> dict[tuple[str, int, int], Tensor]:
    """The routes of partitioned sources: per (source, sender, receiver) the sorted cells."""
    keys: dict[str, list[Tensor]] = {}
    for target, source, t, s in pairs:
        if source in static or t.numel() == 0:
            continue
        recv = owner[target][t]
        send = owner[source][s]
        cross = recv != send
        # one key per (receiver, source cell): the sender is the cell's owner
        keys.setdefault(source, []).append(recv[cross] * nsource[source] + s[cross])
    routes: dict[tuple[str, int, int], Tensor] = {}
    for source, ks in keys.items():
        k = torch.cat(ks).unique()  # sorted: by receiver, then cell
        n = nsource[source]
        recv, cell = k // n, k % n
        send = owner[source][cell]
        for r in range(workers):
            for q in range(workers):
                sel = cell[(recv == r) & (send == q)]
                if sel.numel():
                    routes[(source, q, r)] = sel
    return routes


def partition(plan: Plan, workers: int, *, replicate_bytes: int = REPLICATE_BYTES) -> Topology:
    """Assign every value's cells to ``workers`` workers, minimising the halo. Deterministic."""
    if workers < 1:
        raise UsageError(f"workers must be at least 1, not {workers}", code="U080")
    written = {rp.target for rp in plan.rules}
    cell_bytes = {name: _cell_bytes(vp) for name, vp in plan.values.items()}
    static = {name for name in plan.values if name not in written}
    small = {
        name
        for name, vp in plan.values.items()
        if name in written and (vp.ncells * cell_bytes[name] <= replicate_bytes)
    }
    if workers == 1:
        small = set()
    spreads = _spreads(plan, workers)
    for name in spreads:  # every worker computes any replica: the value and its written reads
        small.add(name)
        small.update(rd.source for rp in plan.rules if rp.target == name for rd in rp.reads)
    small -= static
    nsource = {name: vp.ncells for name, vp in plan.values.items()}
    pairs = [(a.target, a.source, *_pairs(a)) for a in plan.gathers]
    owner: dict[str, Tensor] = {}
    layout: dict[str, str] = {}
    cands: dict[str, list[tuple[str, Tensor]]] = {}
    for name, vp in plan.values.items():
        if name in static or name in small:
            owner[name] = torch.zeros(vp.ncells, dtype=torch.int64)
            layout[name] = "replicated"
            if name in spreads:
                layout[name] = f"replicated, replicas on workers 0..{spreads[name] - 1}"
        else:
            cands[name] = _candidates(vp, workers)
            layout[name], owner[name] = cands[name][0]

    def cost() -> int:
        routes = _needs(pairs, owner, static | small, nsource, workers)
        return sum(c.numel() * cell_bytes[v] for (v, _, _), c in routes.items())

    # Coordinate descent over the values' layouts (two passes; a value's best split depends on the
    # splits of the values it reads and of those reading it).
    for _ in range(2 if workers > 1 else 0):
        for name, options in cands.items():
            best: tuple[int, str, Tensor] | None = None
            for label, own in options:
                owner[name] = own
                c = cost()
                if best is None or c < best[0]:
                    best = (c, label, own)
            assert best is not None
            layout[name], owner[name] = best[1], best[2]

    routes = _needs(pairs, owner, static | small, nsource, workers)
    for name in sorted(small):  # the proposer (worker 0) keeps every other worker's copy whole
        cells = torch.arange(nsource[name], dtype=torch.int64)
        # a spread quorum value: each replica's worker writes the cells its replica won
        for q in range(spreads.get(name, 1)):
            for r in range(workers):
                if r != q:
                    routes[(name, q, r)] = cells
    ordered = dict(
        sorted(routes.items(), key=lambda kv: (list(plan.values).index(kv[0][0]), kv[0][1:]))
    )
    return Topology(
        workers,
        owner,
        {name: name in static or name in small for name in plan.values},
        layout,
        ordered,
        cell_bytes,
        spreads,
    )


def _spreads(plan: Plan, workers: int) -> dict[str, int]:
    """The values whose `quorum(k of n)` replicas run on n different workers (one worker: none)."""
    out: dict[str, int] = {}
    if workers == 1:
        return out
    written = {rp.target for rp in plan.rules}
    for name, vp in plan.values.items():
        n = spread(vp.policy, vp.policy_args)
        if n <= 1 or name not in written:
            continue
        if workers < n:
            raise UsageError(
                f"`{name}` commits by {vp.policy_text}: its {n} replicas run on {n} different "
                f"workers, and this run has {workers}",
                code="U086",
                hint=f"use --workers {n} or more, or --workers 1 (every replica on one worker); "
                "two replicas on one worker could outvote a healthy one",
            )
        if aggregates(vp.policy, vp.policy_args):
            raise UsageError(
                f"`{name}` commits by {vp.policy_text}: an aggregate of replicas run on different "
                "workers needs their payloads in one place",
                code="U087",
                hint="use satisfy or winner_takes_all inside quorum(k of n, ...), or --workers 1",
            )
        out[name] = n
    return out


def runs(cells: Tensor) -> list[tuple[int, int]]:
    """Sorted cells as half-open contiguous ranges."""
    if cells.numel() == 0:
        return []
    c = cells.tolist()
    out = [[c[0], c[0] + 1]]
    for x in c[1:]:
        if x == out[-1][1]:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return [(a, b) for a, b in out]


def _ranges_text(cells: Tensor, limit: int = 4) -> str:
    rs = runs(cells)
    text = ", ".join(f"[{a}, {b})" for a, b in rs[:limit])
    if len(rs) > limit:
        text += f", … ({len(rs)} ranges)"
    return text or "-"


def topology_text(plan: Plan, topo: Topology, width: int = 120) -> str:
    """`lmpm show --plan --workers N`: the partition, halo sizes and routes as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    part = Table(title=f"partition over {topo.workers} workers")
    for col in ("value", "layout", "worker", "cells", "ranges", "halo cells", "halo bytes"):
        part.add_column(col)
    for name, vp in plan.values.items():
        if topo.replicated[name]:
            part.add_row(
                name, topo.layout[name], "all", str(vp.ncells), f"[0, {vp.ncells})", "", ""
            )
            continue
        for w in range(topo.workers):
            cells = topo.owned(name, w)
            halo = topo.halo_cells(name, w)
            part.add_row(
                name if w == 0 else "",
                topo.layout[name] if w == 0 else "",
                str(w),
                str(cells.numel()),
                _ranges_text(cells),
                str(halo.numel()),
                str(halo.numel() * topo.cell_bytes[name]),
            )
    console.print(part)
    rt = Table(title=f"routes (halo {topo.halo_bytes():,} bytes when every routed cell changes)")
    for col in ("value", "sender", "receiver", "cells", "bytes", "ranges"):
        rt.add_column(col)
    for key, cells in topo.routes.items():
        rt.add_row(
            key[0],
            str(key[1]),
            str(key[2]),
            str(cells.numel()),
            str(topo.route_bytes(key)),
            _ranges_text(cells),
        )
    if not topo.routes:
        rt.add_row("-", "", "", "0", "0", "")
    console.print(rt)
    return console.export_text()


__all__ = [
    "REPLICATE_BYTES",
    "Topology",
    "partition",
    "runs",
    "topology_text",
]
