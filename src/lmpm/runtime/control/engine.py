"""The control plane's epoch loop: the epoch barrier, the RuleSet, termination, records.

The engine decides *when* an epoch runs and what counts in it; the data plane behind its port
(:class:`~lmpm.runtime.port.DataPlanePort`) decides each cell. Per epoch the engine

1. sends one :class:`~lmpm.runtime.protocol.EpochRequest` (the epoch, the RuleSet, where the
   schedule's pass over unset cells stands), of a size independent of the cells;
2. the data plane's owner of the cells (:class:`~lmpm.runtime.data.owner.Owner`) opens them, has the
   workers propose and check, agrees, applies, advances Lamport clocks and provenance, and makes
   the commits durable;
3. gets back an :class:`~lmpm.runtime.protocol.EpochReport` (counts; a MaskPlan event records the
   open set), counts the epochs without a commit (termination) and hands the epoch's record to
   its observers (commit log, trace), which mark the epoch durable last.

The engine holds no payload and no per-cell state: ``engine.state`` and ``engine.why`` are the
owner's, read by the observers beside it (run with ``guard=True`` to check every message and
record for payload, see :mod:`lmpm.runtime.data.guard`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lmpm.errors import InputError, UsageError
from lmpm.ir.nodes import TRUE
from lmpm.resolve.plan import Plan, needs_input
from lmpm.resolve.schedules import epoch_horizon
from lmpm.runtime.control.crdt import ORSet
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.guard import GuardedDataPlane, check_message, guarding
from lmpm.runtime.port import DataPlanePort
from lmpm.runtime.protocol import EpochRequest
from lmpm.runtime.records import (
    CHECKSUM_POLICIES,
    HELD,
    NEVER_OPENED,
    NO_QUORUM,
    NO_SOURCE,
    NO_WINNER,
    NOT_FIRED,
    UNKNOWN,
    CellState,
    EpochRecord,
    RuleSetEvent,
    RunResult,
    StopReason,
)


class Observer(Protocol):
    def on_start(self, engine: Engine) -> None: ...
    def on_epoch(self, engine: Engine, record: EpochRecord) -> None: ...
    def on_end(self, engine: Engine) -> None: ...


def why_text(code: int, plan: Plan, value: str) -> str:
    """Why a cell of ``value`` is unset, in the words of :attr:`StopReason.unset`: ``code`` is a
    why-code of :mod:`lmpm.runtime.records` (negative) or the id of the highest-priority
    constraint every candidate of the cell violated (>= 0).

    >>> from lmpm.ir import compile_source
    >>> from lmpm.resolve.plan import resolve
    >>> plan = resolve(compile_source("value A : Token[4] shape Seq(2)\\n"
    ...     "constraint Hard: forbid A[0] in Set(0..3) priority 9\\n").ir)
    >>> why_text(0, plan, "A"), why_text(NOT_FIRED, plan, "A")
    ('every candidate violates `Hard`', 'no rule fires there')
    """
    if code == NO_QUORUM:
        policy = plan.values[value].policy_text
        return f"the quorum's replicas disagreed (no payload had the votes {policy} needs)"
    if code == HELD:
        steps = plan.schedule.steps
        return (
            f"held back by the schedule's quota (steps={steps}: every cell within {steps} epochs)"
        )
    fixed = {
        UNKNOWN: "not attempted since the resume",
        NEVER_OPENED: "never opened by the schedule",
        NOT_FIRED: "no rule fires there",
        NO_WINNER: "no candidate beat leaving it unset",
        NO_SOURCE: "no rule proposes it and no input gave it",
    }
    if code in fixed:
        return fixed[code]
    if code < 0:  # a code this table lacks: say so rather than blame a constraint
        return f"unset for a reason this version of LMPM does not name (code {code})"
    names = {cp.id: cp.name for cp in plan.constraints}
    if code in names:
        return f"every candidate violates `{names[code]}`"
    return f"every candidate violates constraint #{code}, which the program no longer has"


class Engine:
    """Runs a :class:`~lmpm.resolve.plan.Plan` epoch by epoch: the control plane over one port.

    ``dataplane``: the data plane behind the port (one worker made on ``backend`` when not given).
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
        dataplane: DataPlanePort | None = None,
        guard: bool = False,
    ) -> None:
        self.plan = plan
        self.seed = int(seed)
        self.guard = guard
        if dataplane is None:
            cls = GuardedDataPlane if guard else DataPlane
            dataplane = cls(
                plan, backend=backend, seed=self.seed, checksum_policies=CHECKSUM_POLICIES
            )
        self.dataplane: DataPlanePort = dataplane
        self.observers = list(observers)
        self.keep_records = keep_records
        self.checksums = False  # set by observers that log checksums
        self.epoch = 0  # the next epoch to run
        self.maskplan = ORSet("control")
        # RuleSet: the constraints that count, an ORSet of names changed only by committed
        # events between epochs (enable/disable); ``_active`` is None while all of them count
        self.ruleset = ORSet("ruleset")
        for cp in plan.constraints:
            self.ruleset.add(cp.name)
        self.ruleset_events: list[RuleSetEvent] = []
        self._active: frozenset[int] | None = None
        self.record: dict[str, Tensor] | None = None  # cells whose candidates the worker records
        # Epoch-guarded triggers: from epoch `_until` on, each repeats every `_cycle` epochs.
        self._until, self._cycle = 0, 1
        proposed = plan.rules_by_target
        for rp in plan.rules:
            if rp.trigger != TRUE and rp.target in proposed:
                vp = plan.values[rp.target]
                env: dict[str, Any] = dict(plan.env)
                env.update({v: vp.coords[:, k] for k, v in enumerate(rp.ir.vars)})
                until, cycle = epoch_horizon(rp.trigger, env, vp.ncells)
                self._until = max(self._until, until)
                self._cycle = math.lcm(self._cycle, cycle)
        self.quiet = 0  # counted epochs without a commit since the last commit (see _epoch)
        self._unset: Mapping[str, int] | None = None  # per value, after the last epoch (report)
        self.stop: StopReason | None = None
        self._started = False
        self.compiled: Any = None  # the fused data plane's CompiledEpoch (see compile())
        # K epochs per CUDA-graph replay (lmpm.runtime.data.kepochs.EpochWindows; Run sets it)
        self.windows: Any = None
        self.checkpoint_every: int | None = None  # the commit log's (set in its on_start)

    # ---- the owner's metadata, read by the observers beside it -------------------------------------
    @property
    def state(self) -> dict[str, CellState]:
        """Per value, its cells' committed flags, clocks, provenance and scores (the owner's)."""
        return self.dataplane.owner.state

    @property
    def why(self) -> dict[str, Tensor]:
        """Per proposed value, why each unset cell is unset (the owner's why-codes)."""
        return self.dataplane.owner.why

    def compile(self) -> Any:
        """Run each value's epoch after its model as one compiled step from now on (``--compile``;
        :mod:`lmpm.runtime.data.compiled`): the data plane becomes a fused one."""
        if self.compiled is None:
            self.compiled = self.dataplane.compile()
        return self.compiled

    # ---- state -----------------------------------------------------------------------------------
    def restore_quiet(self, trailing: int) -> None:
        """Resume the count of commit-free epochs from the log's ``trailing`` commit-free epochs
        (only those from the guards' horizon on count), so the schedule's pass goes on where it
        was."""
        self.quiet = max(0, min(trailing, self.epoch - self._until))

    def restore(self, value: str, state: CellState) -> None:
        """Load a checkpointed value's metadata into its owner (resume)."""
        self.dataplane.owner.restore(value, state)
        self._unset = None

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
        return ev

    def _active_ids(self) -> frozenset[int] | None:
        """The ids of the constraints in the RuleSet, or None when all are (built per event)."""
        ids = frozenset(cp.id for cp in self.plan.constraints if cp.name in self.ruleset)
        return None if len(ids) == len(self.plan.constraints) else ids

    def active_constraints(self) -> list[str]:
        """The names of the constraints that count in the next epoch, in program order."""
        return [cp.name for cp in self.plan.constraints if cp.name in self.ruleset]

    # ---- the loop --------------------------------------------------------------------------------
    def _unset_now(self) -> Mapping[str, int]:
        if self._unset is None:
            self._unset = self.dataplane.owner.unset()
        return self._unset

    def _validate_sources(self) -> None:
        unset = self._unset_now()
        for source, rules in needs_input(self.plan).items():
            if unset[source] == self.plan.values[source].ncells:
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
        self._unset = None  # inputs may have been given since the last run
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
        # the per-cell records travel only where they are kept or an observer writes them (a
        # group's owners write the commit log's rows themselves: CommitLog.wants_records)
        records = self.keep_records or any(
            getattr(o, "wants_records", True) for o in self.observers
        )
        # (checked once before the loop: after each epoch the check below has just run)
        if self.epoch < limit and stop_when_stable and self.is_stable():
            res.stable = True  # a resumed run that had already become stable
            return
        guard = self.guard
        while self.epoch < limit:
            if self.windows is not None:
                self._replay(limit, stop_when_stable)
            rec = self._step(records) if guard else self._epoch(records)
            res.epochs += 1
            res.commits += rec.commits
            res.attempts += rec.attempts
            res.model_seconds += rec.model_seconds
            if self.keep_records:
                res.records.append(rec)
            if progress is not None:
                progress(rec)
            # (right after a commit nothing is counted yet: is_stable's first test, done here)
            if stop_when_stable and self.quiet and self.is_stable():
                res.stable = True
                break

    def _replay(self, limit: int, stop_when_stable: bool) -> None:
        """Run the next epochs on the device as one window where the run allows it; the loop
        then settles them one by one (lmpm.runtime.data.kepochs)."""
        w = self.windows
        if stop_when_stable:
            w.stop("the run stops when stable (a host decision after each epoch)")
        elif self.guard:
            w.stop("the payload guard checks each epoch")
        elif self.record:
            w.stop("candidates are traced (--trace cells)")
        if self.checkpoint_every:  # a checkpoint after epoch c reads the payload after c
            every = self.checkpoint_every
            limit = min(limit, self.epoch + (-(self.epoch + 1)) % every + 1)
        m = w.size(self.epoch, limit)
        if m > 1:
            w.replay(self.epoch, m, self._active)

    def stable_period(self) -> int:
        """Counted epochs without a commit that prove stability now: one full cycle of the
        schedule over the cells it can still open (raster/random: every unset cell once), for
        each residue of the epoch-guarded triggers' cycle."""
        need = 1
        unset = self._unset_now()
        schedule = self.dataplane.owner.schedule
        for name in self.plan.rules_by_target:
            need = max(need, schedule.stable_after(unset[name]))
        return need * self._cycle

    def is_stable(self) -> bool:
        """No commit for a full cycle (:meth:`stable_period`) counted from the epoch at which
        every epoch-guarded trigger has settled (``e >= 3`` settles at epoch 3): no rule can
        commit any more, whatever the number of further epochs."""
        # the period is at least one epoch: right after a commit there is nothing to count
        return self.quiet > 0 and self.quiet >= self.stable_period()

    def _request(self, e: int, records: bool = True) -> EpochRequest:
        """Epoch ``e``'s request: the schedules that open a few unset cells pass over the cells
        tried since the last commit. ``records``: the per-cell records are wanted (a group's
        owners send them only then)."""
        return EpochRequest(
            e,
            self.quiet // self._cycle,
            e - self.quiet,
            self._active,
            self.checksums,
            self.record,
            records,
        )

    def open_cells(self, e: int) -> dict[str, Tensor]:
        """(n,) int64 per proposed value: the cells the owner would open in epoch ``e`` now."""
        req = self._request(e)
        return self.dataplane.owner.open_cells(e, req.skip, req.start)

    def stop_reason(self, kind: str) -> StopReason:
        """Why the run stops now: ``kind`` and, per value, the unset cells by reason."""
        owner = self.dataplane.owner
        unset = {
            name: {why_text(code, self.plan, name): n for code, n in codes.items()}
            for name, codes in owner.reasons().items()
        }
        names = {cp.id: cp.name for cp in self.plan.constraints}
        broken = {
            name: {names[cid]: n for cid, n in by.items()}
            for name, by in owner.broken_counts().items()
        }
        return StopReason(kind, self.epoch, unset, broken)

    def step(self) -> EpochRecord:
        """One epoch. Nothing is committed unless every part of the epoch succeeded."""
        # No autograd anywhere in an epoch: inference mode skips its per-op bookkeeping.
        with torch.inference_mode():
            return self._step()

    def _step(self, records: bool = True) -> EpochRecord:
        """One epoch; ``records``: its record carries the per-cell records (``values``)."""
        if not self.guard:
            return self._epoch(records)
        with guarding(self.dataplane):
            rec = self._epoch(records)
            check_message(rec, "epoch record")
            check_message(self.state, "owner state")
            return rec

    def _epoch(self, records: bool) -> EpochRecord:
        e = self.epoch
        t0, cpu0 = time.perf_counter(), time.process_time()
        quiet = self.quiet
        req = self._request(e, records)
        report = self.dataplane.epoch(req)
        if self.guard:
            check_message(req, "epoch request")
            check_message(report, "epoch report")
        opened = report.opened
        self.maskplan.add(("open", e, opened))
        self._unset = report.unset  # the owner hands over a fresh mapping
        self.epoch = e + 1
        # count the epochs without a commit (before the horizon a guard may still switch a rule on)
        if report.commits:
            self.quiet = 0
        elif e >= self._until:
            self.quiet = quiet + 1
        n_open = 0
        for _, n in opened:
            n_open += n
        rec = EpochRecord(
            report.epoch,
            report.values,
            n_open,
            report.commits,
            report.attempts,
            report.violations,
            time.perf_counter() - t0,
            report.model_seconds,
            halo_bytes=report.halo_bytes,
            message_bytes=report.message_bytes,
            control_bytes=report.control_bytes,
            driver_cpu_s=time.process_time() - cpu0,
            faults=report.faults,
            dissent=report.dissent,
            durable=report.durable,
            log=report.log,
        )
        for o in self.observers:
            o.on_epoch(self, rec)
        return rec
