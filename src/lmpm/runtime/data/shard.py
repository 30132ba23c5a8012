"""The owner of one worker's cells in a group: it decides them where their candidates are.

In a group of W workers (:mod:`lmpm.runtime.data.group`, :mod:`lmpm.runtime.data.raygroup`)
every worker holds a :class:`ShardOwner` beside its :class:`~lmpm.runtime.data.dataplane.DataPlane`.
It keeps a replica of every cell's metadata (committed flags, clocks, provenance, scores: the
plan's size, never payload) and decides the cells the topology gives its worker: it opens them
(the schedule reads the replicated committed flags, so the schedules that open a few unset cells
of the whole value open the same ones as one owner would), has its data plane propose and check
them, agrees (the same pure policy functions), applies, advances the clocks and records
provenance. The control plane gets one :class:`~lmpm.runtime.protocol.EpochReport` per worker per
epoch, of a size independent of the cells (the per-cell records only when an observer asks for
them: ``EpochRequest.records``).

Inside an epoch the owners exchange metadata worker to worker, never through the control plane:
:meth:`ShardOwner.decide` is a generator that yields a :class:`Gather` (its part of one exchange)
and receives every worker's part, in worker order. Every worker yields the same sequence of
gathers (it depends on the plan only), so the driver of the group runs them in lockstep: the
in-process group hands the parts around, a Ray worker all-gathers them over gloo. The exchanges
(:class:`Exchange`; each part a small record, or None where a worker has nothing to send):

- ``spread:V``: a ``quorum(k of n)`` value spread over the workers (replica p on worker p) sends
  every replica's candidates (:class:`~lmpm.runtime.protocol.Candidates`) to every worker; each
  merges them into the columns one worker would produce and decides every cell (the value is
  replicated), and writes the rows whose winning column it holds; ``applied:V`` then tells every
  worker what each writer wrote (:class:`Written`);
- ``quota:V``: a schedule with a quota (confidence) keeps the most confident commits of the
  whole value: the would-be commits' cells and confidences (:class:`WouldCommit`);
- ``meta:V``: after a value commits (values in commit order: a value's clocks read those of the
  values committed before it in the epoch), the committed cells' clocks, rules and scores
  (:class:`Commits`), so every replica of the metadata stays whole; the values no later value of
  the epoch reads share one ``meta`` exchange at the end (per value, its Commits).

With these, a group commits exactly what one worker commits: payload, committed flags, clocks,
provenance, why-codes of the cells each owner decides (``tests/runtime/test_group.py``).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, TypeVar

import torch
from torch import Tensor

from lmpm.resolve.plan import Plan
from lmpm.resolve.topology import Topology
from lmpm.runtime.data.agree import Agreed, keep_top
from lmpm.runtime.data.decide import Pending, count_violations, newly_set, write_meta
from lmpm.runtime.data.owner import (
    Owner,
    broken_counts,
    dissent,
    reasons,
    schedule_of,
)
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
    ValueDecision,
)
from lmpm.runtime.records import (
    CellState,
    Compact,
    Dissent,
    EpochRecord,
    LogShare,
    ValueEpoch,
    committed_sum,
    merge_logs,
    wire_code,
)
from lmpm.runtime.rundir import commit_rows


class Exchange(Enum):
    """The owners' exchanges inside an epoch (see the module doc), by what each part holds."""

    SPREAD = "spread"  # a spread quorum value's candidates (Candidates)
    QUOTA = "quota"  # the commits a quota keeps the most confident of (WouldCommit)
    APPLIED = "applied"  # what each writer of a spread value wrote (Written)
    META = "meta"  # the committed cells' new metadata (Commits; at the end, per value)


@dataclass(frozen=True, slots=True)
class WouldCommit(Compact):
    """A worker's part of a ``quota:V`` exchange: the cells its policy would commit before the
    quota, and their confidence (the winner's score)."""

    cells: Tensor  # (m,) int64
    conf: Tensor  # (m,) float64


@dataclass(frozen=True, slots=True)
class Written(Compact):
    """A worker's part of an ``applied:V`` exchange: the rows of a spread value's decision it
    wrote, which of them changed (None: all), and their checksums where the policy asks."""

    rows: Tensor  # (m,) int64 positions in the decision's rows
    changed: Tensor | None  # (m,) bool
    sums: Tensor | None  # (changed rows,) int64


@dataclass(frozen=True, slots=True)
class Commits(Compact):
    """A worker's part of a ``meta:V`` exchange: the cells it committed and their new metadata."""

    cells: Tensor  # (m,) int64
    clock: Tensor  # (m,) int64
    rule: Tensor  # (m,) int64
    score: Tensor  # (m,) float64


wire_code(WouldCommit, 245)  # two bytes of class reference in every exchange's pickle
wire_code(Written, 246)
wire_code(Commits, 247)

# one worker's part of an exchange; None: it has nothing to send (the end-of-epoch `meta`
# exchange: per value no later value of the epoch reads, its Commits)
Part = Candidates | WouldCommit | Written | Commits | dict[str, Commits] | None
_P = TypeVar("_P")


def parts_of(got: Sequence[Part], kind: type[_P]) -> list[_P | None]:
    """Every worker's part of one exchange, as ``kind`` (None where a worker sent nothing)."""
    out: list[_P | None] = []
    for part in got:
        if part is not None and not isinstance(part, kind):
            raise TypeError(f"expected a {kind.__name__} part, got {type(part).__name__}")
        out.append(part)
    return out


@dataclass(frozen=True, slots=True)
class Gather:
    """One exchange between the owners of a group inside an epoch: every worker sends ``part``
    (metadata) and gets every worker's part back, in worker order. ``exchange`` and ``value``
    name the exchange; every worker yields the same ones in the same order."""

    exchange: Exchange
    value: str | None  # the value it is about (None: the end-of-epoch ``meta`` of several)
    part: Part

    @property
    def key(self) -> str:
        """``spread:V``, ``quota:V``, ``applied:V``, ``meta:V`` or ``meta``: for messages."""
        kind = self.exchange.value
        return kind if self.value is None else f"{kind}:{self.value}"


# what a ShardOwner's epoch is: it yields gathers, receives every worker's parts, returns its report
Decide = Generator[Gather, list[Part], EpochReport]


# ---- merging candidates and records of several workers into the columns of one --------------------
@dataclass(frozen=True, slots=True)
class Merged:
    """How one value's merged rows and columns map onto each worker's own. The rows of several
    workers may be the same cell (a spread `quorum(k of n)` value: each worker proposes every cell
    for its replicas); their columns never overlap but for column 0 (keep current)."""

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


def _key(rule: Tensor, replica: Tensor, slot: Tensor, j: int) -> tuple[int, int, int]:
    return int(rule[j]), int(replica[j]), int(slot[j])


def _merged_columns(
    got: Sequence[Candidates], rank: Mapping[int, int]
) -> tuple[dict[tuple[int, int, int], int], tuple[list[int], list[int], list[int]]]:
    """The merged column layout of several workers' candidates: keep, then per fired rule in
    ``rank`` order and per replica its proposal slots (the widest any worker had). Returns the
    merged column of each (rule, replica, slot) and each column's rule, replica and slot (-1:
    keep)."""
    width: dict[tuple[int, int], int] = {}
    for c in got:
        for j in range(1, c.col_rule.numel()):
            rid, replica, s = _key(c.col_rule, c.col_replica, c.col_slot, j)
            width[(rid, replica)] = max(width.get((rid, replica), 0), s + 1)
    layout = sorted(width, key=lambda k: (rank[k[0]], k[1]))
    col_of: dict[tuple[int, int, int], int] = {}
    rule, rep, slot = [-1], [-1], [-1]
    for r, p in layout:
        for s in range(width[(r, p)]):
            col_of[(r, p, s)] = len(rule)
            rule.append(r)
            rep.append(p)
            slot.append(s)
    return col_of, (rule, rep, slot)


def merge_candidates(
    name: str, got: Sequence[tuple[int, Candidates]], rank: Mapping[int, int]
) -> tuple[Candidates, Merged]:
    """One value's candidates from several workers: rows sorted by cell, columns laid out as one
    worker would lay them out (keep, then per fired rule in ``rank`` order and per replica its
    proposal slots); a worker where a rule did not fire contributes invalid columns."""
    col_of, (rule, rep, slot) = _merged_columns([c for _, c in got], rank)
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
            [0]
            + [
                col_of[_key(c.col_rule, c.col_replica, c.col_slot, j)]
                for j in range(1, c.col_rule.numel())
            ],
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
    merged = Merged(
        tuple(i for i, _ in got),
        tuple(rows_of),
        tuple(cols_of),
        local_rows,
        g2l,
        tuple(cells_of),
    )
    columns = (torch.tensor(rule), torch.tensor(rep), torch.tensor(slot))
    cand = Candidates.build(
        name, cells, (valid, score, violated, applies), columns, refreshed, checksum
    )
    return cand, merged


def merge_records(parts: Sequence[ValueEpoch], rank: Mapping[int, int]) -> ValueEpoch:
    """One value's epoch records from several owners (disjoint cells) as one owner records it:
    rows sorted by cell, the columns of :func:`merge_candidates`."""
    if len(parts) == 1:
        return parts[0]
    as_cand = [(i, Candidates.of_record(ve)) for i, ve in enumerate(parts)]
    cand, mg = merge_candidates(parts[0].value, as_cand, rank)
    n = cand.cells.numel()
    winner = torch.zeros(n, dtype=torch.int64)
    changed = torch.zeros(n, dtype=torch.bool)
    new_clock = torch.zeros(n, dtype=torch.int64)
    was = torch.zeros(n, dtype=torch.bool)
    sums = None if parts[0].checksum is None else torch.zeros(n, dtype=torch.int64)
    disagreed = None if parts[0].disagreed is None else torch.zeros(n, dtype=torch.bool)
    for s, ve in enumerate(parts):
        rows = mg.rows[s]
        winner[rows] = mg.cols[s].index_select(0, ve.winner)
        changed[rows] = ve.changed
        new_clock[rows] = ve.new_clock
        was[rows] = ve.was_committed
        if sums is not None and ve.checksum is not None:
            sums[rows] = ve.checksum
        if disagreed is not None and ve.disagreed is not None:
            disagreed[rows] = ve.disagreed
    return ValueEpoch(
        cand.value,
        cand.cells,
        cand.valid,
        cand.score,
        cand.col_rule,
        cand.violated,
        parts[0].constraint_ids,
        winner,
        changed,
        new_clock,
        was,
        cand.applies,
        sums,
        cand.col_replica,
        cand.col_slot,
        disagreed,
    )


def merge_dissent(reports: Sequence[EpochReport], order: Sequence[str]) -> tuple[Dissent, ...]:
    """The workers' outvoted replicas as one owner reports them: per value (in commit order) and
    replica, the cells summed over the workers."""
    total: dict[tuple[str, int, str], int] = {}
    for r in reports:
        for d in r.dissent:
            key = (d.value, d.replica, d.worker)
            total[key] = total.get(key, 0) + d.cells
    pos = {name: k for k, name in enumerate(order)}
    keys = sorted(total, key=lambda k: (pos.get(k[0], len(pos)), k[1]))
    return tuple(Dissent(v, p, w, total[(v, p, w)]) for v, p, w in keys)


def commit_order(plan: Plan) -> list[str]:
    """The proposed values in the order one owner commits them: the order of their first rule."""
    proposed = plan.rules_by_target
    return list(dict.fromkeys(rp.target for rp in plan.rules if rp.target in proposed))


@dataclass(slots=True)
class _Tally:
    """What an owner counts of its epoch for its report."""

    commits: int = 0
    attempts: int = 0
    violations: int = 0
    values: list[ValueEpoch] = field(default_factory=list)
    dissents: list[Dissent] = field(default_factory=list)

    def add(self, ve: ValueEpoch, commits: int, violations: int) -> None:
        self.values.append(ve)
        self.commits += commits
        self.attempts += int(ve.cells.numel())
        self.violations += violations


class ShardOwner(Owner):
    """The owner of worker ``rank``'s cells, with a replica of every cell's metadata (see the
    module doc)."""

    def __init__(self, plan: Plan, topology: Topology, rank: int, seed: int = 0) -> None:
        super().__init__(plan, seed)
        self.topology = topology
        self.rank = rank
        self.worker = f"w{rank}"
        self.order = commit_order(plan)
        self.rule_rank = {rp.id: k for k, rp in enumerate(plan.rules)}
        self.spread = {name: topology.workers_of(name) > 1 for name in self.static}
        self.mine = {name: topology.owner[name] == rank for name in self.static}
        # a value whose commits a value committed after it in the epoch reads (its clocks): the
        # owners exchange them at once; the others' commits travel in one exchange at the end
        read_by_later: set[str] = set()
        for k, name in enumerate(self.order):
            for rp in plan.rules_by_target[name]:
                read_by_later |= {cr.source for cr in self.clocks.reads[rp.id]} & set(
                    self.order[:k]
                )
        self.urgent = {n: n in read_by_later and not self.spread[n] for n in self.order}
        self.deferred = [n for n in self.order if not self.urgent[n] and not self.spread[n]]
        # the run directory's per-cell log rows, written by this owner into its worker's store
        # (set_log): whether it writes them, and its tracer (None: `--trace off`)
        self.logging = False
        self.tracer: Any = None
        # what the current epoch wrote, to undo it (rollback)
        self._undo: list[tuple[str, Tensor, CellState]] = []
        self._undo_epoch = -1
        self._unset_at: dict[str, int] = {}

    # ---- the metadata, read and restored from outside the epoch ------------------------------------
    def get_state(self) -> dict[str, CellState]:
        return self.state

    def get_why(self) -> dict[str, Tensor]:
        return self.why

    def restore(self, value: str, state: CellState) -> None:
        super().restore(value, copy_state(state))  # each owner writes its own copy

    def rollback(self, epoch: int) -> None:
        """Go back to the start of ``epoch``: undo it if this owner was in it (a worker failed
        in it, and the group redoes it); an owner that finished the epoch before (a fault
        between epochs) keeps its metadata."""
        if self._undo_epoch < epoch:
            return
        for name, idx, old in reversed(self._undo):
            st = self.state[name]
            for f in fields(CellState):
                getattr(st, f.name).index_copy_(0, idx, getattr(old, f.name))
            self.version[name] += 1
        self._undo = []
        self._unset = dict(self._unset_at)

    def _journal(self, name: str, idx: Tensor) -> None:
        """Keep the metadata of ``idx`` as it is before the epoch writes it (rollback)."""
        st = self.state[name]
        old = CellState(*(getattr(st, f.name).index_select(0, idx) for f in fields(CellState)))
        self._undo.append((name, idx, old))

    def replica_worker(self, value: str, replica: int) -> str:
        """The worker that ran ``replica`` of ``value``'s rules: worker p for replica p of a spread
        quorum value; otherwise each cell's owner ("owners" when the value is split)."""
        if self.spread.get(value, False):
            return f"w{replica}"
        if self.topology.workers == 1 or self.topology.replicated[value]:
            return "w0"
        return "owners"

    # ---- the epoch -------------------------------------------------------------------------------
    def decide(self, dp: Any, req: EpochRequest) -> Decide:
        """Epoch ``req.epoch`` on this worker's cells, with data plane ``dp`` (its propose and
        apply): a generator of :class:`Gather` (see the module doc) returning this worker's
        report. Only worker 0 reports the spread values (every worker decides all their cells)
        and the replicated counts (open and unset cells)."""
        e = req.epoch
        self._undo, self._undo_epoch, self._unset_at = [], e, dict(self._unset)
        self.set_active(req.active)
        everywhere = self.open_cells(e, req.skip, req.start)
        open_ = {
            name: c if self.spread[name] else c[self.mine[name].index_select(0, c)]
            for name, c in everywhere.items()
        }
        phases = {
            name: None if self.guarded[name] else self.schedule.phase(name, e) for name in open_
        }
        reply = self._propose(dp, req, open_, phases)
        self._not_fired(open_, reply, {})
        cands, merged = yield from self._merge_spread(dp, req, dict(reply.values))
        pending = yield from self._agree_all(e, cands)
        decisions: dict[str, ValueDecision] = {}
        sel_of: dict[str, Tensor] = {}  # spread values: the decision rows written here
        for name, p in pending.items():
            if name not in merged:
                decisions[name] = p.decision()
            elif (mine := self._my_rows(merged[name], p)) is not None:
                decisions[name], sel_of[name] = mine
        logs = self.logging and dp.store is not None  # the rows go in with the payload's
        applied = dp.apply(ApplyRequest(e, decisions, req.checksums, sync=not logs))
        tally = yield from self._commit_all(e, pending, merged, applied, sel_of, phases)
        share = self._log(dp, e, tally.values) if logs else None
        first = self.rank == 0
        report = EpochReport(
            e,
            self.worker,
            tuple(sorted((k, int(v.numel())) for k, v in everywhere.items())) if first else (),
            tally.commits,
            tally.attempts,
            tally.violations,
            reply.model_seconds,
            self.unset() if first else {},
            tuple(tally.dissents),
            tally.values if req.records else [],
            durable=applied.durable or not decisions,
        )
        report.log = share
        return report

    def set_log(self, tracer: Any, level: str = "", region: Any = None) -> None:
        """Write the run directory's per-cell log rows of this owner's cells into its worker's
        store from now on (commits; with ``tracer``, a Tracer class from the control plane,
        the trace rows of ``level`` and ``region`` too)."""
        self.logging = True
        self.tracer = None if tracer is None else tracer(self.plan, level, region)

    def _log(self, dp: Any, e: int, values: list[ValueEpoch]) -> LogShare:
        """Write this owner's per-cell log rows of epoch ``e`` into its store, then make the
        epoch durable there (payload and rows together); what is left for the control plane's
        log."""
        rows = commit_rows(EpochRecord(e, values, 0, 0, 0, 0, 0.0, 0.0))
        trace = None if self.tracer is None else self.tracer.rows(e, values)
        dp.store.append_log(
            rows, [] if trace is None else trace.cells, [] if trace is None else trace.candidates
        )
        dp.store.sync(e)
        return LogShare(
            sum(int(ve.valid.count_nonzero()) for ve in values),
            0 if trace is None else trace.decided,
            () if trace is None else tuple(trace.summary),
            committed_sum(values),
        )

    def _propose(
        self,
        dp: Any,
        req: EpochRequest,
        open_: Mapping[str, Tensor],
        phases: Mapping[str, int | None],
    ) -> ProposeReply:
        """The candidates of this worker's open cells (a spread value: its replica of every
        cell), from its data plane."""
        work = tuple(
            RuleWork(rw.rule, rw.cells, (self.rank,))
            if self.spread[self.plan.rules[rw.rule].target]
            else rw
            for rw in self.work(req.epoch, open_)
        )
        if not work:
            return ProposeReply(self.worker, {}, 0.0)
        record = None
        if req.record is not None:  # spread values: recorded under the merged columns
            record = {
                name: c[self.mine[name].index_select(0, c)]
                for name, c in req.record.items()
                if name in self.mine and not self.spread[name]
            }
        reply: ProposeReply = dp.propose(
            ProposeRequest(req.epoch, work, self.fresh, record, phases, req.active)
        )
        return reply

    def _merge_spread(
        self, dp: Any, req: EpochRequest, cands: dict[str, Candidates]
    ) -> Generator[Gather, list[Part], tuple[dict[str, Candidates], dict[str, Merged]]]:
        """Spread values: every replica's candidates to every worker, merged into one owner's
        columns (``spread:V``)."""
        merged: dict[str, Merged] = {}
        for name in self.order:
            if not self.spread[name]:
                continue
            got = yield Gather(Exchange.SPREAD, name, cands.get(name))
            have = [(i, c) for i, c in enumerate(parts_of(got, Candidates)) if c is not None]
            if not have:
                cands.pop(name, None)
                continue
            cands[name], mg = merge_candidates(name, have, self.rule_rank)
            merged[name] = mg
            if req.record is not None and name in req.record and self.rank in mg.workers:
                cols = mg.cols[mg.workers.index(self.rank)].tolist()
                dp.record_columns(req.epoch, name, req.record[name], cols)
        return cands, merged

    def _agree_all(
        self, e: int, cands: Mapping[str, Candidates]
    ) -> Generator[Gather, list[Part], dict[str, Pending]]:
        """Agree on every value this worker has candidates for; a quota over the whole value
        (``quota:V``: every worker takes part, candidates or not)."""
        pending: dict[str, Pending] = {}
        for name in self.order:
            cand = cands.get(name)
            if self.schedule.has_quota and not self.spread[name]:
                agreed = None if cand is None else self._policy(name, e, cand, None)
                got = yield Gather(Exchange.QUOTA, name, _would_commit(cand, agreed))
                if cand is not None and agreed is not None:
                    pending[name] = self._agree_shared(name, e, cand, agreed, got)
            elif cand is not None:
                pending[name] = self._agree(name, e, cand)
        return pending

    def _commit_all(
        self,
        e: int,
        pending: Mapping[str, Pending],
        merged: Mapping[str, Merged],
        applied: ApplyReply,
        sel_of: Mapping[str, Tensor],
        phases: Mapping[str, int | None],
    ) -> Generator[Gather, list[Part], _Tally]:
        """Clocks and provenance of the committing cells, value by value in commit order; the
        commits reach the other owners' replicas (``meta:V`` at once where a value committed
        later in the epoch reads them, else one ``meta`` exchange at the end)."""
        tally = _Tally()
        later: dict[str, Commits] = {}  # what the other owners need by the next epoch only
        for name in self.order:
            p = pending.get(name)
            got_applied = applied.values.get(name)
            if name in merged:  # what every writer of the spread value wrote
                part = _applied_part(sel_of.get(name), got_applied)
                got = yield Gather(Exchange.APPLIED, name, part)
                got_applied = self._applied_all(p, parts_of(got, Written))
            if p is None:
                if self.urgent[name]:  # the others' commits still reach this replica
                    got = yield Gather(Exchange.META, name, None)
                    self._take_meta(name, e, parts_of(got, Commits))
                continue
            assert got_applied is not None
            self._journal(name, p.cand.cells)
            ve, n_commits = self._commit(name, e, p, got_applied, phases[name])
            ve.col_replica, ve.col_slot = p.cand.col_replica, p.cand.col_slot
            if n_commits:
                self._unset[name] -= n_commits if self.fresh[name] else newly_set(ve)
            if self.urgent[name]:
                got = yield Gather(Exchange.META, name, self._meta_part(name, ve))
                self._take_meta(name, e, parts_of(got, Commits))
            elif not self.spread[name]:
                mine = self._meta_part(name, ve)
                if mine is not None:
                    later[name] = mine
            if self.spread[name] and self.rank != 0:
                continue  # worker 0 reports the cells every worker decided
            if self.quorum[name]:
                for rep, n in dissent(p.cand, p.winner, ve.changed):
                    tally.dissents.append(Dissent(name, rep, self.replica_worker(name, rep), n))
            tally.add(ve, n_commits, count_violations(p.cand.violated))
        if self.deferred:  # one exchange for every value no later value of the epoch reads
            got = yield Gather(Exchange.META, None, later)
            every = parts_of(got, dict)
            for name in self.deferred:
                self._take_meta(name, e, [None if p is None else p.get(name) for p in every])
        return tally

    # ---- agreement over the whole value (a schedule's quota) ---------------------------------------
    def _agree_shared(
        self,
        name: str,
        e: int,
        cand: Candidates,
        agreed: tuple[Agreed, Tensor],
        got: list[Part],
    ) -> Pending:
        """Agree with the quota kept over every worker's would-be commits: the most confident
        ``quota`` cells of the whole value (ties: lower cell), as one owner keeps them."""
        quota = self.quota(name, e)
        ag, was = agreed
        would = [p for p in parts_of(got, WouldCommit) if p is not None]
        cells = torch.cat([p.cells for p in would] or [torch.zeros(0, dtype=torch.int64)])
        if quota is not None and cells.numel() > quota:
            conf = torch.cat([p.conf for p in would])
            order = torch.argsort(cells)  # one owner's rows are in cell order
            kept = cells.index_select(0, order)[keep_top(conf.index_select(0, order), quota)]
            ag.changed = ag.changed & torch.isin(cand.cells, kept)
        return self._pending(name, cand, ag, was, quota)

    # ---- spread values: every worker decides, the winning replica's worker writes ----------------
    def _my_rows(self, mg: Merged, p: Pending) -> tuple[ValueDecision, Tensor] | None:
        """The decision of a spread value for the rows this worker writes, in its own rows and
        columns, and those rows' positions in the decision."""
        if self.rank not in mg.workers:
            return None
        s = mg.workers.index(self.rank)
        d = p.decision()
        n = mg.local_rows.shape[1]
        rows = torch.arange(n) if d.rows is None else d.rows
        sel = (mg.writers(rows, d.winner) == s).nonzero().squeeze(1)
        if not sel.numel():
            return None
        mine = rows.index_select(0, sel)
        local = mg.local_rows[s].index_select(0, mine)
        winner = mg.global_to_local[s].index_select(0, d.winner.index_select(0, sel))
        weights = None
        if d.weights is not None:
            weights = d.weights.index_select(0, sel).index_select(1, mg.cols[s])
        every = d.rows is None and local.numel() == mg.rows[s].numel()
        return ValueDecision(None if every else local, winner, weights), sel

    def _applied_all(self, p: Pending | None, parts: list[Written | None]) -> Applied | None:
        """Every writer's part of a spread value as one Applied over the decision rows."""
        if p is None:
            return None
        m = p.commits if p.rows is not None else p.winner.numel()
        changed = torch.ones(m, dtype=torch.bool)
        sums = torch.zeros(m, dtype=torch.int64)
        partial = has_sums = False
        for part in parts:
            if part is None:
                continue
            sel = part.rows
            if part.changed is not None:
                changed[sel] = part.changed
                partial = True
            if part.sums is not None:
                ch = part.changed
                if ch is None:
                    ch = torch.ones(sel.numel(), dtype=torch.bool)
                sums[sel[ch]] = part.sums
                has_sums = True
        out_sums = (sums[changed] if partial else sums) if has_sums else None
        return Applied(changed if partial else None, out_sums)

    # ---- the replicated metadata -----------------------------------------------------------------
    def _meta_part(self, name: str, ve: ValueEpoch) -> Commits | None:
        """The cells this worker committed of ``name`` and their new metadata (None: none)."""
        idx = ve.cells[ve.changed]
        if not idx.numel():
            return None
        st = self.state[name]
        return Commits(
            idx,
            st.clock.index_select(0, idx),
            st.rule.index_select(0, idx),
            st.score.index_select(0, idx),
        )

    def _take_meta(self, name: str, e: int, got: list[Commits | None]) -> None:
        """Write the other workers' commits of ``name`` into this replica of the metadata."""
        st = self.state[name]
        for i, part in enumerate(got):
            if i == self.rank or part is None:
                continue
            idx = part.cells
            self._journal(name, idx)
            self._unset[name] -= int(
                idx.numel() - st.committed.index_select(0, idx).count_nonzero()
            )
            write_meta(st, idx, part.clock, part.rule, e, part.score)
            self.version[name] += 1


def _would_commit(
    cand: Candidates | None, agreed: tuple[Agreed, Tensor] | None
) -> WouldCommit | None:
    """The cells this worker's policy would commit and their confidence (the winner's score),
    before the quota: its part of a ``quota:V`` exchange."""
    if cand is None or agreed is None:
        return None
    ag = agreed[0]
    rows = ag.changed.nonzero().squeeze(1)
    conf = ag.score.gather(1, ag.winner.unsqueeze(1)).squeeze(1)
    return WouldCommit(cand.cells.index_select(0, rows), conf.index_select(0, rows))


def _applied_part(sel: Tensor | None, got: Applied | None) -> Written | None:
    """What this worker wrote of a spread value: its decision rows, changed flags, checksums."""
    if sel is None or got is None:
        return None
    return Written(sel, None if got.changed is None else got.changed.bool(), got.checksum)


def lockstep(gens: Sequence[Decide]) -> list[EpochReport]:
    """Run the owners' epochs of one process side by side: at each gather every owner gets every
    owner's part (in-process, nothing is copied). Their reports, in worker order."""
    out: list[EpochReport | None] = [None] * len(gens)
    sent: list[Part] | None = None
    while True:
        asks: list[Gather] = []
        for i, g in enumerate(gens):
            try:
                asks.append(g.send(sent) if sent is not None else next(g))
            except StopIteration as stop:
                out[i] = stop.value
        if len(asks) not in (0, len(gens)):
            raise RuntimeError("a group's owners left the epoch at different exchanges")
        if not asks:
            return [r for r in out if r is not None]
        if len({(a.exchange, a.value) for a in asks}) != 1:
            keys = sorted({a.key for a in asks})
            raise RuntimeError(f"a group's owners are at different exchanges: {keys}")
        sent = [a.part for a in asks]


def merge_reports(
    reports: Sequence[EpochReport], order: Sequence[str], rank: Mapping[int, int], records: bool
) -> EpochReport:
    """The owners' reports of one epoch as one report to the control plane: counts summed, the
    replicated ones (open cells, unset cells) from worker 0, the records (when wanted) merged
    into one owner's."""
    first = reports[0]
    values: list[ValueEpoch] = []
    if records:
        for name in order:
            parts = [ve for r in reports for ve in r.values if ve.value == name]
            if parts:
                values.append(merge_records(parts, rank))
    commits = sum(r.commits for r in reports)
    logs = [r.log for r in reports]
    report = EpochReport(
        first.epoch,
        "group",
        first.opened,
        commits,
        sum(r.attempts for r in reports),
        sum(r.violations for r in reports),
        sum(r.model_seconds for r in reports),
        first.unset,
        merge_dissent(reports, order),
        values,
        durable=all(r.durable for r in reports) or not commits,
    )
    if all(log is not None for log in logs):
        report.log = merge_logs([log for log in logs if log is not None])
    return report


class OwnersView:
    """A group's owners as the control plane reads the cells' metadata (checkpoints, the stop
    reason, resume; never inside an epoch): every owner keeps all of it but the why-codes, which
    each keeps for the cells it decides. ``group``: a WorkerGroup or RayGroup (its
    ``owner_calls`` reaches the owners, in this process or in the workers')."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.plan = group.plan
        self.topology = group.topology
        self.schedule = schedule_of(self.plan, group.seed)
        self._state: tuple[int, dict[str, CellState]] | None = None

    def _first(self, method: str, *args: Any) -> Any:
        return self.group.owner_calls(method, [args] + [None] * (self.group.size - 1))[0]

    def _every(self, method: str, *args: Any) -> list[Any]:
        out: list[Any] = self.group.owner_calls(method, [args] * self.group.size)
        self.group.changes += 1
        return out

    @property
    def state(self) -> dict[str, CellState]:
        """Per value, its cells' metadata (worker 0's replica, the same as every owner's)."""
        if self._state is None or self._state[0] != self.group.changes:
            self._state = (self.group.changes, self._first("get_state"))
        return self._state[1]

    @property
    def why(self) -> dict[str, Tensor]:
        """Per proposed value, each cell's why-code from the owner that decides it."""
        whys = self.group.owner_calls("get_why", [()] * self.group.size)
        out: dict[str, Tensor] = {}
        for name, why in whys[0].items():
            if self.topology.workers_of(name) > 1 or len(whys) == 1:
                out[name] = why
                continue
            owner_of = self.topology.owner[name]
            out[name] = why.clone()
            for rank, other in enumerate(whys[1:], start=1):
                mine = owner_of == rank
                out[name][mine] = other[name][mine]
        return out

    def reasons(self) -> dict[str, dict[int, int]]:
        return reasons(self.why, self.state)

    def broken_counts(self) -> dict[str, dict[int, int]]:
        """Per value, committed cells that violate a live constraint (each cell's verdicts from
        the owner that decides it), by constraint id."""
        alls = self.group.owner_calls("get_broken", [()] * self.group.size)
        merged: dict[str, Tensor] = {}
        for name, bits in alls[0].items():
            if self.topology.workers_of(name) > 1 or len(alls) == 1:
                merged[name] = bits
                continue
            owner_of = self.topology.owner[name]
            merged[name] = bits.clone()
            for rank, other in enumerate(alls[1:], start=1):
                mine = owner_of == rank
                merged[name][mine] = other[name][mine]
        return broken_counts(self.plan, merged, self.state)

    def unset(self) -> dict[str, int]:
        return dict(self._first("unset"))

    def open_cells(self, e: int, skip: int, start: int) -> dict[str, Tensor]:
        return dict(self._first("open_cells", e, skip, start))

    def restore(self, value: str, state: CellState) -> None:
        self._every("restore", value, state)

    def mark_input(self, value: str, cells: Tensor) -> None:
        self._every("mark_input", value, cells)


def copy_state(st: CellState) -> CellState:
    """A copy of one value's metadata (each owner writes its own)."""
    return CellState(*(getattr(st, f.name).clone() for f in fields(CellState)))
