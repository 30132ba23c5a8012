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

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lmpm.errors import InputError, UsageError
from lmpm.ir.nodes import TRUE
from lmpm.resolve.plan import (
    ConstraintPlan,
    Plan,
    RulePlan,
    needs_input,
)
from lmpm.resolve.policies import aggregates, quorum
from lmpm.resolve.schedules import epoch_horizon, make_schedule
from lmpm.runtime.agree import agree
from lmpm.runtime.clocks import Clocks
from lmpm.runtime.compiled import CompiledEpoch
from lmpm.runtime.crdt import ORSet
from lmpm.runtime.dataplane import DataPlane, Proposal, checksum, pick
from lmpm.runtime.protocol import (
    ApplyReply,
    ApplyRequest,
    ProposeReply,
    ProposeRequest,
    RuleWork,
    ValueDecision,
)
from lmpm.runtime.records import (
    CHECKSUM_POLICIES,
    HELD,
    INPUT_RULE,
    NEVER_OPENED,
    NO_WINNER,
    NOT_FIRED,
    UNKNOWN,
    CellState,
    Dissent,
    EpochRecord,
    RuleSetEvent,
    RunResult,
    StopReason,
    ValueEpoch,
)
from lmpm.runtime.texpr import mask_of


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


class Observer(Protocol):
    def on_start(self, engine: Engine) -> None: ...
    def on_epoch(self, engine: Engine, record: EpochRecord) -> None: ...
    def on_end(self, engine: Engine) -> None: ...


@dataclass(frozen=True, slots=True)
class _ValueStatic:
    """What the loop needs about one proposed value, built once."""

    rules: tuple[RulePlan, ...]  # the rules proposing the value
    constraints: tuple[ConstraintPlan, ...]  # evaluated at run time (K of them)
    priority: Tensor  # (K,) int64
    constraint_ids: Tensor  # (K,) int64 ids into plan.constraints
    hard: Tensor | None = None  # (K,) bool: `hard` constraints (None: none is)


def _hard_mask(constraints: list[ConstraintPlan]) -> Tensor | None:
    """(K,) bool: which of a value's live constraints are `hard` (None when none is)."""
    if not any(cp.ir.hard for cp in constraints):
        return None
    return torch.tensor([cp.ir.hard for cp in constraints], dtype=torch.bool)


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
        # RuleSet: the constraints that count, an ORSet of names changed only by committed
        # events between epochs (enable/disable); ``_active`` is None while all of them count
        self.ruleset = ORSet("ruleset")
        for cp in plan.constraints:
            self.ruleset.add(cp.name)
        self.ruleset_events: list[RuleSetEvent] = []
        self._active: frozenset[int] | None = None
        self.record: dict[str, Tensor] | None = None  # cells whose candidates the worker records
        by_target = plan.rules_by_target
        live = plan.live_constraints
        self._static = {
            name: _ValueStatic(
                tuple(rules),
                tuple(live.get(name, [])),
                torch.tensor([cp.priority for cp in live.get(name, [])], dtype=torch.int64),
                torch.tensor([cp.id for cp in live.get(name, [])], dtype=torch.int64),
                _hard_mask(live.get(name, [])),
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
        # values committed by quorum (not aggregated): their outvoted replicas are recorded
        self._quorum = {
            name: plan.values[name].policy is quorum
            and not aggregates(plan.values[name].policy, plan.values[name].policy_args)
            for name in self._static
        }
        self._clocks = Clocks(plan.rules)
        # Epoch-guarded triggers: from epoch `_until` on, each repeats every `_cycle` epochs.
        self._until, self._cycle = 0, 1
        for rp in plan.rules:
            if self._triggered[rp.id] and rp.target in self._static:
                vp = plan.values[rp.target]
                env: dict[str, Any] = dict(plan.env)
                env.update({v: vp.coords[:, k] for k, v in enumerate(rp.ir.vars)})
                until, cycle = epoch_horizon(rp.trigger, env, vp.ncells)
                self._until = max(self._until, until)
                self._cycle = math.lcm(self._cycle, cycle)
        self.quiet = 0  # counted epochs without a commit since the last commit (see _count_quiet)
        # (ncells,) int64 per proposed value: why each cell is unset (constraint id or NEVER_OPENED..)
        self.why = {
            name: torch.full((plan.values[name].ncells,), NEVER_OPENED) for name in by_target
        }
        self.stop: StopReason | None = None
        self._started = False
        self._consts: dict[tuple[str, int, torch.dtype], Tensor] = {}
        self.compiled: CompiledEpoch | None = None  # see compile()
        self._active_mask: dict[str, Tensor] = {}

    def compile(self) -> CompiledEpoch:
        """Run each value's epoch after its model as one compiled step from now on (``--compile``;
        :mod:`lmpm.runtime.compiled`). Needs a one-worker data plane in this process."""
        if self.compiled is None:
            if not isinstance(self.dataplane, DataPlane):
                raise UsageError(
                    "--compile runs the epoch step next to one worker's payload; this run has a "
                    "worker group",
                    code="U101",
                    hint="drop --compile, or run with one worker",
                )
            if self.guard:
                raise UsageError("--compile and the payload guard do not mix", code="U102")
            if self.dataplane.device.type != "cpu":
                # The step writes the payload and the cells' metadata together; on CUDA the
                # metadata would have to live on the device too (not built yet).
                raise UsageError(
                    f"--compile runs with the cpu backend; this run's payload is on "
                    f"{self.dataplane.device}",
                    code="U103",
                    hint="drop --compile, or run with --backend cpu",
                )
            self.compiled = CompiledEpoch(
                self.plan, self.dataplane.device, quota=self.schedule.has_quota
            )
            self.compiled.prepare(self.dataplane)
            self.dataplane.compile_reads(self.compiled.stats)
        return self.compiled

    # ---- state -----------------------------------------------------------------------------------
    def mark_input(self, value: str, cells: Tensor) -> None:
        """Record ``cells`` of ``value`` as committed from an input (provenance INPUT, clock 1).
        The payload went to the data plane (:meth:`DataPlane.set_input`)."""
        st = self.state[value]
        st.committed[cells] = True
        st.clock[cells] = torch.maximum(st.clock[cells], torch.ones_like(st.clock[cells]))
        st.rule[cells] = INPUT_RULE
        st.score[cells] = 0.0

    def restore_quiet(self, trailing: int) -> None:
        """Resume the count of commit-free epochs from the log's ``trailing`` commit-free epochs
        (only those from the guards' horizon on count), so the schedule's pass goes on where it
        was."""
        self.quiet = max(0, min(trailing, self.epoch - self._until))

    # ---- the RuleSet -------------------------------------------------------------------------------
    def enable(self, name: str, by: str = "api") -> RuleSetEvent:
        """Make constraint ``name`` count from the next epoch on (a committed RuleSet event)."""
        return self.change_ruleset("add", name, by)

    def disable(self, name: str, by: str = "api") -> RuleSetEvent:
        """Stop constraint ``name`` counting from the next epoch on (a committed RuleSet event)."""
        return self.change_ruleset("remove", name, by)

    def change_ruleset(
        self, op: str, name: str, by: str, *, epoch: int | None = None, clock: int | None = None
    ) -> RuleSetEvent:
        """Apply one RuleSet event (``op``: add | remove) taking effect at the start of ``epoch``
        (default: the next epoch to run). ``epoch``/``clock`` are given when a resume replays
        the log."""
        names = sorted({cp.name for cp in self.plan.constraints})
        if name not in names:
            raise UsageError(
                f"no constraint `{name}` to {'enable' if op == 'add' else 'disable'}; the "
                f"program declares: {', '.join(names) or 'none'}",
                code="U075",
            )
        if clock is None:
            clock = 1 + max((ev.clock for ev in self.ruleset_events), default=0)
        ev = RuleSetEvent(self.epoch if epoch is None else epoch, op, name, clock, by)
        if op == "add":
            self.ruleset.add(name)
        else:
            self.ruleset.remove(name)
        self.ruleset_events.append(ev)
        self._active = self._active_ids()
        self._active_mask = {}
        return ev

    def _active_ids(self) -> frozenset[int] | None:
        """The ids of the constraints in the RuleSet, or None when all are (built per event)."""
        ids = frozenset(cp.id for cp in self.plan.constraints if cp.name in self.ruleset)
        return None if len(ids) == len(self.plan.constraints) else ids

    def active_constraints(self) -> list[str]:
        """The names of the constraints that count in the next epoch, in program order."""
        return [cp.name for cp in self.plan.constraints if cp.name in self.ruleset]

    def restore(self, value: str, state: CellState) -> None:
        """Load a checkpointed value's metadata (resume)."""
        self.state[value] = state
        if value in self.why:
            self.why[value] = torch.where(state.committed, NEVER_OPENED, UNKNOWN)

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
        quiet: int | None = None,
    ) -> RunResult:
        """Run epochs until ``epochs`` have run in total (counting resumed ones), or until the run
        is stable (:meth:`is_stable`; with ``until_stable``, or when ``epochs`` is None). The
        result's ``stop`` says why it ended and why cells are left unset.

        ``quiet``: consecutive epochs without a commit at the end of the run so far (a resumed run
        restores it from the commit log, so it stops exactly where an uninterrupted run would);
        None keeps this engine's own count (a second ``run`` continues the first)."""
        if not self._started:
            self._validate_sources()
            for o in self.observers:
                o.on_start(self)
            self._started = True
        limit = epochs if epochs is not None else max_epochs
        res = RunResult(0, False, 0, 0, 0.0, 0.0)
        # a resumed run's trailing commit-free epochs count only from the guards' horizon on
        if quiet is not None:
            self.restore_quiet(quiet)
        t0 = time.perf_counter()
        with torch.inference_mode():  # as in step(), entered once for the whole loop
            self._loop(res, limit, epochs is None or until_stable, progress)
        res.seconds = time.perf_counter() - t0
        self.stop = res.stop = self.stop_reason("stable" if res.stable else "epochs")
        for o in self.observers:
            o.on_end(self)
        return res

    def _loop(
        self,
        res: RunResult,
        limit: int,
        stop_when_stable: bool,
        progress: Callable[[EpochRecord], None] | None,
    ) -> None:
        while self.epoch < limit:
            if stop_when_stable and self.is_stable():
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
            if stop_when_stable and self.is_stable():
                res.stable = True
                break

    def stable_period(self) -> int:
        """Counted epochs without a commit that prove stability now: one full cycle of the
        schedule over the cells it can still open (raster/random: every unset cell once), for
        each residue of the epoch-guarded triggers' cycle."""
        need = 1
        for name in self._static:
            unset = int(
                self.state[name].committed.numel() - self.state[name].committed.count_nonzero()
            )
            need = max(need, self.schedule.stable_after(unset))
        return need * self._cycle

    def is_stable(self) -> bool:
        """No commit for a full cycle (:meth:`stable_period`) counted from the epoch at which
        every epoch-guarded trigger has settled (``e >= 3`` settles at epoch 3): no rule can
        commit any more, whatever the number of further epochs."""
        # the period is at least one epoch: right after a commit there is nothing to count
        return self.quiet > 0 and self.quiet >= self.stable_period()

    def _count_quiet(self, e: int, commits: int) -> None:
        if commits:
            self.quiet = 0
        elif e >= self._until:  # before the horizon a guard may still switch a rule on
            self.quiet += 1

    def open_cells(self, e: int) -> dict[str, Tensor]:
        """(n,) int64 per proposed value: the cells open in epoch ``e``, sorted and unique. The
        schedules that open a few unset cells pass over the cells tried since the last commit."""
        skip = self.quiet // self._cycle
        start = e - self.quiet
        return {
            name: self.schedule.open_cells(name, self.state[name].committed, e, skip, start)
            for name in self._static
        }

    def stop_reason(self, kind: str) -> StopReason:
        """Why the run stops now: ``kind`` and, per value, the unset cells by reason."""
        unset: dict[str, dict[str, int]] = {}
        for name, why in self.why.items():
            left = why[~self.state[name].committed]
            if not left.numel():
                continue
            codes, counts = torch.unique(left, return_counts=True)
            reasons: dict[str, int] = {}
            for code, count in sorted(zip(codes.tolist(), counts.tolist()), key=lambda x: -x[1]):
                reasons[self._why_text(int(code))] = int(count)
            unset[name] = reasons
        for name, st in self.state.items():  # no rule proposes it, no input gave it: all unset
            if name not in self.why and st.committed.numel() and not bool(st.committed.any()):
                unset[name] = {"no rule proposes it and no input gave it": st.committed.numel()}
        return StopReason(kind, self.epoch, unset)

    def _why_text(self, code: int) -> str:
        if code == UNKNOWN:
            return "not attempted since the resume"
        if code == NEVER_OPENED:
            return "never opened by the schedule"
        if code == NOT_FIRED:
            return "no rule fires there"
        if code == NO_WINNER:
            return "no candidate beat leaving it unset"
        if code == HELD:
            steps = self.plan.schedule.steps
            return f"held back by the schedule's quota (steps={steps}: every cell within {steps} epochs)"
        names = {cp.id: cp.name for cp in self.plan.constraints}
        return f"every candidate violates `{names.get(code, code)}`"

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
        t0, cpu0 = time.perf_counter(), time.process_time()
        open_ = self.open_cells(e)
        opened = sorted([(k, v.numel()) for k, v in open_.items()])
        self.maskplan.add(("open", e, tuple(opened)))
        phases = {
            name: None if self._guarded[name] else self.schedule.phase(name, e) for name in open_
        }
        work = self._work(e, open_)
        req = ProposeRequest(e, work, self._fresh, self.record, phases, self._active)
        fused: dict[str, Proposal] = {}
        if self.compiled is not None and self._compiled_epoch():
            reply, order, fused = self._propose_compiled(req)
        else:
            if self.compiled is not None:
                self.compiled.stats.eager_epochs += 1
            reply = self.dataplane.propose(req)
            order = list(reply.values)
        for name, cells in open_.items():
            proposed = reply.values.get(name)
            seen = proposed.cells if proposed is not None else None
            if name in fused:
                seen = fused[name][1]
            if seen is None or seen.numel() != cells.numel():
                # open cells no rule fired on (the proposed ones that stay unset are refined by
                # _blocked below; cells that commit need no reason)
                self.why[name].index_fill_(0, cells, NOT_FIRED)
        if self.guard:
            from lmpm.runtime.guard import check_message

            check_message(req, "propose request")
            check_message(reply, "propose reply")

        # agree per value; the worker applies all values together at the boundary.
        decisions: dict[str, ValueDecision] = {}
        pending: dict[str, tuple[Any, Any, Tensor | None, Tensor, int]] = {}
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
            quota = None
            if self.schedule.has_quota:  # a share of the cells to generate: inputs do not count
                given = int((st.rule == INPUT_RULE).count_nonzero())
                quota = self.schedule.quota(
                    e, vp.ncells - given, int(st.committed.count_nonzero()) - given
                )
            ag = agree(vp, cand, kept, static.priority, quota, fresh, static.hard)
            commits = int(ag.changed.count_nonzero())
            if commits < n:  # why the cells that stay unset do (nothing to do when all commit)
                self._blocked(name, cand, static, (~ag.changed & ~was).nonzero().squeeze(1))
                if quota is not None:  # winners the quota held back: not "no candidate"
                    held = (ag.winner != 0) & ~ag.changed & ~was
                    self.why[name].index_put_((cells[held],), torch.full_like(cells[held], HELD))
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
            pending[name] = (cand, ag, rows, was, commits)
        if decisions or not fused:
            applied = self.dataplane.apply(ApplyRequest(e, decisions, self.checksums))
        else:
            applied = ApplyReply(self.dataplane.worker, {}, self.dataplane.store is not None)
        if self.guard:
            from lmpm.runtime.guard import check_message

            check_message(applied, "apply reply")

        commits = violations = attempts = 0
        values: list[ValueEpoch] = []
        dissents: list[Dissent] = []
        for name in order:  # the order eager commits in: a value's clocks read the ones before
            if name in fused:
                ve, n_commits, n_viol = self._fused(name, e, fused[name])
                values.append(ve)
                commits += n_commits
                attempts += int(ve.cells.numel())
                violations += n_viol
                continue
            cand, ag, rows, was, n_commits = pending[name]
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
                phases[name],
            )
            if got.checksum is not None:  # one per committed row, in row order
                sums = torch.zeros(cand.cells.numel(), dtype=torch.int64)
                sums[changed] = got.checksum
                ve.checksum = sums
            if self._quorum[name]:
                for p, n in dissent(cand, ag.winner, changed):
                    dissents.append(Dissent(name, p, self._replica_worker(name, p), n))
            values.append(ve)
            commits += n_commits
            attempts += int(cand.cells.numel())
            k = cand.violated.shape[2]
            if k:
                viol = cand.violated if k == 1 else cand.violated.any(dim=2)
                violations += int(viol.count_nonzero())
        if fused and self.dataplane.store is not None:
            self.dataplane.store.sync(e)
        self.epoch = e + 1
        self._count_quiet(e, commits)
        rec = EpochRecord(
            e,
            values,
            sum([n for _, n in opened]),
            commits,
            attempts,
            violations,
            time.perf_counter() - t0,
            reply.model_seconds,
            halo_bytes=getattr(self.dataplane, "halo_bytes", 0),
            message_bytes=self.dataplane.traffic.message_bytes,
            control_bytes=self.dataplane.traffic.control_bytes,
            driver_cpu_s=time.process_time() - cpu0,
            faults=tuple(self.dataplane.take_faults())
            if hasattr(self.dataplane, "take_faults")
            else (),
            dissent=tuple(dissents),
        )
        for o in self.observers:
            o.on_epoch(self, rec)
        return rec

    # ---- the compiled epoch step (--compile) ----------------------------------------------------
    def _compiled_epoch(self) -> bool:
        """This epoch runs the compiled steps: compiling, and nothing watches the candidate tables
        (--trace cells, taps) or corrupts proposals (fault drills)."""
        if self.compiled is None or not self.compiled.specs or self.record:
            return False
        dp: Any = self.dataplane
        return not dp.taps and dp.corrupt_from is None

    def _propose_compiled(
        self, req: ProposeRequest
    ) -> tuple[ProposeReply, list[str], dict[str, Proposal]]:
        """Run the models; build the eager values' candidates (the compiled values' come in their
        steps). Returns the eager reply, the values in commit order and the compiled values'
        proposals."""
        dp: Any = self.dataplane
        assert self.compiled is not None
        per_value, model_seconds = dp.run_models(req)
        dp._staged = {}
        values = {}
        fused: dict[str, Proposal] = {}
        for name, parts in per_value.items():
            if self.compiled.compiles(name):
                fused[name] = parts[0]
            else:
                values[name] = dp._candidates(name, req.epoch, parts, req.fresh.get(name, False))
        return ProposeReply(dp.worker, values, model_seconds), list(per_value), fused

    def _fused(self, name: str, e: int, part: Proposal) -> tuple[ValueEpoch, int, int]:
        """One compiled value's epoch: its step, then durability and the record."""
        assert self.compiled is not None
        rp, cells, _, prop, sc = part
        static = self._static[name]
        active = self._active_mask.get(name)
        if active is None:
            ids = static.constraint_ids.tolist()
            on = [self._active is None or i in self._active for i in ids]
            active = self._active_mask[name] = torch.tensor(
                on, dtype=torch.bool, device=self.dataplane.device
            )
        dp: Any = self.dataplane
        clocks = {s: st.clock for s, st in self.state.items()}
        out = self.compiled.step(
            name, e, cells, prop, sc, dp, self.state[name], self.why[name], active, clocks
        )
        winner, changed, score, valid, violated, applies, new_clock, was, counts = out
        n_commits, n_viol = counts.tolist()
        ve = ValueEpoch(
            name,
            cells,
            valid,
            score,
            self.compiled.columns(rp.id, prop.shape[1]),
            violated,
            static.constraint_ids,
            winner,
            changed,
            new_clock,
            was,
            applies,
        )
        if n_commits and (dp.store is not None or self.checksums):
            rows = cells if n_commits == cells.numel() else cells[changed]
            new = dp.payload[name].index_select(0, rows)
            if dp.store is not None:
                dp.store.append_commits(e, name, rows, new)
            if self.checksums:
                sums = torch.zeros(cells.numel(), dtype=torch.int64)
                sums[changed] = checksum(new, len(self.plan.values[name].cell_shape)).cpu()
                ve.checksum = sums
        return ve, n_commits, n_viol

    def _replica_worker(self, value: str, replica: int) -> str:
        """The worker that ran ``replica`` of ``value`` (a group knows; one worker: itself)."""
        dp: Any = self.dataplane
        if hasattr(dp, "replica_worker"):
            return str(dp.replica_worker(value, replica))
        return str(getattr(dp, "worker", "w0"))

    def _blocked(self, name: str, cand: Any, static: _ValueStatic, rows: Tensor) -> None:
        """Record why the proposed cells at ``rows`` stay unset: the highest-priority constraint
        that every valid proposal violates, else one that some proposal violates, else
        NO_WINNER."""
        if not rows.numel():
            return
        why = torch.full((rows.numel(),), NO_WINNER, dtype=torch.int64)
        k = cand.violated.shape[2]
        if k:
            # (n, C-1) proposals only (column 0 is keep-current)
            valid = cand.valid.index_select(0, rows)[:, 1:]
            viol = cand.violated.index_select(0, rows)[:, 1:, :]  # (n, C-1, K)
            order = torch.sort(-static.priority, stable=True).indices  # highest priority first
            some = valid.any(dim=1, keepdim=True)  # (n, 1)
            every = ((viol | ~valid.unsqueeze(2)).all(dim=1) & some)[:, order]  # (n, K)
            anyv = (viol & valid.unsqueeze(2)).any(dim=1)[:, order]  # (n, K)
            ids = static.constraint_ids[order]
            for hit in (anyv, every):  # `every` overrides `some`
                first = hit.to(torch.uint8).argmax(dim=1)
                why = torch.where(hit.any(dim=1), ids[first], why)
        self.why[name].index_put_((cand.cells.index_select(0, rows),), why)

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
        phase: int | None,
    ) -> ValueEpoch:
        """Advance clocks and provenance of the committing cells; the epoch's record. ``phase``:
        the schedule's phase of the open cells (None: they vary)."""
        st = self.state[name]
        cells = cand.cells
        fresh = self._fresh[name]
        n = cells.numel()
        own = self._const("own", n, torch.int64, 0) if fresh else st.clock.index_select(0, cells)
        new_clock = own
        if commits:
            contributed: dict[int, Tensor] | None = None
            won_rule: Tensor | None = None  # (n,) each cell's winning rule (several rules)
            if len(static.rules) > 1:
                won_rule = cand.col_rule.index_select(0, winner)
                if weights is None:  # the winner's rule
                    contributed = {rp.id: won_rule == rp.id for rp in static.rules}
                else:  # every rule whose proposals the aggregate weighs
                    used = weights > 0
                    contributed = {
                        rp.id: used[:, cand.col_rule == rp.id].any(dim=1) for rp in static.rules
                    }
            new_clock = self._clocks.advance(
                self.state,
                static.rules,
                own,
                cells,
                changed,
                commits,
                contributed,
                phase,
                fresh,
            )
            fields = [cells, new_clock, pick(score, winner)]
            if won_rule is not None:
                fields.append(won_rule)
            if commits < n:
                if keep is None:
                    keep = changed.nonzero().squeeze(1)
                fields = [t.index_select(0, keep) for t in fields]
            idx, clock, won, *rule = fields
            st.committed.index_fill_(0, idx, True)
            st.clock.index_put_((idx,), clock)
            if rule:
                st.rule.index_put_((idx,), rule[0])
            else:  # one rule: every committing column is that rule's
                st.rule.index_fill_(0, idx, static.rules[0].id)
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
