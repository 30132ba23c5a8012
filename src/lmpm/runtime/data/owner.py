"""The owner of a value's cells decides them: open, check, agree, apply, clocks, provenance.

An :class:`Owner` sits on the data plane's side of the port, next to the workers that hold the
payload. Per epoch (:meth:`Owner.epoch`) it

1. opens the cells its schedule opens (:mod:`lmpm.resolve.schedules`) and evaluates each rule's
   trigger on them;
2. asks its workers for the candidates (:class:`~lmpm.runtime.protocol.ProposeRequest`: per value
   and open cell, each candidate's score, validity and constraint verdicts);
3. agrees (:func:`lmpm.runtime.data.agree.agree`: the value's commit policy, the schedule's quota);
4. has the workers write the winners (:class:`~lmpm.runtime.protocol.ApplyRequest`), then advances
   the Lamport clocks (:mod:`lmpm.runtime.data.clocks`) and provenance of the committed cells.

It answers the control plane with an :class:`~lmpm.runtime.protocol.EpochReport`: counts of fixed
size, plus the per-cell records (:class:`~lmpm.runtime.records.ValueEpoch`) that the owner's
observers write (the commit log and the trace, in the same process).

Its workers are one :class:`~lmpm.runtime.data.dataplane.DataPlane` (which owns every cell) or a
:class:`~lmpm.runtime.data.group.WorkerGroup`, whose propose merges the workers' candidates into the
columns one worker would produce. Reads see the state at the start of the epoch and winners are
applied together at its end, so an epoch's result does not depend on the order in which work ran.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from lmpm.ir.nodes import TRUE
from lmpm.resolve.plan import ConstraintPlan, Plan, RulePlan
from lmpm.resolve.policies import aggregates, quorum, quorum_k
from lmpm.resolve.schedules import Schedule, make_schedule
from lmpm.runtime.data.agree import Agreed, agree
from lmpm.runtime.data.clocks import Clocks, Opened
from lmpm.runtime.data.decide import (
    CellArrays,
    Pending,
    applied_changed,
    blocked_why,
    contributions,
    count_violations,
    newly_set,
    quorum_lost,
    write_cell,
    write_meta,
)
from lmpm.runtime.data.texpr import mask_of
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
    HELD,
    INPUT_RULE,
    NEVER_OPENED,
    NO_SOURCE,
    NOT_FIRED,
    UNKNOWN,
    CellState,
    Dissent,
    ValueEpoch,
)

# note_broken's queue: written once it holds this many records, or this many of their cells
_NOTED = 64
_NOTED_ROWS = 1 << 15


@functools.cache
def _row_dtype(k: int) -> np.dtype:
    """A row of ``k`` bools as one NumPy item (``np.dtype`` of a tuple costs ~20 µs to build)."""
    return np.dtype((np.void, k))


class Workers(Protocol):
    """What an owner needs of the workers beside it: candidates, and writing the winners."""

    worker: str

    def propose(self, req: ProposeRequest) -> ProposeReply: ...
    def apply(self, req: ApplyRequest) -> ApplyReply: ...
    def replica_worker(self, value: str, replica: int) -> str: ...


class Fused(Protocol):
    """A data plane that runs some values' epoch after their models as one fused step
    (``--compile``, :mod:`lmpm.runtime.data.compiled`): it proposes the others as usual."""

    def propose_fused(self, req: ProposeRequest) -> tuple[ProposeReply, list[str], dict[str, Any]]:
        """(the eager values' reply, every proposed value in commit order, the fused values'
        model outputs)."""
        ...

    def step_fused(
        self, owner: Owner, name: str, e: int, part: Any, checksums: bool
    ) -> tuple[ValueEpoch, int, int]:
        """One fused value's epoch: its record, commits and violations."""
        ...

    def quorum_columns(self, name: str) -> Any:
        """A fused quorum value's candidate columns in its last step, as :func:`dissent` reads
        them (None: not a quorum)."""
        ...

    def sync(self, epoch: int) -> bool:
        """Make the fused values' commits of ``epoch`` durable (False: no store to keep them)."""
        ...


@dataclass(frozen=True, slots=True)
class ValueStatic:
    """What the loop needs about one proposed value, built once."""

    rules: tuple[RulePlan, ...]  # the rules proposing the value
    constraints: tuple[ConstraintPlan, ...]  # evaluated at run time (K of them)
    priority: Tensor  # (K,) int64
    constraint_ids: Tensor  # (K,) int64 ids into plan.constraints
    hard: Tensor | None = None  # (K,) bool: `hard` constraints (None: none is)
    levels: tuple[int, ...] = ()  # the K priorities as host values (what the policies read)


def _hard_mask(constraints: list[ConstraintPlan]) -> Tensor | None:
    """(K,) bool: which of a value's live constraints are `hard` (None when none is)."""
    if not any(cp.ir.hard for cp in constraints):
        return None
    return torch.tensor([cp.ir.hard for cp in constraints], dtype=torch.bool)


def pick(table: Tensor, winner: Tensor) -> Tensor:
    """(n,) ``table[i, winner[i]]`` of an (n, C) table: each row's entry in its winning column.
    One row (causal generation) is one flat ``take``, a third of the operations of a gather."""
    if table.shape[0] == 1:
        return table.take(winner)
    return table.gather(1, winner.unsqueeze(1)).squeeze(1)


def dissent(cand: Any, winner: Tensor, changed: Tensor) -> list[tuple[int, int]]:
    """(replica, cells) for every replica whose proposal differed from the committed one in some
    committed cell: compared by checksum with the winning column, among the columns of the same
    rule and proposal slot (one per replica)."""
    if cand.checksum is None:
        return []
    rows = (changed & (winner > 0)).nonzero().squeeze(1)
    if not rows.numel():
        return []
    w = winner.index_select(0, rows)
    sums = cand.checksum.index_select(0, rows)  # (m, C)
    same_col = (cand.col_rule.unsqueeze(0) == cand.col_rule.index_select(0, w).unsqueeze(1)) & (
        cand.col_slot.unsqueeze(0) == cand.col_slot.index_select(0, w).unsqueeze(1)
    )  # (m, C): the winner's rule and slot, one column per replica
    differs = same_col & (sums != sums.gather(1, w.unsqueeze(1)))
    out = []
    for p in cand.col_replica[cand.col_replica >= 0].unique().tolist():
        n = int(differs[:, cand.col_replica == p].any(dim=1).count_nonzero())
        if n:
            out.append((int(p), n))
    return out


def schedule_of(plan: Plan, seed: int) -> Schedule:
    """The plan's schedule over its proposed values."""
    return make_schedule(
        plan.schedule,
        {name: plan.values[name].coords for name in plan.rules_by_target},
        plan.colors,
        int(seed),
    )


def reasons(why: Mapping[str, Tensor], state: Mapping[str, CellState]) -> dict[str, dict[int, int]]:
    """Per value with unset cells: their count by why-code, the most frequent first (a value no
    rule proposes and no input gave: all its cells under NO_SOURCE)."""
    out: dict[str, dict[int, int]] = {}
    for name, codes_of in why.items():
        left = codes_of[~state[name].committed]
        if not left.numel():
            continue
        codes, counts = torch.unique(left, return_counts=True)
        pairs = sorted(zip(codes.tolist(), counts.tolist()), key=lambda x: -x[1])
        out[name] = {int(c): int(n) for c, n in pairs}
    for name, st in state.items():
        if name not in why and st.committed.numel() and not bool(st.committed.any()):
            out[name] = {NO_SOURCE: st.committed.numel()}
    return out


def broken_counts(
    plan: Plan, broken: Mapping[str, Tensor], state: Mapping[str, CellState]
) -> dict[str, dict[int, int]]:
    """Per value, committed cells whose payload violates a live constraint, by constraint id (as
    of the last time each cell was open; the most frequent first)."""
    out: dict[str, dict[int, int]] = {}
    for name, bits in broken.items():
        counts = (bits & state[name].committed.unsqueeze(1)).sum(dim=0).tolist()  # (K,)
        ids = [cp.id for cp in plan.live_constraints.get(name, [])]
        got = sorted(((cid, int(c)) for cid, c in zip(ids, counts) if c), key=lambda x: -x[1])
        if got:
            out[name] = dict(got)
    return out


class Owner:
    """The cells' metadata and the decisions on them (see the module doc).

    ``state``: per value, committed flags, clocks, provenance and scores; ``why``: per proposed
    value, why each unset cell is unset (a constraint id, or a code of :mod:`lmpm.runtime.records`).
    """

    def __init__(self, plan: Plan, seed: int = 0) -> None:
        self.plan = plan
        self.state: dict[str, CellState] = {
            name: CellState.empty(vp.ncells) for name, vp in plan.values.items()
        }
        by_target = plan.rules_by_target
        live = plan.live_constraints
        self.static = {
            name: ValueStatic(
                tuple(rules),
                tuple(live.get(name, [])),
                torch.tensor([cp.priority for cp in live.get(name, [])], dtype=torch.int64),
                torch.tensor([cp.id for cp in live.get(name, [])], dtype=torch.int64),
                _hard_mask(live.get(name, [])),
                tuple(cp.priority for cp in live.get(name, [])),
            )
            for name, rules in by_target.items()
        }
        self.schedule = schedule_of(plan, seed)
        self.fresh = {name: not self.schedule.opens_committed for name in by_target}
        self.triggered = {rp.id: rp.trigger != TRUE for rp in plan.rules}
        # values with a rule whose `when` guard picks cells: their open cells vary within a phase
        self.guarded = {
            name: any(self.triggered[rp.id] for rp in st.rules) for name, st in self.static.items()
        }
        # values committed by quorum (not aggregated): their outvoted replicas are recorded
        self.quorum = {
            name: plan.values[name].policy is quorum
            and not aggregates(plan.values[name].policy, plan.values[name].policy_args)
            for name in self.static
        }
        self.clocks = Clocks(plan.rules)
        self.why = {
            name: torch.full((plan.values[name].ncells,), NEVER_OPENED) for name in by_target
        }
        self.compiled: Any = None  # the CompiledEpoch of a fused data plane (--compile)
        # built once for the epoch's skeleton (one open cell costs a few dozen calls): the rules as
        # (rule, target, triggered), each value's quorum votes (None: no quorum) and whether one
        # rule proposes it, and whether the values come in name order (the report's `opened`)
        self._rules = tuple((rp, rp.target, self.triggered[rp.id]) for rp in plan.rules)
        self._quorum_k = {
            name: quorum_k(plan.values[name].policy, plan.values[name].policy_args)
            for name in self.static
        }
        self._single = {name: len(st.rules) == 1 for name, st in self.static.items()}
        self._in_order = list(self.static) == sorted(self.static)
        # per value: bumped when its state changes other than by a fused step on a device
        # (settle), so that the device's mirror of it (lmpm.runtime.data.captured) copies it again
        self.version = dict.fromkeys(self.state, 0)
        # per value, its unset cells: kept up to date by every commit (the report's summary)
        self._unset = {name: self._count_unset(name) for name in self.state}
        self._active: frozenset[int] | None = None
        self._active_mask: dict[str, Tensor] = {}
        # per count n of open cells: (kept score, was committed, own clock) of n unset cells
        self._unset_rows: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        # per proposed value with live constraints: (ncells, K) bool, the constraints each
        # committed cell's payload violated the last time the cell was open (the stop summary)
        self.broken = {
            name: torch.zeros((plan.values[name].ncells, len(st.constraints)), dtype=torch.bool)
            for name, st in self.static.items()
            if st.constraints
        }
        self._noted: list[ValueEpoch] = []  # records note_broken has not written yet
        self._noted_rows = 0  # their cells
        self._broken_np: dict[str, np.ndarray] = {}  # NumPy views of :attr:`broken` (_broken_rows)
        self._arrays: dict[str, tuple[CellState, CellArrays]] = {}  # see arrays()

    # ---- metadata outside the epoch ---------------------------------------------------------------
    def mark_input(self, value: str, cells: Tensor) -> None:
        """Record ``cells`` of ``value`` as committed from an input (provenance INPUT, clock 1)."""
        st = self.state[value]
        idx = cells.nonzero().squeeze(1) if cells.dtype == torch.bool else cells
        clock = st.clock.index_select(0, idx).clamp_min(1)
        write_meta(st, idx, clock, INPUT_RULE, st.epoch.index_select(0, idx), 0.0)
        self._unset[value] = self._count_unset(value)
        self.version[value] += 1

    def restore(self, value: str, state: CellState) -> None:
        """Load a checkpointed value's metadata (resume)."""
        self.state[value] = state
        self._unset[value] = self._count_unset(value)
        self.version[value] += 1
        if value in self.why:
            self.why[value] = torch.where(state.committed, NEVER_OPENED, UNKNOWN)

    def arrays(self, name: str) -> CellArrays:
        """numpy views of ``name``'s (host) metadata, made once per :class:`CellState`: one open
        cell's commit reads and writes them without tensor operations."""
        st = self.state[name]
        hit = self._arrays.get(name)
        if hit is None or hit[0] is not st:
            hit = self._arrays[name] = (st, CellArrays.of(st))
        return hit[1]

    def unset(self) -> dict[str, int]:
        """Per value: how many of its cells are unset."""
        return dict(self._unset)

    def _count_unset(self, name: str) -> int:
        committed = self.state[name].committed
        return int(committed.numel() - committed.count_nonzero())

    def reasons(self) -> dict[str, dict[int, int]]:
        """Per value with unset cells: their count by why-code, the most frequent first."""
        return reasons(self.why, self.state)

    def get_broken(self) -> dict[str, Tensor]:
        """Per proposed value with live constraints: (ncells, K) bool, :attr:`broken` up to date."""
        self._write_broken()
        return self.broken

    def broken_counts(self) -> dict[str, dict[int, int]]:
        """Per value, committed cells that violate a live constraint, by constraint id."""
        return broken_counts(self.plan, self.get_broken(), self.state)

    def note_broken(self, ve: ValueEpoch, n: int | None = None) -> None:
        """Record which live constraints the payload of each open cell of ``ve`` violates after
        the epoch: the winner's verdicts where it committed, keep-current's where the cell kept
        its payload (a constraint not in the RuleSet, or not speaking about the cell, is violated
        by nothing). The records wait in a queue, written together (:meth:`_write_broken`) before
        anything reads :attr:`broken` through :meth:`get_broken`, or once the queue holds
        ``_NOTED`` records or ``_NOTED_ROWS`` cells: nothing reads :attr:`broken` between epochs,
        and an epoch's few operations cost tens of µs each right after a model has run (cold
        caches) against a few µs in the write's loop. A record on a device is written at once
        (a captured step's outputs are its graph's buffers). ``n``: the record's number of cells,
        where the caller knows it."""
        if n is None:
            n = ve.cells.shape[0]
        if not n or ve.value not in self.broken:
            return
        self._noted.append(ve)
        self._noted_rows += n
        if (
            len(self._noted) >= _NOTED
            or self._noted_rows >= _NOTED_ROWS
            or (n > 1 and ve.violated.device.type != "cpu")
        ):
            self._write_broken()

    def _write_broken(self) -> None:
        """Write the queued records into :attr:`broken`, each value's in epoch order (values are
        independent): a record of many cells on its own (:meth:`_broken_rows`), a run of one-cell
        records with one table shape at once (:meth:`_broken_run`)."""
        noted, self._noted, self._noted_rows = self._noted, [], 0
        by_value: dict[str, list[ValueEpoch]] = {}
        for ve in noted:
            by_value.setdefault(ve.value, []).append(ve)
        for name, records in by_value.items():
            i, total = 0, len(records)
            while i < total:
                first = records[i]
                if first.cells.shape[0] > 1:
                    self._broken_rows(name, first)
                    i += 1
                    continue
                shape = first.violated.shape[1:]
                j = i + 1
                while (
                    j < total
                    and records[j].cells.shape[0] == 1
                    and records[j].violated.shape[1:] == shape
                ):
                    j += 1
                self._broken_run(name, records[i:j])
                i = j

    def _broken_run(self, name: str, run: list[ValueEpoch]) -> None:
        """:meth:`_write_broken` of one value's records with one table shape, in epoch order, in
        torch (a device's record, or a run of one-cell records: a handful of operations for all)."""
        if len(run) > 1:
            cells = torch.cat([ve.cells for ve in run]).cpu()
            violated = torch.cat([ve.violated for ve in run]).cpu()
            winner = torch.cat([ve.winner for ve in run]).cpu()
            changed = torch.cat([ve.changed for ve in run]).cpu()
            was = torch.cat([ve.was_committed for ve in run]).cpu()
        else:
            (ve,) = run
            cells, violated, winner = ve.cells.cpu(), ve.violated.cpu(), ve.winner.cpu()
            changed, was = ve.changed.cpu(), ve.was_committed.cpu()
        m = cells.numel()
        if len(run) > 1:  # the last row of each cell (index_put_ keeps no order among equals)
            order = torch.sort(cells, stable=True).indices
            ranked = cells.index_select(0, order)
            last = torch.ones(m, dtype=torch.bool)
            last[:-1] = ranked[1:] != ranked[:-1]
            rows = order[last]
            cells, violated, winner, changed, was = (
                t.index_select(0, rows) for t in (cells, violated, winner, changed, was)
            )
            m = cells.numel()
        now = violated[torch.arange(m), torch.where(changed, winner, 0)]  # (m, K)
        self.broken[name].index_put_((cells,), now & (changed | was).unsqueeze(1))

    def _broken_rows(self, name: str, ve: ValueEpoch) -> None:
        """:meth:`_write_broken` of one record of many (unique) cells, a wide epoch's, in NumPy, a
        row of K verdicts moved as one K-byte item: the winner's row of each cell taken from the
        flat (n * C, K) table, then written to the cells' rows of :attr:`broken` (a video epoch's
        2048 cells: ~120 µs of torch indexing → ~30 µs)."""
        bits = self._broken_np.get(name)
        if bits is None:
            bits = self._broken_np[name] = self.broken[name].numpy()
        n, c, k = ve.violated.shape
        row = _row_dtype(k)
        # (a captured step's record: its tables on the device, its cells on the host)
        changed = ve.changed.cpu().numpy()
        keep = changed | ve.was_committed.cpu().numpy()
        table = np.ascontiguousarray(ve.violated.cpu().numpy()).view(row).reshape(n * c)
        now = table.take(np.arange(0, n * c, c) + np.where(changed, ve.winner.cpu().numpy(), 0))
        dst, cells = bits.view(row).reshape(-1), ve.cells.cpu().numpy()
        if keep.all():
            dst[cells] = now
        else:  # a cell neither committed before nor now violates nothing
            dst[cells[keep]] = now[keep]
            dst[cells[~keep]] = np.zeros((), row)

    # ---- the epoch ---------------------------------------------------------------------------------
    def open_cells(self, e: int, skip: int, start: int) -> dict[str, Tensor]:
        """(n,) int64 per proposed value: the cells open in epoch ``e``, sorted and unique. The
        schedules that open a few unset cells pass over the ``skip`` cells tried since epoch
        ``start`` (the last commit)."""
        return {
            name: self.schedule.open_cells(name, self.state[name].committed, e, skip, start)
            for name in self.static
        }

    def _open(
        self, e: int, skip: int, start: int
    ) -> tuple[
        dict[str, Tensor], dict[str, int], tuple[tuple[str, int], ...], dict[str, int | None]
    ]:
        """:meth:`open_cells` with what the epoch needs of them: the cells per value, their
        counts, (value, count) in name order (the report's), and the schedule's phase per value
        (None: the open cells vary within a phase)."""
        schedule = self.schedule
        phased = schedule.phased
        open_: dict[str, Tensor] = {}
        counts: dict[str, int] = {}
        phases: dict[str, int | None] = {}
        opened: tuple[tuple[str, int], ...] = ()
        for name in self.static:
            cells = open_[name] = schedule.open_cells(
                name, self.state[name].committed, e, skip, start
            )
            n = counts[name] = cells.shape[0]
            opened += ((name, n),)
            phases[name] = schedule.phase(name, e) if phased and not self.guarded[name] else None
        return open_, counts, opened if self._in_order else tuple(sorted(opened)), phases

    def work(
        self, e: int, open_: Mapping[str, Tensor], counts: Mapping[str, int] | None = None
    ) -> tuple[RuleWork, ...]:
        """The plan of work: the cells each rule fires on in epoch ``e`` (``counts``: the number
        of open cells per value, where the caller has them)."""
        work: tuple[RuleWork, ...] = ()
        for rp, target, triggered in self._rules:
            if target not in open_:
                continue
            cells = open_[target]
            if triggered:
                vp = self.plan.values[rp.target]
                env: dict[str, Any] = dict(self.plan.env)
                env["e"] = e
                env.update({v: vp.coords[:, k] for k, v in enumerate(rp.ir.vars)})
                fire = torch.zeros(vp.ncells, dtype=torch.bool)
                fire[cells] = True
                cells = (fire & mask_of(rp.trigger, env, vp.ncells)).nonzero().squeeze(1)
            elif counts is not None:
                if counts[target]:
                    work += (RuleWork(rp.id, cells),)
                continue
            if cells.shape[0]:
                work += (RuleWork(rp.id, cells),)
        return work

    def set_active(self, active: frozenset[int] | None) -> None:
        if active != self._active:
            self._active = active
            self._active_mask = {}

    def active_mask(self, name: str, device: torch.device) -> Tensor:
        """(K,) bool: which of ``name``'s live constraints are in the RuleSet (fused steps)."""
        mask = self._active_mask.get(name)
        if mask is None:
            ids = self.static[name].constraint_ids.tolist()
            on = [self._active is None or i in self._active for i in ids]
            mask = self._active_mask[name] = torch.tensor(on, dtype=torch.bool, device=device)
        return mask

    def epoch(self, workers: Workers, req: EpochRequest, fused: Fused | None = None) -> EpochReport:
        """Run epoch ``req.epoch`` on ``workers``: open, propose, check, agree, apply, commit.
        ``fused``: the data plane that runs the compiled values' steps (``--compile``)."""
        e = req.epoch
        if req.active != self._active:
            self.set_active(req.active)
        open_, counts, opened, phases = self._open(e, req.skip, req.start)
        work = self.work(e, open_, counts)
        preq = ProposeRequest(e, work, self.fresh, req.record, phases, req.active)
        parts: dict[str, Any] = {}
        order: Iterable[str]  # the proposed values in commit order
        if fused is not None:
            reply, order, parts = fused.propose_fused(preq)
        else:
            reply = workers.propose(preq)
            order = reply.values
        self._not_fired(open_, reply, parts, counts)
        pending: dict[str, Pending] = {}
        decisions: dict[str, ValueDecision] = {}
        for name in reply.values:
            p = pending[name] = self._agree(name, e, reply.values[name])
            decisions[name] = p.decision()
        if pending or not parts:
            applied = workers.apply(ApplyRequest(e, decisions, req.checksums))
        else:
            applied = ApplyReply(workers.worker, {}, False)
        commits = violations = attempts = 0
        values: list[ValueEpoch] = []
        dissents: tuple[Dissent, ...] = ()
        for name in order:  # the order eager commits in: a value's clocks read the ones before
            if name in parts:
                assert fused is not None
                ve, n_commits, n_viol = fused.step_fused(self, name, e, parts[name], req.checksums)
                self.note_broken(ve)
                cand = fused.quorum_columns(name) if self.quorum[name] else None
            else:
                p = pending[name]
                ve, n_commits = self._commit(name, e, p, applied.values[name], phases[name])
                cand = p.cand if self.quorum[name] else None
                n_viol = count_violations(p.cand.violated)
            if cand is not None:
                dissents += self._dissents(workers, name, cand, ve)
            values.append(ve)
            if n_commits:  # the cells set for the first time (fresh: every committing cell)
                self._unset[name] -= n_commits if self.fresh[name] else newly_set(ve)
            commits += n_commits
            attempts += ve.cells.shape[0]
            violations += n_viol
        durable = not pending or applied.durable
        if parts and fused is not None:
            durable = fused.sync(e) and durable
        return EpochReport(
            e,
            workers.worker,
            opened,
            commits,
            attempts,
            violations,
            reply.model_seconds,
            dict(self._unset),
            dissents,
            values,
            durable=durable or not commits,
        )

    @staticmethod
    def _dissents(workers: Workers, name: str, cand: Any, ve: ValueEpoch) -> tuple[Dissent, ...]:
        """The replicas of a quorum value whose proposals the commits of ``ve`` outvoted."""
        return tuple(
            Dissent(name, rep, workers.replica_worker(name, rep), n)
            for rep, n in dissent(cand, ve.winner, ve.changed)
        )

    def _not_fired(
        self,
        open_: Mapping[str, Tensor],
        reply: ProposeReply,
        parts: Mapping[str, Any],
        counts: Mapping[str, int] | None = None,
    ) -> None:
        """Mark the open cells no rule fired on (the proposed ones that stay unset are refined by
        _blocked; cells that commit need no reason). ``counts``: the open cells per value, where
        the caller has them."""
        proposed = reply.values
        for name in open_:
            cells = open_[name]
            if name in parts:
                seen = parts[name][1]
            else:
                seen = proposed[name].cells if name in proposed else None
            n = cells.shape[0] if counts is None else counts[name]
            if seen is None or seen.shape[0] != n:
                self.why[name].index_fill_(0, cells, NOT_FIRED)

    def _agree(self, name: str, e: int, cand: Candidates) -> Pending:
        """Agree on one value's candidates; record why the cells that stay unset do."""
        quota = self.quota(name, e) if self.schedule.has_quota else None
        ag, was = self._policy(name, e, cand, quota)
        return self._pending(name, cand, ag, was, quota)

    def quota(self, name: str, e: int) -> int | None:
        """How many more cells of ``name`` may commit in epoch ``e`` (a schedule's quota: a share
        of the cells to generate, inputs not counted), or None."""
        if not self.schedule.has_quota:
            return None
        vp = self.plan.values[name]
        st = self.state[name]
        given = int((st.rule == INPUT_RULE).count_nonzero())
        return self.schedule.quota(e, vp.ncells - given, int(st.committed.count_nonzero()) - given)

    def _policy(
        self, name: str, e: int, cand: Candidates, quota: int | None
    ) -> tuple[Agreed, Tensor]:
        """The value's policy on its candidates (at most ``quota`` commits): the agreement and
        which open cells were committed before."""
        st = self.state[name]
        static = self.static[name]
        cells = cand.cells
        if self.fresh[name]:  # every open cell is unset (never written: see _unset_meta)
            n = cells.shape[0]
            kept, was, _ = self._unset_rows.get(n) or self._unset_meta(n)
        else:
            kept = st.score.index_select(0, cells)
            was = st.committed.index_select(0, cells)
        vp = self.plan.values[name]
        ag = agree(vp, cand, kept, static.levels, quota, self.fresh[name], static.hard)
        return ag, was

    def _pending(
        self, name: str, cand: Candidates, ag: Agreed, was: Tensor, quota: int | None
    ) -> Pending:
        """The agreed value waiting for its apply; why the cells that stay unset do."""
        n = cand.cells.shape[0]
        # (one open cell, causal generation: its flag itself, one read instead of a count and one)
        commits = int(ag.changed) if n == 1 else int(ag.changed.count_nonzero())
        k = self._quorum_k[name]  # under a quorum: the cells where no payload had its k votes
        disagreed = None if k is None else quorum_lost(cand, k)
        if commits < n:  # why the cells that stay unset do (nothing to do when all commit)
            unset = (~ag.changed & ~was).nonzero().squeeze(1)
            self._blocked(name, cand, self.static[name], unset, disagreed)
            if quota is not None:
                self._held(name, cand.cells, ag.winner, ag.changed, was)
        rows = None if commits == n else ag.changed.nonzero().squeeze(1)
        return Pending(
            cand, ag.score, ag.winner, ag.changed, ag.weights, rows, was, commits, disagreed
        )

    def _blocked(
        self,
        name: str,
        cand: Any,
        static: ValueStatic,
        rows: Tensor,
        disagreed: Tensor | None = None,
    ) -> None:
        """Record why the proposed cells at ``rows`` stay unset (:func:`blocked_why`)."""
        if not rows.numel():
            return
        why = blocked_why(
            cand.valid.index_select(0, rows),
            cand.violated.index_select(0, rows),
            static.priority,
            static.constraint_ids,
            None if disagreed is None else disagreed.index_select(0, rows),
        )
        self.why[name].index_put_((cand.cells.index_select(0, rows),), why)

    def _commit(
        self, name: str, e: int, p: Pending, got: Applied, phase: int | None
    ) -> tuple[ValueEpoch, int]:
        """Advance clocks and provenance of the committing cells; the value's record and its
        number of commits. ``got``: what the workers wrote (an aggregate equal to the committed
        payload is no commit); ``phase``: the schedule's phase of the open cells (None: they
        vary)."""
        changed, commits, rows = applied_changed(p, got)
        cand = p.cand
        st = self.state[name]
        cells = cand.cells
        fresh = self.fresh[name]
        n = cells.shape[0]
        if fresh:
            own = (self._unset_rows.get(n) or self._unset_meta(n))[2]
        else:
            own = st.clock.index_select(0, cells)
        new_clock = own
        if commits == 1 and n == 1 and self._single[name]:  # causal generation's commit
            new_clock = self._write_one(name, e, p, int(cells), 0 if fresh else int(own))
        elif commits:
            new_clock = self._write(name, e, p, own, changed, commits, rows, phase)
        ve = ValueEpoch(
            name,
            cells,
            cand.valid,
            p.score,
            cand.col_rule,
            cand.violated,
            self.static[name].constraint_ids,
            p.winner,
            changed,
            new_clock,
            p.was,
            cand.applies,
            disagreed=p.disagreed,
        )
        if got.checksum is not None:  # one per committed row, in row order
            sums = torch.zeros(n, dtype=torch.int64)
            sums[changed] = got.checksum
            ve.checksum = sums
        self.note_broken(ve, n)
        return ve, commits

    def _write(
        self,
        name: str,
        e: int,
        p: Pending,
        own: Tensor,
        changed: Tensor,
        commits: int,
        rows: Tensor | None,
        phase: int | None,
    ) -> Tensor:
        """Advance the committing cells' clocks and write their metadata; (n,) the new clocks."""
        static = self.static[name]
        cells = p.cand.cells
        contributed, won_rule = contributions(static.rules, p.cand, p.winner, p.weights)
        opened = Opened(own, cells, phase, self.fresh[name])
        new_clock = self.clocks.advance(
            self.state, static.rules, opened, changed, commits, contributed
        )
        fields = [cells, new_clock, pick(p.score, p.winner)]
        if won_rule is not None:
            fields.append(won_rule)
        if commits < cells.numel():
            keep = rows if rows is not None else changed.nonzero().squeeze(1)
            fields = [t.index_select(0, keep) for t in fields]
        idx, clock, won, *rule = fields
        # one rule: every committing column is that rule's
        write_meta(self.state[name], idx, clock, rule[0] if rule else static.rules[0].id, e, won)
        self.version[name] += 1
        return new_clock

    def _write_one(self, name: str, e: int, p: Pending, c: int, own: int) -> Tensor:
        """:meth:`_write` of one committing cell ``c`` of a one-rule value (causal generation):
        the same clock and metadata, read and written as numpy scalars; (1,) its new clock."""
        (rp,) = self.static[name].rules
        clock = self.clocks.advance_one(self.state, rp, c, own)
        score = float(p.score.take(p.winner))  # the winner's (policy's) score
        hit = self._arrays.get(name)  # (arrays(), looked up here: no call)
        views = hit[1] if hit is not None and hit[0] is self.state[name] else self.arrays(name)
        write_cell(views, c, clock, rp.id, e, score)
        self.version[name] += 1
        return torch.from_numpy(np.array([clock], dtype=np.int64))

    def settle(self, name: str, e: int, rule: int | Tensor, ve: ValueEpoch) -> None:
        """Apply a step that ran on the device (the captured step on CUDA, which wrote the
        device's mirror of this state) to the host state: its commits (``rule``: their
        provenance, one id or one per commit), and why the cells it left unset stay unset."""
        changed = ve.changed
        won = pick(ve.score, ve.winner)[changed]
        write_meta(self.state[name], ve.cells[changed], ve.new_clock[changed], rule, e, won)
        unset = (~changed & ~ve.was_committed).nonzero()[:, 0]
        self._blocked(name, ve, self.static[name], unset, ve.disagreed)
        if self.schedule.has_quota:
            self._held(name, ve.cells, ve.winner, changed, ve.was_committed)

    def _held(self, name: str, cells: Tensor, winner: Tensor, changed: Tensor, was: Tensor) -> None:
        """Record the winners a schedule's quota held back (why-code HELD, not "no candidate")."""
        held = (winner != 0) & ~changed & ~was
        self.why[name].index_put_((cells[held],), torch.full_like(cells[held], HELD))

    def _unset_meta(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """The metadata of n unset cells, made once per n: (n,) float64 kept score -inf, (n,) bool
        was committed False, (n,) int64 own clock 0. Only ever read (records and agreement copy
        from them; no user code receives them)."""
        hit = self._unset_rows.get(n)
        if hit is None:
            hit = self._unset_rows[n] = (
                torch.full((n,), -torch.inf, dtype=torch.float64),
                torch.zeros(n, dtype=torch.bool),
                torch.zeros(n, dtype=torch.int64),
            )
        return hit
