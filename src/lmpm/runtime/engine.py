"""The control plane's epoch loop: compute → propose → check → agree → commit, on metadata only.

The engine decides *what* happens in an epoch and records it; the data plane
(:class:`~lmpm.runtime.dataplane.DataPlane`, the worker that holds the payload) does the work. Per
epoch the engine

1. asks its schedule (:mod:`lmpm.resolve.schedules`) for the open cells and evaluates each rule's
   trigger on them (a MaskPlan event records the open set);
2. sends the plan of work to the worker (:class:`~lmpm.runtime.protocol.ProposeRequest`) and gets
   back, per value and open cell, each candidate's score, validity and constraint verdicts;
3. agrees (:func:`lmpm.runtime.agree.agree`: the value's commit policy, the schedule's quota);
4. tells the worker which rows commit (:class:`~lmpm.runtime.protocol.ApplyRequest`); the worker
   writes them and makes them durable, then the engine advances Lamport clocks
   (:mod:`lmpm.runtime.clocks`) and provenance, and hands the epoch's record to its observers
   (commit log, trace), which mark the epoch durable last.

The engine never holds a payload tensor: its state is committed flags, clocks, provenance and
scores (:class:`CellState`), and every message it exchanges with the worker is metadata (run with
``guard=True`` to check this at every message, see :mod:`lmpm.runtime.guard`). Reads see the state
at the start of the epoch and winners are applied together at its end, so an epoch's result does not
depend on the order in which work ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lmpm.errors import InputError
from lmpm.ir.nodes import TRUE
from lmpm.resolve.plan import (
    ConstraintPlan,
    Plan,
    RulePlan,
    live_constraints,
    needs_input,
    rules_by_target,
)
from lmpm.resolve.schedules import make_schedule
from lmpm.runtime.agree import agree
from lmpm.runtime.clocks import Clocks
from lmpm.runtime.crdt import ORSet
from lmpm.runtime.dataplane import DataPlane
from lmpm.runtime.protocol import (
    ApplyReply,
    ApplyRequest,
    ProposeReply,
    ProposeRequest,
    RuleWork,
    ValueDecision,
)
from lmpm.runtime.texpr import mask_of

INPUT_RULE = -2  # provenance of cells committed from an input file
NO_RULE = -1

# Policies that compare candidates' payloads (by checksum): the worker computes checksums for them.
CHECKSUM_POLICIES = frozenset(("quorum",))


@dataclass
class CellState:
    """Metadata of one value's cells (the payload itself lives on the data plane)."""

    committed: Tensor  # (N,) bool
    clock: Tensor  # (N,) int64 Lamport clock
    rule: Tensor  # (N,) int64 provenance: rule id, INPUT_RULE, or NO_RULE
    epoch: Tensor  # (N,) int64 provenance: epoch of the last commit (-1: never / input)
    score: Tensor  # (N,) float64 score of the committed candidate (-inf when unset)

    @staticmethod
    def empty(n: int) -> CellState:
        return CellState(
            torch.zeros(n, dtype=torch.bool),
            torch.zeros(n, dtype=torch.int64),
            torch.full((n,), NO_RULE, dtype=torch.int64),
            torch.full((n,), -1, dtype=torch.int64),
            torch.full((n,), -torch.inf, dtype=torch.float64),
        )


@dataclass
class ValueEpoch:
    """What happened to one value in one epoch (metadata, handed to observers: log, trace)."""

    value: str
    cells: Tensor  # (n,) open cells that had candidates
    valid: Tensor  # (n, C)
    score: Tensor  # (n, C)
    col_rule: Tensor  # (C,) rule id per column (-1 keep)
    violated: Tensor  # (n, C, K)
    constraint_ids: Tensor  # (K,) ids into plan.constraints
    winner: Tensor  # (n,) chosen column
    changed: Tensor  # (n,) bool: the winner changes the cell (a commit)
    new_clock: Tensor  # (n,)
    was_committed: Tensor  # (n,) bool, before this epoch
    applies: Tensor  # (n, K) bool: the constraint speaks about the cell (its verdicts count)
    checksum: Tensor | None = None  # (n,) int64 committed payload checksum where changed


@dataclass
class EpochRecord:
    epoch: int
    values: list[ValueEpoch]
    open_cells: int
    commits: int
    attempts: int
    violations: int
    seconds: float
    model_seconds: float
    message_bytes: int = 0  # tensor bytes exchanged with the workers (metadata only)
    halo_bytes: int = 0  # payload bytes moved worker to worker (partitioned workers; 0 for one)


class Observer(Protocol):
    def on_start(self, engine: Engine) -> None: ...
    def on_epoch(self, engine: Engine, record: EpochRecord) -> None: ...
    def on_end(self, engine: Engine) -> None: ...


@dataclass
class RunResult:
    epochs: int
    stable: bool
    commits: int
    attempts: int
    seconds: float
    model_seconds: float
    records: list[EpochRecord] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _ValueStatic:
    """What the loop needs about one proposed value, built once."""

    rules: tuple[RulePlan, ...]  # the rules proposing the value
    constraints: tuple[ConstraintPlan, ...]  # evaluated at run time (K of them)
    priority: Tensor  # (K,) int64
    constraint_ids: Tensor  # (K,) int64 ids into plan.constraints


class Engine:
    """Runs a :class:`~lmpm.resolve.plan.Plan` epoch by epoch: the control plane over one worker.

    ``dataplane``: the worker holding the payload (made on ``backend`` when not given).
    ``checksums``: ask the worker for committed rows' checksums (the commit log stores them).
    ``guard``: check every message for payload tensors (slow; tests).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        backend: str | Any = "cpu",
        seed: int = 0,
        observers: Sequence[Observer] = (),
        keep_records: bool = False,
        dataplane: DataPlane | None = None,
        guard: bool = False,
    ) -> None:
        self.plan = plan
        self.seed = int(seed)
        self.guard = guard
        if dataplane is None:
            from lmpm.runtime.guard import GuardedDataPlane

            cls = GuardedDataPlane if guard else DataPlane
            dataplane = cls(
                plan, backend=backend, seed=self.seed, checksum_policies=CHECKSUM_POLICIES
            )
        self.dataplane = dataplane
        self.observers = list(observers)
        self.keep_records = keep_records
        self.checksums = False  # set by observers that log checksums
        self.epoch = 0  # the next epoch to run
        self.state: dict[str, CellState] = {
            name: CellState.empty(vp.ncells) for name, vp in plan.values.items()
        }
        self.maskplan = ORSet("control")
        self.record: dict[str, Tensor] | None = None  # cells whose candidates the worker records
        by_target = rules_by_target(plan)
        live = live_constraints(plan)
        self._static = {
            name: _ValueStatic(
                tuple(rules),
                tuple(live.get(name, [])),
                torch.tensor([cp.priority for cp in live.get(name, [])], dtype=torch.int64),
                torch.tensor([cp.id for cp in live.get(name, [])], dtype=torch.int64),
            )
            for name, rules in by_target.items()
        }
        self.schedule = make_schedule(
            plan.schedule,
            {name: plan.values[name].coords for name in by_target},
            plan.colors,
            self.seed,
        )
        self._fresh = {name: not self.schedule.opens_committed for name in by_target}
        self._triggered = {rp.id: rp.trigger != TRUE for rp in plan.rules}
        # values with a rule whose `when` guard picks cells: their open cells vary within a phase
        self._guarded = {
            name: any(self._triggered[rp.id] for rp in st.rules)
            for name, st in self._static.items()
        }
        self._clocks = Clocks(plan.rules)
        self._started = False
        self._consts: dict[tuple[str, int, torch.dtype], Tensor] = {}

    # ---- state -----------------------------------------------------------------------------------
    def mark_input(self, value: str, cells: Tensor) -> None:
        """Record ``cells`` of ``value`` as committed from an input (provenance INPUT, clock 1).
        The payload went to the data plane (:meth:`DataPlane.set_input`)."""
        st = self.state[value]
        st.committed[cells] = True
        st.clock[cells] = torch.maximum(st.clock[cells], torch.ones_like(st.clock[cells]))
        st.rule[cells] = INPUT_RULE
        st.score[cells] = 0.0

    def restore(self, value: str, state: CellState) -> None:
        """Load a checkpointed value's metadata (resume)."""
        self.state[value] = state

    # ---- the loop --------------------------------------------------------------------------------
    def _validate_sources(self) -> None:
        for source, rules in needs_input(self.plan).items():
            if not bool(self.state[source].committed.any()):
                raise InputError(
                    f"rule `{rules[0]}` reads `{source}`, but `{source}` has no committed cell: no input "
                    "was given and no rule proposes it",
                    where={"rule": rules[0], "value": source},
                    code="R020",
                    hint=f"give --input {source}=FILE, or mark the read optional (`{source}?`)",
                )

    def run(
        self,
        epochs: int | None = None,
        *,
        until_stable: bool = False,
        max_epochs: int = 10_000,
        progress: Callable[[EpochRecord], None] | None = None,
        quiet: int = 0,
    ) -> RunResult:
        """Run epochs until ``epochs`` have run in total (counting resumed ones), or until an epoch
        commits nothing (``until_stable``), or until every cell is committed and an epoch is stable.

        ``quiet``: consecutive epochs without a commit at the end of the run so far (a resumed run
        restores it from the commit log, so it stops exactly where an uninterrupted run would)."""
        if not self._started:
            self._validate_sources()
            for o in self.observers:
                o.on_start(self)
            self._started = True
        limit = epochs if epochs is not None else max_epochs
        res = RunResult(0, False, 0, 0, 0.0, 0.0)
        period = self.stable_period()
        t0 = time.perf_counter()
        with torch.inference_mode():  # as in step(), entered once for the whole loop
            self._loop(res, limit, epochs is None or until_stable, period, quiet, progress)
        res.seconds = time.perf_counter() - t0
        for o in self.observers:
            o.on_end(self)
        return res

    def _loop(
        self,
        res: RunResult,
        limit: int,
        stop_when_stable: bool,
        period: int,
        quiet: int,
        progress: Callable[[EpochRecord], None] | None,
    ) -> None:
        while self.epoch < limit:
            if quiet >= period and stop_when_stable:
                res.stable = True  # a resumed run that had already become stable
                break
            rec = self._step()
            res.epochs += 1
            res.commits += rec.commits
            res.attempts += rec.attempts
            res.model_seconds += rec.model_seconds
            if self.keep_records:
                res.records.append(rec)
            if progress is not None:
                progress(rec)
            quiet = quiet + 1 if rec.commits == 0 else 0
            if quiet >= period and stop_when_stable:
                res.stable = True
                break

    def stable_period(self) -> int:
        """Epochs without a commit that prove stability: one full cycle of the schedule."""
        return self.schedule.period

    def open_cells(self, e: int) -> dict[str, Tensor]:
        """(n,) int64 per proposed value: the cells open in epoch ``e``, sorted and unique."""
        return {
            name: self.schedule.open_cells(name, self.state[name].committed, e)
            for name in self._static
        }

    def step(self) -> EpochRecord:
        """One epoch. Nothing is committed unless every part of the epoch succeeded."""
        # No autograd anywhere in an epoch: inference mode skips its per-op bookkeeping.
        with torch.inference_mode():
            return self._step()

    def _step(self) -> EpochRecord:
        if not self.guard:
            return self._epoch()
        from lmpm.runtime.guard import check_message

        dp: Any = self.dataplane
        dp.busy = True
        try:
            rec = self._epoch()
            check_message(rec, "epoch record")
            check_message(self.state, "engine state")
            return rec
        finally:
            dp.busy = False

    def _work(self, e: int, open_: dict[str, Tensor]) -> tuple[RuleWork, ...]:
        """The plan of work: the cells each rule fires on in epoch ``e``."""
        work: list[RuleWork] = []
        for rp in self.plan.rules:
            cells = open_.get(rp.target)
            if cells is None:
                continue
            if self._triggered[rp.id]:
                vp = self.plan.values[rp.target]
                env: dict[str, Any] = dict(self.plan.env)
                env["e"] = e
                env.update({v: vp.coords[:, k] for k, v in enumerate(rp.ir.vars)})
                fire = torch.zeros(vp.ncells, dtype=torch.bool)
                fire[cells] = True
                cells = (fire & mask_of(rp.trigger, env, vp.ncells)).nonzero().squeeze(1)
            if cells.numel():
                work.append(RuleWork(rp.id, cells))
        return tuple(work)

    def _epoch(self) -> EpochRecord:
        e = self.epoch
        t0 = time.perf_counter()
        open_ = self.open_cells(e)
        self.maskplan.add(("open", e, tuple(sorted((k, v.numel()) for k, v in open_.items()))))
        phases = {
            name: None if self._guarded[name] else self.schedule.phase(name, e) for name in open_
        }
        req = ProposeRequest(e, self._work(e, open_), self._fresh, self.record, phases)
        reply: ProposeReply = self.dataplane.propose(req)
        if self.guard:
            from lmpm.runtime.guard import check_message

            check_message(req, "propose request")
            check_message(reply, "propose reply")

        # agree per value; the worker applies all values together at the boundary.
        decisions: dict[str, ValueDecision] = {}
        pending = []
        for name, cand in reply.values.items():
            vp = self.plan.values[name]
            st = self.state[name]
            static = self._static[name]
            cells = cand.cells
            fresh = self._fresh[name]
            n = cells.numel()
            if fresh:  # every open cell is unset (never written: see _const)
                kept = self._const("kept", n, torch.float64, -torch.inf)
                was = self._const("was", n, torch.bool, False)
            else:
                kept = st.score.index_select(0, cells)
                was = st.committed.index_select(0, cells)
            quota = self.schedule.quota(e, vp.ncells, int(st.committed.count_nonzero()))
            ag = agree(vp, cand, kept, static.priority, quota, fresh)
            commits = int(ag.changed.count_nonzero())
            if commits == n:
                rows = None
                decisions[name] = ValueDecision(None, ag.winner, ag.weights)
            else:
                rows = ag.changed.nonzero().squeeze(1)
                decisions[name] = ValueDecision(
                    rows,
                    ag.winner.index_select(0, rows),
                    None if ag.weights is None else ag.weights.index_select(0, rows),
                )
            pending.append((name, cand, ag, rows, was, commits))
        applied: ApplyReply = self.dataplane.apply(ApplyRequest(e, decisions, self.checksums))
        if self.guard:
            from lmpm.runtime.guard import check_message

            check_message(applied, "apply reply")

        commits = violations = attempts = 0
        values: list[ValueEpoch] = []
        for name, cand, ag, rows, was, n_commits in pending:
            st = self.state[name]
            static = self._static[name]
            got = applied.values[name]
            changed = ag.changed
            if got.changed is not None:  # an aggregate equal to the committed payload: no commit
                sub = got.changed
                if rows is None:
                    changed = changed & sub
                else:
                    changed = changed.clone()
                    changed[rows] = sub
                n_commits = int(changed.count_nonzero())
            # the committing rows, when the worker committed exactly those the policy chose
            keep = rows if got.changed is None else None
            ve = self._commit(
                name,
                e,
                cand,
                ag.score,
                ag.winner,
                changed,
                n_commits,
                was,
                static,
                ag.weights,
                keep,
            )
            if got.checksum is not None:  # one per committed row, in row order
                sums = torch.zeros(cand.cells.numel(), dtype=torch.int64)
                sums[changed] = got.checksum
                ve.checksum = sums
            values.append(ve)
            commits += n_commits
            attempts += int(cand.cells.numel())
            k = cand.violated.shape[2]
            if k:
                viol = cand.violated.select(2, 0) if k == 1 else cand.violated.any(dim=2)
                violations += int(viol.count_nonzero())
        self.epoch = e + 1
        rec = EpochRecord(
            e,
            values,
            sum(v.numel() for v in open_.values()),
            commits,
            attempts,
            violations,
            time.perf_counter() - t0,
            reply.model_seconds,
            halo_bytes=getattr(self.dataplane, "halo_bytes", 0),
        )
        for o in self.observers:
            o.on_epoch(self, rec)
        return rec

    def _commit(
        self,
        name: str,
        e: int,
        cand: Any,
        score: Tensor,
        winner: Tensor,
        changed: Tensor,
        commits: int,
        was: Tensor,
        static: _ValueStatic,
        weights: Tensor | None,
        keep: Tensor | None,
    ) -> ValueEpoch:
        """Advance clocks and provenance of the committing cells; the epoch's record."""
        st = self.state[name]
        cells = cand.cells
        fresh = self._fresh[name]
        n = cells.numel()
        own = self._const("own", n, torch.int64, 0) if fresh else st.clock.index_select(0, cells)
        new_clock = own
        if commits:
            contributed: dict[int, Tensor] | None = None
            if len(static.rules) > 1:
                if weights is None:  # the winner's rule
                    won = cand.col_rule.index_select(0, winner)
                    contributed = {rp.id: won == rp.id for rp in static.rules}
                else:  # every rule whose proposals the aggregate weighs
                    used = weights > 0
                    contributed = {
                        rp.id: used[:, cand.col_rule == rp.id].any(dim=1) for rp in static.rules
                    }
            new_clock = self._clocks.advance(
                {s: self.state[s].clock for s in self.plan.values},
                static.rules,
                own,
                cells,
                changed,
                commits,
                contributed,
                None if self._guarded[name] else self.schedule.phase(name, e),
                fresh,
            )
            fields = [
                cells,
                new_clock,
                cand.col_rule.index_select(0, winner),
                score.gather(1, winner.unsqueeze(1)).squeeze(1),
            ]
            if commits < n:
                if keep is None:
                    keep = changed.nonzero().squeeze(1)
                fields = [t.index_select(0, keep) for t in fields]
            idx, clock, rule, won = fields
            st.committed.index_fill_(0, idx, True)
            st.clock.index_put_((idx,), clock)
            st.rule.index_put_((idx,), rule)
            st.epoch.index_fill_(0, idx, e)
            st.score.index_put_((idx,), won)
        return ValueEpoch(
            name,
            cells,
            cand.valid,
            score,
            cand.col_rule,
            cand.violated,
            static.constraint_ids,
            winner,
            changed,
            new_clock,
            was,
            cand.applies,
        )

    def _const(self, kind: str, n: int, dtype: torch.dtype, fill: Any) -> Tensor:
        """A filled (n,) tensor made once: the metadata of unset cells. Only ever read (records
        and agreement copy from it; no user code receives it)."""
        key = (kind, n, dtype)
        hit = self._consts.get(key)
        if hit is None:
            hit = self._consts[key] = torch.full((n,), fill, dtype=dtype)
        return hit
