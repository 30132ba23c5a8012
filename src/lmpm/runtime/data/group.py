"""W partitioned workers behind the one port the engine talks to (:mod:`lmpm.runtime.port`).

A :class:`WorkerGroup` holds W :class:`~lmpm.runtime.data.dataplane.DataPlane` workers in this
process, each holding the payload of the cells the topology
(:func:`lmpm.resolve.topology.partition`) gives it, and beside each the
:class:`~lmpm.runtime.data.shard.ShardOwner` that decides those cells. Per epoch the group sends
every worker the control plane's :class:`EpochRequest`; the owners open, propose, agree, apply
and commit their cells, exchanging metadata among themselves (:func:`lmpm.runtime.data.shard.lockstep`
hands the parts around in this process); each answers with a report of fixed size, and the
group merges them into one. Then the *changed* cells of each route move from their sender to
their receiver (the in-process transport: all apply, then all exchange).

How the workers are reached is the subclass's part: here they are objects in this process;
:class:`lmpm.runtime.data.raygroup.RayGroup` runs each as a Ray actor in its own process, the
owners' exchanges and the halo moving over ``torch.distributed``. The view of the owners the
control plane reads (:class:`~lmpm.runtime.data.shard.OwnersView`), what the group keeps for
restores (per epoch and value, the rows each worker's store holds since the newest checkpoint)
and the restore itself are shared.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import UsageError
from lmpm.resolve.plan import Plan
from lmpm.resolve.topology import Topology, partition
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.shard import (
    OwnersView,
    ShardOwner,
    commit_order,
    lockstep,
    merge_reports,
)
from lmpm.runtime.protocol import (
    EpochReport,
    EpochRequest,
    Traffic,
)

CORRUPT = "corrupt"  # the fault that perturbs a worker's proposals (quorum drills)
PHASES = ("propose", "apply", "halo")
INJECT_ENV = "LMPM_INJECT_FAULT"  # fault injection for tests and drills: see parse_fault
# kill: SIGKILL the worker's process; hang: it stops answering; corrupt: its proposals are wrong
# from the epoch on (it keeps answering: a quorum outvotes it, lmpm.runtime.records.Dissent)
HOWS = ("kill", "hang", CORRUPT)


def parse_fault(spec: str, workers: int) -> tuple[int, str, int, str]:
    """``w<i>:<phase>:<epoch>[:kill|hang|corrupt]`` (the LMPM_INJECT_FAULT variable) as
    inject()'s arguments (``corrupt`` only in ``propose``)."""
    parts = spec.strip().split(":")
    how = parts[3] if len(parts) == 4 else "kill"
    ok = len(parts) in (3, 4) and parts[0][:1] == "w" and parts[0][1:].isdigit()
    ok = ok and parts[1] in PHASES and parts[2].isdigit() and how in HOWS
    ok = ok and (how != CORRUPT or parts[1] == "propose")
    if not ok or int(parts[0][1:]) >= workers:
        raise UsageError(
            f"{INJECT_ENV}={spec!r}: give w<i>:<phase>:<epoch>[:kill|hang|corrupt] with "
            f"i < {workers} and phase one of {', '.join(PHASES)} (corrupt: propose)",
            code="U085",
        )
    return int(parts[0][1:]), parts[1], int(parts[2]), how


def check_fault(worker: int, phase: str, how: str, workers: int, hows: tuple[str, ...]) -> None:
    """A fault to inject: a worker of the group, a phase, a kind this driver can inject."""
    if not 0 <= worker < workers:
        raise UsageError(f"worker {worker}: the group has workers 0..{workers - 1}", code="U084")
    if how not in hows:
        raise UsageError(
            f"fault {how!r}: this driver injects {', '.join(hows)}",
            code="U088",
            hint="kill and hang need worker processes: lmpm run --workers N (Ray)",
        )
    if how == CORRUPT and phase != "propose":
        raise UsageError(
            f"a corrupt worker corrupts its proposals: phase {phase!r} must be 'propose'",
            code="U084",
        )


def received(
    topology: Topology, worker: int, changed: Mapping[tuple[str, int], Tensor]
) -> dict[str, Tensor]:
    """The cells of spread quorum values (lmpm.resolve.topology) that other workers wrote this
    epoch (``changed[(value, sender)]``: (ncells,) bool) and ``worker`` received: sorted cells per
    value, for its store."""
    out: dict[str, Tensor] = {}
    for (value, q), mask in changed.items():
        if q != worker and topology.workers_of(value) > 1:
            cells = mask.nonzero().squeeze(1)
            out[value] = torch.cat([out[value], cells]).unique() if value in out else cells
    return {v: c for v, c in out.items() if c.numel()}


def stored_rows(written: Mapping[str, Tensor], got: Mapping[str, Tensor]) -> dict[str, int]:
    """Per value, the rows a worker's store took in an epoch: the cells it wrote and the spread
    quorum values' cells it received (``received``)."""
    rows = {name: int(c.numel()) for name, c in written.items()}
    for name, c in got.items():
        rows[name] = rows.get(name, 0) + int(c.numel())
    return rows


class InProcessTransport:
    """Moves the changed cells of every route between workers of one process."""

    def __init__(self, workers: list[DataPlane], topology: Topology) -> None:
        self.workers = workers
        self.topology = topology

    def exchange(self, changed: dict[tuple[str, int], Tensor]) -> int:
        """``changed[(value, sender)]``: (ncells,) bool, the cells the sender wrote this epoch.
        Copies the routed ones to their receivers; returns the payload bytes moved."""
        moved = 0
        for (value, q, r), cells in self.topology.routes.items():
            mask = changed.get((value, q))
            if mask is None:
                continue
            sel = cells[mask.index_select(0, cells)]
            if sel.numel() == 0:
                continue
            src, dst = self.workers[q], self.workers[r]
            dst.payload[value].index_copy_(0, sel, src.payload[value].index_select(0, sel))
            dst.read_clocks.stamp(value, dst.payload[value], sel)
            dst.committed[value].index_copy_(0, sel, src.committed[value].index_select(0, sel))
            dst.from_input[value].index_copy_(0, sel, src.from_input[value].index_select(0, sel))
            moved += sel.numel() * self.topology.cell_bytes[value]
        return moved


class WorkerGroup:
    """W in-process partitioned workers and the owners of their cells, behind the port."""

    def __init__(
        self,
        plan: Plan,
        workers: int,
        *,
        topology: Topology | None = None,
        backend: str | Any = "cpu",
        seed: int = 0,
        checksum_policies: frozenset[str] = frozenset(),
    ) -> None:
        if workers < 1:
            raise UsageError(f"--workers {workers}: at least one worker is needed", code="U080")
        device = backend if isinstance(backend, str) else str(getattr(backend, "device", "cpu"))
        if device.startswith("cuda"):
            raise UsageError(
                "more than one worker runs on the CPU backend only for now (the halo transport "
                "is gloo over host memory; NCCL for GPU-resident payload is not built)",
                code="U089",
                hint="use --backend cpu with --workers N, or one worker on CUDA",
            )
        self.plan = plan
        self.topology = topology or partition(plan, workers)
        if self.topology.workers != workers:
            raise UsageError(
                f"the topology is for {self.topology.workers} workers, not {workers}", code="U080"
            )
        self.size = workers
        self.worker = "group"
        self.seed = int(seed)
        self.backend = backend
        self.checksum_policies = checksum_policies
        self.halo_bytes = 0  # payload bytes moved worker to worker in the last epoch
        self.halo_bytes_total = 0
        self.busy = False
        # the messages between the control plane and each worker in the last epoch (metadata
        # only): serialised as they cross (or, in this process, would cross) and tensor bytes
        self.traffic = Traffic()
        # What the group keeps to restore its workers (counts, never cells or payload): the
        # newest checkpoint's shards and, per (epoch, value) since it, the rows each worker's
        # store holds (its commits and the spread values' cells it received).
        self.checkpointed: tuple[int, dict[str, dict[str, Any]]] | None = None
        self.stored: dict[tuple[int, str], list[int]] = {}
        self.changes = 0  # bumped whenever the owners' metadata changes (the view's cache)
        self._log_args: tuple[Any, ...] | None = None  # the owners write log rows (log_cells)
        # the proposed values in the order the owners commit them; each rule's rank
        self.order = commit_order(plan)
        self.rule_rank = {rp.id: k for k, rp in enumerate(plan.rules)}
        self.store: Any = None  # the workers hold the stores (one each)
        self.owner: Any = self._owners()
        self.workers: list[Any] = self._start()
        self.transport = InProcessTransport(self.workers, self.topology)
        for spec in filter(None, os.environ.get(INJECT_ENV, "").split(",")):
            self.inject(*parse_fault(spec, self.size))

    # ---- reaching the workers (the in-process driver; RayGroup overrides these) -----------------
    def _owners(self) -> Any:
        """The owners of the cells: one beside each worker (lmpm.runtime.data.shard), read by
        the control plane through one view."""
        self.owners = [ShardOwner(self.plan, self.topology, i, self.seed) for i in range(self.size)]
        return OwnersView(self)

    def owner_calls(self, method: str, args: list[tuple[Any, ...] | None]) -> list[Any]:
        """Call ``method`` on worker i's owner with ``args[i]`` (None: not called)."""
        return [
            None if a is None else getattr(o, method)(*a)
            for o, a in zip(self.owners, args, strict=True)
        ]

    def _start(self) -> list[Any]:
        return [
            DataPlane(
                self.plan,
                backend=self.backend,
                seed=self.seed,
                worker=name,
                checksum_policies=self.checksum_policies,
                decides=False,
            )
            for name in self.shard_names
        ]

    # ---- the port (lmpm.runtime.port.DataPlanePort) -------------------------------------------
    def epoch(self, req: EpochRequest) -> EpochReport:
        """Run one epoch: each worker's owner opens, decides and applies its cells, the owners
        exchanging metadata among themselves; then the changed routed cells move."""
        report = self._decide(req)
        self.changes += 1
        report.halo_bytes = self.halo_bytes
        report.control_bytes = self.traffic.control_bytes
        report.message_bytes = self.traffic.message_bytes
        report.faults = tuple(self.take_faults())
        return report

    def log_cells(self, tracer: Any) -> bool:
        """Have the owners write the per-cell log rows (commits; the trace rows of ``tracer``,
        None: no trace) into their workers' stores from now on: the control plane's log keeps
        the per-epoch rows. True (a group always can, once its stores are open)."""
        args = (None, "", None) if tracer is None else (type(tracer), tracer.level, tracer.region)
        self._log_args = args
        self.owner_calls("set_log", [args] * self.size)
        return True

    def compile(self) -> Any:
        raise UsageError(
            "--compile runs the epoch step next to one worker's payload; this run has a "
            "worker group",
            code="U101",
            hint="drop --compile, or run with one worker",
        )

    def _decide(self, req: EpochRequest) -> EpochReport:
        """The owners' epoch, side by side in this process (lmpm.runtime.data.shard.lockstep),
        then the halo exchange. What crosses into and out of the control plane: the request to
        each worker and its report."""
        self.traffic = Traffic()
        gens = [o.decide(w, req) for o, w in zip(self.owners, self.workers, strict=True)]
        reports = lockstep(gens)
        self.traffic.count(req, *reports)
        self.traffic.times(req, self.size - 1)  # the same request to every worker
        self.halo_bytes = self._exchange_written(req.epoch)
        self.halo_bytes_total += self.halo_bytes
        return merge_reports(reports, self.order, self.rule_rank, req.records)

    def take_faults(self) -> list[Any]:
        """The worker faults survived since the last call (in-process workers: none)."""
        return []

    def _each(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker with the same arguments; their results in order."""
        return [getattr(w, method)(*args) for w in self.workers]

    def _calls(self, method: str, args: list[tuple[Any, ...] | None]) -> list[Any]:
        """Call ``method`` on worker i with ``args[i]`` (None: not called, result None)."""
        return [
            None if a is None else getattr(w, method)(*a)
            for w, a in zip(self.workers, args, strict=True)
        ]

    def _exchange_written(self, epoch: int) -> int:
        """Move the cells every worker wrote this epoch along their routes; every store keeps
        the spread quorum values whole. Payload bytes moved."""
        changed: dict[tuple[str, int], Tensor] = {}
        for i, w in enumerate(self.workers):
            for name, cells in w.written.items():
                mask = torch.zeros(self.plan.values[name].ncells, dtype=torch.bool)
                mask[cells] = True
                changed[(name, i)] = mask
        moved = self.transport.exchange(changed)
        for i, w in enumerate(self.workers):
            got = received(self.topology, i, changed)
            if got:
                w.keep_received(epoch, got)
            self._count_stored(epoch, i, stored_rows(w.written, got))
        return moved

    def _count_stored(self, epoch: int, worker: int, rows: Mapping[str, int]) -> None:
        """Worker ``worker``'s store holds ``rows[value]`` more rows of ``epoch``."""
        for name, n in rows.items():
            if n:
                self.stored.setdefault((epoch, name), [0] * self.size)[worker] += n

    def _resync(self) -> int:
        """Send every routed cell to its receivers (after a restore): bytes moved."""
        every = {
            (v, q): torch.ones(self.plan.values[v].ncells, dtype=torch.bool)
            for (v, q, _) in self.topology.routes
        }
        return self.transport.exchange(every)

    def close(self) -> None:
        """Release the workers (processes, process groups) of a driver that has any."""

    # ---- redundancy ------------------------------------------------------------------------------
    def inject(self, worker: int, phase: str, epoch: int, how: str = "corrupt") -> None:
        """Make worker ``worker``'s proposals corrupt from ``epoch`` on (``how="corrupt"``, phase
        ``propose``). Killing or hanging a worker needs worker processes (RayGroup)."""
        check_fault(worker, phase, how, self.size, ("corrupt",))
        self._calls("set_corrupt", [(epoch,) if i == worker else None for i in range(self.size)])

    # ---- inputs and outputs (the API edge, never the epoch loop) ---------------------------------
    @property
    def shard_names(self) -> tuple[str, ...]:
        return tuple(f"w{i}" for i in range(self.size))

    def set_input(self, value: str, payload: Tensor, mask: Tensor) -> Tensor:
        """Every worker keeps the inputs (their cells are committed everywhere)."""
        idx = self._each("set_input", value, payload, mask)[0]
        self.owner.mark_input(value, idx)
        return idx

    def load(self, value: str, payload: Tensor, committed: Tensor, from_input: Tensor) -> None:
        self._each("load", value, payload, committed, from_input)

    def read(self, value: str) -> tuple[Tensor, Tensor]:
        """(payload, committed) assembled from each cell's owner."""
        if self.topology.replicated[value]:
            return self._calls("read", [(value,)] + [None] * (self.size - 1))[0]
        parts = self._each("read", value)
        payload, committed = parts[0]
        for i, (p, c) in enumerate(parts[1:], start=1):
            cells = self.topology.owned(value, i)
            payload[cells] = p[cells]
            committed[cells] = c[cells]
        return payload, committed

    # ---- durability: one store and one checkpoint shard per worker --------------------------------
    def open_store(self, run_dir: Any) -> None:
        self._each("open_store", run_dir)

    def close_store(self) -> None:
        self._each("close_store")

    def checkpoint_shards(self, label: int, sync: bool = True) -> dict[str, dict[str, Any]]:
        shards: dict[str, dict[str, Any]] = {}
        for got in self._each("checkpoint_shards", label, sync):
            shards.update(got)
        self.checkpointed = (label, shards)
        self.stored = {k: v for k, v in self.stored.items() if k[0] >= label}
        return shards

    def restore_shards(
        self,
        label: int,
        shards: Mapping[str, Mapping[str, Any]],
        upto: int,
        commits: Mapping[tuple[int, str], Tensor],
        committed: Mapping[str, Tensor],
        from_input: Mapping[str, Tensor],
    ) -> None:
        """Every worker restores its shard plus the rows of the cells it owns, then every routed
        cell moves to its receivers, so each worker's halo holds its owners' payload."""
        per: list[tuple[Any, ...]] = []
        for i in range(self.size):
            # a spread quorum value's cells are in every worker's store (keep_received)
            mine = {
                k: c
                if self.topology.workers_of(k[1]) > 1
                else c[self.topology.owner[k[1]].index_select(0, c) == i]
                for k, c in commits.items()
            }
            per.append((label, shards, upto, mine, committed, from_input))
        self._calls("restore_shards", list(per))
        self._resync()
        self.checkpointed = (label, {k: dict(v) for k, v in shards.items()})
        self.stored = {}
        for i, (*_, mine, _, _) in enumerate(per):
            for (epoch, name), c in mine.items():
                self._count_stored(epoch, i, {name: int(c.numel())})


__all__ = ["INJECT_ENV", "InProcessTransport", "WorkerGroup", "parse_fault"]
