"""W partitioned workers behind the one port the engine talks to (:mod:`lmpm.runtime.port`).

A :class:`WorkerGroup` holds W :class:`~lmpm.runtime.data.dataplane.DataPlane` workers in this
process, each holding the payload of the cells the topology
(:func:`lmpm.resolve.topology.partition`) gives it, and one
:class:`~lmpm.runtime.data.owner.Owner` that decides every cell over the merged candidates (in this
process for now: docs/distributed.md, "Where cells are decided"). For its owner it splits a
:class:`ProposeRequest` by worker, merges the workers' replies into one :class:`Candidates` per
value with the column layout one worker would produce (a worker where a rule did not fire
contributes invalid columns), splits the :class:`ApplyRequest` back, and after every worker
applied, moves the *changed* cells of each route from its sender to its receiver (the in-process
transport: a two-phase exchange, all apply, then all exchange). The engine sees the epoch's
report only.

How the workers are reached is the subclass's part: here they are objects in this process;
:class:`lmpm.runtime.data.raygroup.RayGroup` runs each as a Ray actor in its own process, the halo moving
over ``torch.distributed``. The split and merge of the messages, the metadata the group keeps for
restores (committed and input flags, the cells committed since the newest checkpoint) and the
restore itself are shared.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import UsageError
from lmpm.resolve.plan import Plan
from lmpm.resolve.topology import Topology, partition
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.owner import Owner
from lmpm.runtime.protocol import (
    Applied,
    ApplyReply,
    ApplyRequest,
    Candidates,
    EpochReport,
    EpochRequest,
    ProposeReply,
    ProposeRequest,
    RuleWork,
    Traffic,
    ValueDecision,
)


@dataclass(frozen=True, slots=True)
class _Merged:
    """How one value's merged rows and columns map onto each worker's own. The rows of several
    workers may be the same cell (a `quorum(k of n)` value: each worker proposes every cell for
    its replicas); their columns never overlap but for column 0 (keep current)."""

    workers: tuple[int, ...]  # the workers that had candidates for the value
    rows: tuple[Tensor, ...]  # per such worker: its rows' positions in the merged rows
    cols: tuple[Tensor, ...]  # per such worker: its columns' positions in the merged columns
    local_rows: Tensor  # (len(workers), n): the merged row's position in each worker's rows, -1
    global_to_local: Tensor  # (len(workers), C): merged column -> the worker's own column, -1
    cells: tuple[Tensor, ...]  # per such worker: its open cells

    def writers(self, rows: Tensor, winner: Tensor) -> Tensor:
        """(m,) index into ``workers``: the worker that applies each row, the one whose columns
        hold the winner (else the first that has the row: keep current)."""
        has = self.local_rows.index_select(1, rows) >= 0  # (S, m)
        holds = self.global_to_local.index_select(1, winner) >= 0  # (S, m)
        rank = has.to(torch.int64) + (has & holds).to(torch.int64)
        return rank.argmax(dim=0)  # the first worker of the highest rank


def _key(c: Candidates, j: int) -> tuple[int, int, int]:
    return int(c.col_rule[j]), int(c.col_replica[j]), int(c.col_slot[j])


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
            dst.committed[value].index_copy_(0, sel, src.committed[value].index_select(0, sel))
            dst.from_input[value].index_copy_(0, sel, src.from_input[value].index_select(0, sel))
            moved += sel.numel() * self.topology.cell_bytes[value]
        return moved


class WorkerGroup:
    """W in-process partitioned workers and the owner of their cells, behind the port."""

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
        self._merged: dict[str, _Merged] = {}
        # Metadata the group keeps to restore its workers (never payload): committed and input
        # flags per value, the newest checkpoint's shards and the cells committed since it.
        self.committed = {
            n: torch.zeros(vp.ncells, dtype=torch.bool) for n, vp in plan.values.items()
        }
        self.from_input = {
            n: torch.zeros(vp.ncells, dtype=torch.bool) for n, vp in plan.values.items()
        }
        self.checkpointed: tuple[int, dict[str, dict[str, Any]]] | None = None
        self.since: dict[tuple[int, str], list[Tensor]] = {}
        self.store: Any = None  # the workers hold the stores (one each)
        # the owner of every cell's metadata and decisions, over the merged candidates (in the
        # driver's process for now: docs/distributed.md, "Where cells are decided")
        self.owner = Owner(plan, self.seed)
        self.workers: list[Any] = self._start()
        self.transport = InProcessTransport(self.workers, self.topology)
        for spec in filter(None, os.environ.get(INJECT_ENV, "").split(",")):
            self.inject(*parse_fault(spec, self.size))

    # ---- reaching the workers (the in-process driver; RayGroup overrides these) -----------------
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
        """Run one epoch: the owner opens and decides, the workers propose and apply."""
        report = self.owner.epoch(self, req)
        report.halo_bytes = self.halo_bytes
        report.control_bytes = self.traffic.control_bytes
        report.message_bytes = self.traffic.message_bytes
        report.faults = tuple(self.take_faults())
        return report

    def compile(self) -> Any:
        raise UsageError(
            "--compile runs the epoch step next to one worker's payload; this run has a "
            "worker group",
            code="U101",
            hint="drop --compile, or run with one worker",
        )

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

    def _propose_all(self, subs: list[ProposeRequest | None]) -> list[ProposeReply | None]:
        replies = self._calls("propose", [None if s is None else (s,) for s in subs])
        self.traffic.count(*subs, *replies)
        return replies

    def _apply_all(self, subs: list[ApplyRequest | None]) -> tuple[list[ApplyReply | None], int]:
        """Apply on every worker, then move the cells each wrote along its routes: (replies,
        payload bytes moved)."""
        replies = self._calls("apply", [None if s is None else (s,) for s in subs])
        self.traffic.count(*subs, *replies)
        changed: dict[tuple[str, int], Tensor] = {}
        for i, (w, rep) in enumerate(zip(self.workers, replies, strict=True)):
            if rep is None:
                continue
            for name, cells in w.written.items():
                mask = torch.zeros(self.plan.values[name].ncells, dtype=torch.bool)
                mask[cells] = True
                changed[(name, i)] = mask
        moved = self.transport.exchange(changed)
        epoch = next((s.epoch for s in subs if s is not None), -1)
        for i, w in enumerate(self.workers):  # spread quorum values: every store keeps them whole
            got = received(self.topology, i, changed)
            if got:
                w.keep_received(epoch, got)
        return replies, moved

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
    def replica_worker(self, value: str, replica: int) -> str:
        """The worker that ran ``replica`` of ``value``'s rules: worker p for replica p of a spread
        quorum value; otherwise each cell's owner ("owners" when the value is split)."""
        if self.topology.workers_of(value) > 1:
            return f"w{replica}"
        if self.size == 1 or self.topology.replicated[value]:
            return "w0"
        return "owners"

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
        self.committed[value][idx] = True
        self.from_input[value][idx] = True
        return idx

    def load(self, value: str, payload: Tensor, committed: Tensor, from_input: Tensor) -> None:
        self._each("load", value, payload, committed, from_input)
        self.committed[value] = committed.bool().clone()
        self.from_input[value] = from_input.bool().clone()

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

    def checkpoint_shards(self, label: int) -> dict[str, dict[str, Any]]:
        shards: dict[str, dict[str, Any]] = {}
        for got in self._each("checkpoint_shards", label):
            shards.update(got)
        self.checkpointed = (label, shards)
        self.since = {k: v for k, v in self.since.items() if k[0] >= label}
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
        self.committed = {n: c.bool().clone() for n, c in committed.items()}
        self.from_input = {n: c.bool().clone() for n, c in from_input.items()}
        self.checkpointed = (label, {k: dict(v) for k, v in shards.items()})
        self.since = {k: [c] for k, c in commits.items()}

    # ---- propose ---------------------------------------------------------------------------------
    def _before(self, epoch: int) -> None:
        """Called before each epoch's propose (RayGroup: the first checkpoint for recovery)."""

    def propose(self, req: ProposeRequest) -> ProposeReply:
        parts: list[list[RuleWork]] = [[] for _ in self.workers]
        for rw in req.rules:
            target = self.plan.rules[rw.rule].target
            spread = self.topology.workers_of(target)
            if spread > 1:  # quorum(k of n): replica p of every cell on worker p
                for p in range(spread):
                    parts[p].append(RuleWork(rw.rule, rw.cells, (p,)))
                continue
            owner = self.topology.owner[target].index_select(0, rw.cells)
            for i in range(len(self.workers)):
                cells = rw.cells[owner == i]
                if cells.numel():
                    parts[i].append(RuleWork(rw.rule, cells))
        subs: list[ProposeRequest | None] = []
        for i in range(self.size):
            if not parts[i]:
                subs.append(None)
                continue
            record = None
            if req.record is not None:  # spread quorum values: recorded after the merge
                record = {
                    name: c[self.topology.owner[name].index_select(0, c) == i]
                    for name, c in req.record.items()
                    if self.topology.workers_of(name) == 1
                }
            subs.append(
                ProposeRequest(
                    req.epoch, tuple(parts[i]), req.fresh, record, req.phases, req.active
                )
            )
        self._before(req.epoch)
        self.traffic = Traffic()
        replies = self._propose_all(subs)
        seconds = sum(r.model_seconds for r in replies if r is not None)
        order = [rw.rule for rw in req.rules]
        values: dict[str, Candidates] = {}
        self._merged = {}
        # the values in the order one worker answers them (the order its rules fired): the
        # engine agrees and advances clocks value by value in this order
        targets = dict.fromkeys(self.plan.rules[rw.rule].target for rw in req.rules)
        names = [n for n in targets if any(r and n in r.values for r in replies)]
        for name in names:
            got = [(i, r.values[name]) for i, r in enumerate(replies) if r and name in r.values]
            values[name] = self._merge(name, got, order)
        self._record_spread(req)
        return ProposeReply(self.worker, values, seconds)

    def _record_spread(self, req: ProposeRequest) -> None:
        """``--trace cells`` of a spread quorum value: each replica worker records its candidates
        under the merged columns (their payloads stay on it; the trace reads every store)."""
        for name, which in (req.record or {}).items():
            mg = self._merged.get(name)
            if mg is None or self.topology.workers_of(name) == 1:
                continue
            args: list[tuple[Any, ...] | None] = [None] * self.size
            for s, i in enumerate(mg.workers):
                args[i] = (req.epoch, name, which, mg.cols[s].tolist())
            self._calls("record_columns", args)

    def _merge(self, name: str, got: list[tuple[int, Candidates]], order: list[int]) -> Candidates:
        """One value's candidates: rows sorted by cell, columns in the request's rule order."""
        width: dict[tuple[int, int], int] = {}
        for _, c in got:
            for j in range(1, c.col_rule.numel()):
                rid, replica, s = _key(c, j)
                width[(rid, replica)] = max(width.get((rid, replica), 0), s + 1)
        rank = {r: k for k, r in enumerate(order)}
        layout = sorted(width, key=lambda k: (rank[k[0]], k[1]))
        col_of: dict[tuple[int, int, int], int] = {}
        rule, rep, slot = [-1], [-1], [-1]
        for r, p in layout:
            for s in range(width[(r, p)]):
                col_of[(r, p, s)] = len(rule)
                rule.append(r)
                rep.append(p)
                slot.append(s)
        ncol = len(rule)
        cells = torch.cat([c.cells for _, c in got]).unique()  # sorted
        n = cells.numel()
        k = got[0][1].applies.shape[1]
        valid = torch.zeros((n, ncol), dtype=torch.bool)
        score = torch.full((n, ncol), -torch.inf, dtype=torch.float64)
        violated = torch.zeros((n, ncol, k), dtype=torch.bool)
        applies = torch.zeros((n, k), dtype=torch.bool)
        refreshed = None
        if any(c.refreshed is not None for _, c in got):
            refreshed = torch.zeros(n, dtype=torch.bool)
        checksum = None
        if got[0][1].checksum is not None:
            checksum = torch.zeros((n, ncol), dtype=torch.int64)
        rows_of, cols_of, cells_of = [], [], []
        local_rows = torch.full((len(got), n), -1, dtype=torch.int64)
        g2l = torch.full((len(got), ncol), -1, dtype=torch.int64)
        for slot_i, (_, c) in enumerate(got):
            m = c.cells.numel()
            rows = torch.searchsorted(cells, c.cells)
            cols = torch.tensor(
                [0] + [col_of[_key(c, j)] for j in range(1, c.col_rule.numel())],
                dtype=torch.int64,
            )
            rr, cc = rows.unsqueeze(1), cols.unsqueeze(0)
            # column 0 (keep current) comes from every worker holding the row: the same payload,
            # verdicts and validity; its score is the best proposal folded into it anywhere
            keep_score = torch.maximum(score[rows, 0], c.score[:, 0])
            valid[rr, cc] = c.valid
            score[rr, cc] = c.score
            score[rows, 0] = keep_score
            violated[rr, cc] = c.violated
            applies[rows] = c.applies
            if refreshed is not None and c.refreshed is not None:
                refreshed[rows] |= c.refreshed
            if checksum is not None and c.checksum is not None:
                checksum[rr, cc] = c.checksum
            g2l[slot_i, cols] = torch.arange(cols.numel())
            local_rows[slot_i, rows] = torch.arange(m)
            rows_of.append(rows)
            cols_of.append(cols)
            cells_of.append(c.cells)
        self._merged[name] = _Merged(
            tuple(i for i, _ in got),
            tuple(rows_of),
            tuple(cols_of),
            local_rows,
            g2l,
            tuple(cells_of),
        )
        return Candidates(
            name,
            cells,
            valid,
            score,
            violated,
            applies,
            torch.tensor(rule),
            torch.tensor(rep),
            torch.tensor(slot),
            refreshed,
            checksum,
        )

    # ---- apply -----------------------------------------------------------------------------------
    def apply(self, req: ApplyRequest) -> ApplyReply:
        split: list[dict[str, ValueDecision]] = [{} for _ in self.workers]
        where: dict[str, list[tuple[int, Tensor, Tensor]]] = {}
        for name, d in req.values.items():
            mg = self._merged[name]
            n = mg.local_rows.shape[1]
            rows = torch.arange(n) if d.rows is None else d.rows
            owner = mg.writers(rows, d.winner)
            for s, i in enumerate(mg.workers):
                sel = (owner == s).nonzero().squeeze(1)
                mine = rows.index_select(0, sel)  # merged rows this worker applies, in order
                local = mg.local_rows[s].index_select(0, mine)
                winner = mg.global_to_local[s].index_select(0, d.winner.index_select(0, sel))
                weights = None
                if d.weights is not None:
                    weights = d.weights.index_select(0, sel).index_select(1, mg.cols[s])
                all_rows = d.rows is None and local.numel() == mg.rows[s].numel()
                split[i][name] = ValueDecision(None if all_rows else local, winner, weights)
                where.setdefault(name, []).append((i, sel, local))
        subs = [
            ApplyRequest(req.epoch, split[i], req.checksums) if split[i] else None
            for i in range(self.size)
        ]
        replies, self.halo_bytes = self._apply_all(subs)
        out: dict[str, Applied] = {}
        for name, d in req.values.items():
            mg = self._merged[name]
            m = mg.local_rows.shape[1] if d.rows is None else d.rows.numel()
            changed = torch.ones(m, dtype=torch.bool)
            sums = torch.zeros(m, dtype=torch.int64) if req.checksums else None
            partial = False
            written: list[Tensor] = []
            for i, sel, local in where[name]:
                done = replies[i]
                assert done is not None
                got = done.values[name]
                ch = torch.ones(sel.numel(), dtype=torch.bool)
                if got.changed is not None:
                    ch = got.changed.bool()
                    partial = True
                changed[sel] = ch
                if sums is not None and got.checksum is not None:
                    sums[sel[ch]] = got.checksum
                s = mg.workers.index(i)
                cells = mg.cells[s].index_select(0, local)[ch]
                written.append(cells)
            out[name] = Applied(
                changed if partial else None,
                None if sums is None else (sums[changed] if partial else sums),
            )
            cells = torch.cat(written) if written else torch.zeros(0, dtype=torch.int64)
            self.committed[name][cells] = True
            self.from_input[name][cells] = False
            self.since.setdefault((req.epoch, name), []).append(cells)
        self.halo_bytes_total += self.halo_bytes
        durable = all(r.durable for r in replies if r is not None) and any(replies)
        return ApplyReply(self.worker, out, durable)


__all__ = ["INJECT_ENV", "InProcessTransport", "WorkerGroup", "parse_fault"]
