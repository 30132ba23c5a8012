"""The consensual epoch loop: compute → propose → check → agree → commit.

Every per-cell decision is a tensor operation over all open cells (state as tensors, decisions by
advanced indexing); Python loops run over rules, constraints and values only. Reads see the state at
the start of the epoch; winners are applied together at the epoch boundary, so an epoch's result does
not depend on the order in which work ran.

The control plane (this module) holds metadata only: committed flags, Lamport clocks, provenance,
scores. Payload tensors are resident on the worker backend (``backend.put/get/update``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lmpm.errors import ConstraintEvalError, InputError, ModelError
from lmpm.ir.nodes import TRUE, PredKind, Status
from lmpm.resolve.plan import ConstraintPlan, Plan, RulePlan, ValuePlan, needs_input
from lmpm.resolve.policies import Agree
from lmpm.resolve.schedules import confidence_quota, red_black
from lmpm.runtime.crdt import ORSet
from lmpm.runtime.texpr import mask_of
from lmpm.workers import Results, WorkItem, get_backend
from lmpm.workers import rng as lrng

INPUT_RULE = -2  # provenance of cells committed from an input file
NO_RULE = -1


@dataclass
class CellState:
    """Metadata of one value's cells (the payload itself lives on the backend)."""

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


@dataclass(frozen=True, slots=True)
class PredicateInput:
    """What a user-bound predicate receives (n open cells, C candidates each)."""

    candidates: Tensor  # (n, C) candidate payloads
    valid: Tensor  # (n, C) bool
    current: Tensor  # (n,) committed payload (undefined where not committed)
    committed: Tensor  # (n,) bool
    cells: Tensor  # (n,) flat cell index within the value
    coords: Tensor  # (n, rank)
    accesses: tuple[
        tuple[Tensor, Tensor, Tensor], ...
    ]  # per extra access: payload, mask, index (n, K)
    args: tuple[Any, ...]  # literal arguments
    epoch: int


@dataclass
class ValueEpoch:
    """What happened to one value in one epoch (handed to observers: commit log, trace)."""

    value: str
    cells: Tensor  # (n,) open cells that had candidates
    payload: Tensor  # (n, C) candidates; column 0 is keep-current
    valid: Tensor  # (n, C)
    score: Tensor  # (n, C)
    col_rule: Tensor  # (C,) rule id per column (-1 keep)
    violated: Tensor  # (n, C, K)
    constraint_ids: Tensor  # (K,) ids into plan.constraints
    winner: Tensor  # (n,) chosen column
    changed: Tensor  # (n,) bool: the winner changes the cell (a commit)
    new_payload: Tensor  # (n,)
    new_clock: Tensor  # (n,)
    was_committed: Tensor  # (n,) bool, before this epoch
    applies: Tensor  # (n, K) bool: the constraint speaks about the cell (its verdicts count)


@dataclass(frozen=True, slots=True)
class _ValueStatic:
    """What the epoch loop needs about one proposed value that never changes across epochs: built
    once at engine start, so an epoch pays no Python or tensor work to rediscover it."""

    rules: tuple[RulePlan, ...]  # the rules proposing the value
    constraints: tuple[ConstraintPlan, ...]  # evaluated at run time (K of them)
    priority: Tensor  # (K,) int64
    constraint_ids: Tensor  # (K,) int64 ids into plan.constraints
    covers_all: tuple[bool, ...]  # per constraint: it speaks about every cell (no run-time region)
    # IN_SET: does a token violate the constraint? (vocab + 2,) bool, the set table for `forbid`,
    # its complement for `require`, then two entries for out-of-vocabulary payloads (in no set):
    # indexed by the token clamped to [-1, vocab], so index vocab is "too large" and -1 (the last
    # entry) "negative", without a range test.
    tables: tuple[Tensor | None, ...]


@dataclass(frozen=True, slots=True)
class _ClockRead:
    """The cells of one source a rule's commit takes the Lamport clock max over: a rule's gathered
    reads of the same source merged into one table (one gather per source, not per read)."""

    source: str
    uniform: bool  # every cell reads the same cells: ``index`` is their (valid) flat ids
    index: Tensor  # uniform: (R,) cells; else (target cells, K) flat source index
    valid: Tensor | None  # (target cells, K) bool; None: every entry counts (see _clock_reads)
    read: int | None  # the single read the table is (its model-input rows can be reused), or None


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


def _item_outputs(results: Results, n_items: int) -> list[tuple[Tensor, Tensor]]:
    """(proposal, score) of every dispatched item, in dispatch order. A group that holds a single
    item is that item's output whole (no per-item slicing)."""
    out: list[tuple[Tensor, Tensor] | None] = [None] * n_items
    for g in results.groups:
        if len(g.item_ids) == 1:
            out[g.item_ids[0]] = (g.proposal, g.score)
            continue
        for slot, item in enumerate(g.item_ids):
            lo, hi = g.offsets[slot], g.offsets[slot + 1]
            out[item] = (g.proposal[lo:hi], g.score[lo:hi])
    assert all(o is not None for o in out), "every item belongs to exactly one group"
    return out  # type: ignore[return-value]  # checked just above


def _clock_reads(rp: RulePlan) -> tuple[_ClockRead, ...]:
    """A rule's reads grouped by source for its commits' Lamport clocks (empty reads dropped)."""
    out: list[_ClockRead] = []
    for source in dict.fromkeys(rd.source for rd in rp.reads):
        reads = [(j, rd) for j, rd in enumerate(rp.reads) if rd.source == source]
        rows = [rd.index[0][rd.valid[0]] for _, rd in reads if rd.uniform]
        if rows and sum(r.numel() for r in rows):
            out.append(_ClockRead(source, True, torch.cat(rows), None, None))
        gathered = [(j, rd) for j, rd in reads if not rd.uniform and rd.index.shape[1]]
        if len(gathered) == 1:
            j, rd = gathered[0]
            out.append(_ClockRead(source, False, rd.index, rd.valid, j))
        elif gathered:
            index = torch.cat([rd.index for _, rd in gathered], dim=1)
            valid = torch.cat([rd.valid for _, rd in gathered], dim=1)
            if source == rp.target:
                # A cell's own clock is in the max anyway: pointing the invalid entries at the
                # cell itself makes them count for nothing, with no mask at run time.
                own = torch.arange(index.shape[0]).unsqueeze(1)
                out.append(_ClockRead(source, False, torch.where(valid, index, own), None, None))
            else:
                out.append(_ClockRead(source, False, index, valid, None))
    return tuple(out)


class Engine:
    """Runs a :class:`~lmpm.resolve.plan.Plan` epoch by epoch on a worker backend."""

    def __init__(
        self,
        plan: Plan,
        *,
        backend: str | Any = "cpu",
        seed: int = 0,
        observers: Sequence[Observer] = (),
        keep_records: bool = False,
    ) -> None:
        self.plan = plan
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.seed = int(seed)
        self.observers = list(observers)
        self.keep_records = keep_records
        self.epoch = 0  # the next epoch to run
        self.state: dict[str, CellState] = {}
        for name, vp in plan.values.items():
            self.state[name] = CellState.empty(vp.ncells)
            fill = torch.zeros(vp.ncells, dtype=vp.dtype)
            self.backend.put(self._key(name), fill)
        self.maskplan = ORSet("control")
        self._by_target: dict[str, list[RulePlan]] = {}
        for rp in plan.rules:
            self._by_target.setdefault(rp.target, []).append(rp)
        self._constraints: dict[str, list[ConstraintPlan]] = {}
        for cp in plan.constraints:
            if cp.status == Status.PROVED or cp.pred == PredKind.READ_FUTURE:
                continue  # decided at compile time: recorded as proved, never re-evaluated
            self._constraints.setdefault(cp.target, []).append(cp)
        self._static = {name: self._value_static(name) for name in self._by_target}
        # raster, random and confidence schedules open unset cells only: nothing can fold or change.
        self._opens_committed = plan.schedule.strategy not in ("raster", "random", "confidence")
        # Per rule: whether it has a trigger (`when`), and what its commits' Lamport clocks read.
        self._triggered = {rp.id: rp.trigger != TRUE for rp in plan.rules}
        self._clock_reads = {rp.id: _clock_reads(rp) for rp in plan.rules}
        self._started = False
        # (rule, epoch) -> the model inputs of that rule this epoch: its score call gets the very same
        # tensors, so a model that remembers its last forward (ByteLM, LocalGen) needs no second one.
        self._input_cache: dict[tuple[int, int], dict[str, Tensor]] = {}
        # Cyclic schedules (all, red-black, independent): the open cells of each phase, per value.
        self._cycle_cache: dict[tuple[str, int], Tensor] = {}
        self._ncolors: dict[str, int] = {}  # independent schedule: colours (phases) per value
        # (id(table), id(cells)) -> (table, cells, rows), and the last single open cell: see _rows
        self._row_cache: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}
        self._one: tuple[Tensor | None, int] = (None, 0)
        # Per rule: (its model input names, those its score call receives).
        self._score_key_cache: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # (rule, read) -> (cells, index rows, valid rows) last gathered for the model's inputs, so
        # the Lamport clock of the same cells needs no second gather of these static tables.
        self._read_rows: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}
        self._kwargs_base: dict[int, dict[str, Any]] = {}  # per rule: see _kwargs
        self._const_cache: dict[tuple[str, tuple[int, ...], torch.dtype], Tensor] = {}
        self._column_cache: dict[
            tuple[tuple[int, int, int], ...], tuple[Tensor, Tensor, Tensor]
        ] = {}

    def _value_static(self, name: str) -> _ValueStatic:
        cps = tuple(self._constraints.get(name, []))
        tables: list[Tensor | None] = []
        for cp in cps:
            if cp.pred == PredKind.IN_SET:
                assert cp.table is not None
                table = torch.cat([cp.table, torch.zeros(2, dtype=torch.bool)])
                tables.append(table if cp.kind == "forbid" else ~table)
            else:
                tables.append(None)
        return _ValueStatic(
            tuple(self._by_target.get(name, [])),
            cps,
            torch.tensor([cp.priority for cp in cps], dtype=torch.int64),
            torch.tensor([cp.id for cp in cps], dtype=torch.int64),
            tuple(bool(cp.cells.all()) and not cp.needs_inputs_region for cp in cps),
            tuple(tables),
        )

    # ---- state access ----------------------------------------------------------------------------
    @staticmethod
    def _key(value: str) -> str:
        return f"payload/{value}"

    def payload(self, value: str) -> Tensor:
        return self.backend.get(self._key(value))

    def set_input(self, value: str, payload: Tensor, mask: Tensor) -> None:
        """Commit ``payload[mask]`` as given input (provenance INPUT, clock 1)."""
        vp = self.plan.values.get(value)
        if vp is None:
            known = ", ".join(self.plan.values)
            raise InputError(
                f"there is no value `{value}` with cells to take input",
                code="R010",
                hint=f"values: {known}",
            )
        payload = payload.reshape(-1).to(vp.dtype)
        mask = mask.reshape(-1).bool()
        if payload.numel() != vp.ncells:
            raise InputError(
                f"input for `{value}` has {payload.numel()} cells; `{value}` has shape "
                f"{vp.dims} = {vp.ncells} cells",
                where={"value": value},
                code="R011",
            )
        if vp.vocab is not None:
            bad = mask & ((payload < 0) | (payload >= vp.vocab))
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise InputError(
                    f"input for `{value}` has token {int(payload[i])} outside the "
                    f"vocabulary [0, {vp.vocab})",
                    where={"value": value, "cell": i},
                    code="R012",
                )
        idx = mask.nonzero().squeeze(1)
        self.backend.update(self._key(value), idx, payload[idx])
        st = self.state[value]
        st.committed[idx] = True
        st.clock[idx] = torch.maximum(st.clock[idx], torch.ones_like(st.clock[idx]))
        st.rule[idx] = INPUT_RULE
        st.score[idx] = 0.0

    def restore(self, value: str, payload: Tensor, state: CellState) -> None:
        """Load a checkpointed value (resume)."""
        self.backend.update(self._key(value), torch.arange(payload.numel()), payload.reshape(-1))
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
        spec = self.plan.schedule
        if spec.strategy == "red-black":
            return 2
        if spec.strategy == "independent":
            return max(
                (int(c.max()) + 1 for c in self.plan.colors.values() if c.numel()), default=1
            )
        return 1

    def _open(self, e: int) -> dict[str, Tensor]:
        """(ncells,) bool per proposed value: the cells open in epoch ``e``."""
        out: dict[str, Tensor] = {}
        for name, cells in self._open_cells(e).items():
            m = torch.zeros(self.plan.values[name].ncells, dtype=torch.bool)
            m[cells] = True
            out[name] = m
        return out

    def _open_cells(self, e: int) -> dict[str, Tensor]:
        """(n,) int64 per proposed value: the cells open in epoch ``e``, sorted and unique."""
        spec = self.plan.schedule
        out: dict[str, Tensor] = {}
        for name in self._by_target:
            st = self.state[name]
            if spec.strategy == "raster":
                out[name] = (~st.committed).nonzero().squeeze(1)[: spec.k]
            elif spec.strategy == "random":
                n = self.plan.values[name].ncells
                u = lrng.uniform(self.seed, name, torch.arange(n), e, "schedule")[:, 0]
                u = torch.where(st.committed, torch.full_like(u, 2.0), u)
                m = torch.zeros(n, dtype=torch.bool)
                m[u.argsort()[: spec.k]] = True
                m &= ~st.committed
                out[name] = m.nonzero().squeeze(1)
            elif spec.strategy == "confidence":
                # every unset cell proposes; commits are limited after agreement
                out[name] = (~st.committed).nonzero().squeeze(1)
            else:
                out[name] = self._cycle_cells(name, e)
        return out

    def _cycle_cells(self, name: str, e: int) -> Tensor:
        """Open cells of the schedules that cycle through fixed cell sets: `all` (one set),
        `red-black` (two parities), `independent` (one set per colour). Built once per phase."""
        spec = self.plan.schedule
        vp = self.plan.values[name]
        if spec.strategy == "red-black":
            phase = e % 2
        elif spec.strategy == "independent":
            ncolors = self._ncolors.get(name)
            if ncolors is None:
                colors = self.plan.colors[name]
                ncolors = self._ncolors[name] = int(colors.max()) + 1 if vp.ncells else 1
            phase = e % ncolors
        else:
            phase = 0
        hit = self._cycle_cache.get((name, phase))
        if hit is None:
            if spec.strategy == "red-black":
                hit = (red_black(vp.coords) == phase).nonzero().squeeze(1)
            elif spec.strategy == "independent":
                hit = (self.plan.colors[name] == phase).nonzero().squeeze(1)
            else:
                hit = torch.arange(vp.ncells)
            self._cycle_cache[(name, phase)] = hit
        return hit

    def step(self) -> EpochRecord:
        """One epoch. Nothing is committed unless every part of the epoch succeeded."""
        # No autograd anywhere in an epoch: inference mode skips its per-op bookkeeping.
        with torch.inference_mode():
            return self._step()

    def _step(self) -> EpochRecord:
        e = self.epoch
        t0 = time.perf_counter()
        self._input_cache = {}  # gathered from this epoch's snapshot only (a failed epoch reruns)
        open_ = self._open_cells(e)
        self.maskplan.add(("open", e, tuple(sorted((k, v.numel()) for k, v in open_.items()))))

        # propose: dispatch every rule's work first, then collect (the only blocking point).
        items: list[WorkItem] = []
        meta: list[tuple[RulePlan, Tensor, int]] = []
        snapshot = {name: self.payload(name) for name in self.plan.values}
        for rp in self.plan.rules:
            vp = self.plan.values[rp.target]
            cells = open_.get(rp.target)
            if cells is None:
                continue
            if self._triggered[rp.id]:
                env: dict[str, Any] = dict(self.plan.env)
                env["e"] = e
                env.update({v: vp.coords[:, k] for k, v in enumerate(rp.ir.vars)})
                fire = torch.zeros(vp.ncells, dtype=torch.bool)
                fire[cells] = True
                cells = (fire & mask_of(rp.trigger, env, vp.ncells)).nonzero().squeeze(1)
            if cells.numel() == 0:
                continue
            inputs = self._inputs(rp, cells, snapshot)
            kwargs = self._kwargs(rp, vp, e)
            global_cells = cells + vp.offset if vp.offset else cells
            score_inputs = self._score_keys(rp, inputs) if rp.score else ()
            for rep in range(rp.replicas):
                items.append(
                    WorkItem(
                        rp.name,
                        rp.model,
                        inputs,
                        global_cells,
                        vp.vocab,
                        kwargs,
                        dtype=vp.dtype,
                        seed=self.seed,
                        epoch=e,
                        value=vp.name,
                        replica=rep,
                        score=rp.score,
                        score_inputs=score_inputs,
                    )
                )
                meta.append((rp, cells, rep))
        tm = time.perf_counter()
        try:
            results = self.backend.collect(self.backend.dispatch(items)) if items else None
        except ModelError as exc:
            self._locate_score_error(exc)
            raise
        model_seconds = time.perf_counter() - tm

        # check + agree per value, commit all values together at the boundary.
        per_value: dict[str, list[tuple[RulePlan, Tensor, int, Tensor, Tensor]]] = {}
        outputs = _item_outputs(results, len(items)) if results is not None else []
        for (rp, cells, rep), (prop, score) in zip(meta, outputs):
            # (a rule's own score ran on the worker: (n, k) float64 already)
            if score.dtype != torch.float64:
                score = score.double()
            if prop.dim() == 1:
                prop, score = prop.unsqueeze(1), score.unsqueeze(1)
            per_value.setdefault(rp.target, []).append((rp, cells, rep, prop, score))
        agreed = [self._agree(name, e, parts, snapshot) for name, parts in per_value.items()]

        commits = 0
        violations = 0
        attempts = 0
        for ve, n_commits, n_violations in agreed:
            self._apply(ve, e, n_commits)
            commits += n_commits
            attempts += int(ve.cells.numel())
            violations += n_violations
        self.epoch = e + 1
        rec = EpochRecord(
            e,
            [a[0] for a in agreed],
            sum(v.numel() for v in open_.values()),
            commits,
            attempts,
            violations,
            time.perf_counter() - t0,
            model_seconds,
        )
        for o in self.observers:
            o.on_epoch(self, rec)
        return rec

    def _locate_score_error(self, exc: ModelError) -> None:
        """A rule's score failed on the worker (R030/R031): point the error at the `score` call in
        the source (file:line:col), which the worker does not know."""
        if exc.span is not None or exc.code not in ("R030", "R031"):
            return
        for rp in self.plan.rules:
            if rp.name == exc.where.get("rule") and rp.ir.score is not None:
                exc.span = rp.ir.score.span
                return

    def _kwargs(self, rp: RulePlan, vp: ValuePlan, e: int) -> dict[str, Any]:
        """The model call's keyword arguments in epoch ``e``: the rule's literals, then the ones
        computed from ``e``, then ``epoch``, ``vocab`` and ``seed`` unless the rule sets them."""
        if not rp.epoch_args and "epoch" not in rp.kwargs:
            base = self._kwargs_base.get(rp.id)
            if base is None:
                base = self._kwargs_base[rp.id] = {"vocab": vp.vocab, "seed": self.seed}
                base.update(rp.kwargs)
            return {**base, "epoch": e}
        from lmpm.ir.eval import evaluate

        kwargs = dict(rp.kwargs)
        for k, ex in rp.epoch_args.items():
            kwargs[k] = evaluate(ex, self.plan.env | {"e": e})
        kwargs.setdefault("epoch", e)
        kwargs.setdefault("vocab", vp.vocab)
        kwargs.setdefault("seed", self.seed)
        return kwargs

    def _inputs(
        self, rp: RulePlan, cells: Tensor, snapshot: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """The model's inputs for ``cells``: per read, payload / mask / index, each (n, K)."""
        key = (rp.id, self.epoch)
        cached = self._input_cache.get(key)
        if cached is not None:
            return cached
        vp = self.plan.values[rp.target]
        n = cells.numel()
        inputs: dict[str, Tensor] = {"cells": cells, "coords": self._rows(vp.coords, cells)}
        for j, rd in enumerate(rp.reads):
            committed = self.state[rd.source].committed
            if rd.uniform:
                # Every cell reads the same cells: one row, broadcast as a view (no (n, K) copy).
                row = rd.index[0]
                k = row.numel()
                idx = row.expand(n, k)
                mask = (rd.valid[0] & committed.index_select(0, row)).expand(n, k)
                data = snapshot[rd.source].index_select(0, row).expand(n, k)
            else:
                idx = self._rows(rd.index, cells)  # (n, K)
                valid = self._rows(rd.valid, cells)
                # take: the flat gather of a 1-D state tensor, cheaper than advanced indexing
                mask = valid & committed.take(idx)
                data = snapshot[rd.source].take(idx)
                self._read_rows[(rp.id, j)] = (cells, idx, valid)
            for name in rd.args:
                inputs[name] = data  # (n, K) payload of the read cells
                inputs[f"{name}_mask"] = mask  # (n, K) visible and committed
                inputs[f"{name}_index"] = idx  # (n, K) flat index into the source value
        self._input_cache[key] = inputs
        return inputs

    def _rows(self, table: Tensor, cells: Tensor) -> Tensor:
        """``table[cells]`` for a static per-cell table of the plan (coordinates, gather tables, a
        constraint's cells). One open cell (causal generation): a view of its row. The fixed cell
        sets of the cyclic schedules (all, red-black, independent) recur every few epochs: their
        rows are gathered once (index_select, several times cheaper than advanced indexing)."""
        if cells.numel() == 1:
            if self._one[0] is not cells:
                self._one = (cells, int(cells[0]))
            return table.narrow(0, self._one[1], 1)
        key = (id(table), id(cells))
        hit = self._row_cache.get(key)
        if hit is not None and hit[0] is table and hit[1] is cells:
            return hit[2]
        rows = table.index_select(0, cells)
        if any(cells is c for c in self._cycle_cache.values()):
            self._row_cache[key] = (table, cells, rows)  # both kept alive: ids stay theirs
        return rows

    def _score_keys(self, rp: RulePlan, inputs: Mapping[str, Tensor]) -> tuple[str, ...]:
        """The model inputs a rule's score call receives: cells, coords and its reads' tensors."""
        keys = tuple(inputs)
        hit = self._score_key_cache.get(rp.id)
        if hit is None or hit[0] != keys:
            picked = tuple(
                k
                for k in keys
                if k in ("cells", "coords")
                or k.removesuffix("_mask").removesuffix("_index") in rp.score_args
            )
            hit = self._score_key_cache[rp.id] = (keys, picked)
        return hit[1]

    def _agree(
        self,
        name: str,
        e: int,
        parts: list[tuple[RulePlan, Tensor, int, Tensor, Tensor]],
        snapshot: Mapping[str, Tensor],
    ) -> tuple[ValueEpoch, int, int]:
        """Check and agree one value's candidates. Returns the record, its commits and its
        violations ((cell, candidate) pairs violating at least one constraint).

        Small epochs (one open cell per epoch in causal generation) are dominated by the fixed cost
        of each tensor operation, so this uses the cheapest equivalent form of each: index_select /
        take / gather for 1-D gathers, unsqueeze for new axes, count_nonzero for counts."""
        vp = self.plan.values[name]
        st = self.state[name]
        static = self._static[name]
        # Sorted, unique rows: a single rule's cells already are (they come from nonzero()).
        cells = parts[0][1] if len(parts) == 1 else torch.unique(torch.cat([p[1] for p in parts]))
        n = cells.numel()
        widths = [p[3].shape[1] for p in parts]
        ncol = 1 + sum(widths)
        current = snapshot[name].index_select(0, cells)
        fresh = not self._opens_committed  # every open cell is unset: nothing to gather about it
        if fresh:
            committed = self._const("unset", (n,), torch.bool, False)
            kept_score = self._const("unset", (n, 1), torch.float64, -math.inf)
        else:
            committed = st.committed.index_select(0, cells)
            kept_score = st.score.index_select(0, cells).unsqueeze(1)
        col_rule, col_rep, col_slot = self._columns(parts, widths)
        all_valid = len(parts) == 1  # every (cell, candidate) exists: no padding, nothing folded
        if len(parts) == 1:
            # One rule proposing for every row: the candidate table is keep | proposals.
            _, _, _, prop, sc = parts[0]
            prop = prop if prop.dtype == vp.dtype else prop.to(vp.dtype)
            payload = torch.cat((current.unsqueeze(1), prop), 1)
            valid = self._const("valid", (n, ncol), torch.bool, True)
            score = torch.cat((kept_score, sc), 1)
        else:
            payload = torch.zeros((n, ncol), dtype=vp.dtype)
            payload[:, 0] = current
            valid = torch.zeros((n, ncol), dtype=torch.bool)
            valid[:, 0] = True
            score = torch.full((n, ncol), -torch.inf, dtype=torch.float64)
            score[:, 0:1] = kept_score
            c = 1
            for (_, rcells, _, prop, sc), w in zip(parts, widths):
                rows = torch.searchsorted(cells, rcells)
                payload[rows, c : c + w] = prop.to(vp.dtype)
                valid[rows, c : c + w] = True
                score[rows, c : c + w] = sc
                c += w

        # A proposal equal to the committed payload *is* keep-current, freshly scored: fold it into
        # column 0 so a stale committed score never outranks the rule's current opinion.
        any_committed = self._opens_committed and bool(committed.any())
        if any_committed:
            same = (payload == current.unsqueeze(1)) & committed.unsqueeze(1)
            if not all_valid:
                same &= valid
            same.select(1, 0).fill_(False)
            rescored = torch.where(same, score, -torch.inf).amax(dim=1)
            score[:, 0] = torch.where(same.any(dim=1), rescored, score[:, 0])
            valid = valid.masked_fill(same, False)  # (not in place: valid may be a _const)
            all_valid = False

        # (n, C, K) violations: each constraint's verdicts, masked by the cells it speaks about and
        # by the candidates that exist. Masks are applied per (n, C) verdict: element-wise ops on
        # equal shapes are vectorized, broadcasts over the short candidate axis are not.
        cps = static.constraints
        k = len(cps)
        verdicts: list[Tensor] = []
        applies_cols: list[Tensor | None] = []
        for cp, whole, table in zip(cps, static.covers_all, static.tables):
            verdict = self._violations(
                cp, vp, cells, payload, valid, current, committed, any_committed, snapshot, e, table
            )
            where = None if whole else self._applies(cp, vp, cells)
            if where is not None:
                verdict = verdict & where.unsqueeze(1)
            if not all_valid:
                verdict = verdict & valid
            verdicts.append(verdict)
            applies_cols.append(where)
        if k == 0:
            violated = torch.zeros((n, ncol, 0), dtype=torch.bool)
            violations = 0
        else:
            violated = verdicts[0].unsqueeze(2) if k == 1 else torch.stack(verdicts, dim=2)
            any_violated = verdicts[0]
            for verdict in verdicts[1:]:
                any_violated = any_violated | verdict
            violations = int(any_violated.count_nonzero())
        if all(a is None for a in applies_cols):
            applies = self._const("applies", (n, k), torch.bool, True)
        else:
            ones = torch.ones(n, dtype=torch.bool)
            applies = torch.stack([ones if a is None else a for a in applies_cols], dim=1)

        agree = Agree(payload, valid, score, violated, static.priority, col_rule, col_rep, col_slot)
        decision = vp.policy(agree, *vp.policy_args)
        winner = decision.winner
        new_payload = decision.payload
        if new_payload.dtype != vp.dtype:
            new_payload = new_payload.to(vp.dtype)
        if any_committed:
            changed = (winner != 0) & (~committed | (new_payload != current))
        else:
            changed = winner != 0
        if self.plan.schedule.strategy == "confidence":
            quota = confidence_quota(
                e, self.plan.schedule.steps or 1, vp.ncells, int(st.committed.sum())
            )
            rows = torch.arange(n)
            conf = torch.where(
                changed, score[rows, winner], torch.full((n,), -torch.inf, dtype=torch.float64)
            )
            if int(changed.sum()) > quota:
                keep = torch.zeros(n, dtype=torch.bool)
                # stable sort: ties keep the lower cell first (deterministic)
                order = torch.sort(-conf, stable=True).indices[:quota]
                keep[order] = True
                changed &= keep
        commits = int(changed.count_nonzero())
        new_clock = self._clocks(st, static, cells, changed, commits, col_rule, winner, fresh)
        ve = ValueEpoch(
            name,
            cells,
            payload,
            valid,
            score,
            col_rule,
            violated,
            static.constraint_ids,
            winner,
            changed,
            new_payload,
            new_clock,
            committed,
            applies,
        )
        return ve, commits, violations

    def _clocks(
        self,
        st: CellState,
        static: _ValueStatic,
        cells: Tensor,
        changed: Tensor,
        commits: int,
        col_rule: Tensor,
        winner: Tensor,
        fresh: bool,
    ) -> Tensor:
        """(n,) Lamport clocks after the epoch: a committing cell's clock becomes 1 + max(its own
        clock, the clock of every cell its winning rule read). Clocks are never negative (0 until
        a cell's first commit), so an empty or invalid read contributes nothing. Computed for every
        open cell and kept where the cell commits (no boolean row selection). ``fresh``: every open
        cell is unset, so its own clock is 0 and the max is the reads' alone."""
        n = cells.numel()
        new_clock = (
            self._const("unset", (n,), torch.int64, 0) if fresh else st.clock.index_select(0, cells)
        )
        if commits == 0:
            return new_clock
        single = len(static.rules) == 1  # then every proposal column belongs to that rule
        rule = None if single else col_rule.index_select(0, winner)
        for rp in static.rules:
            sel = changed if rule is None else changed & (rule == rp.id)
            if rule is not None and not bool(sel.any()):
                continue
            read_max: Tensor | None = None
            for cr in self._clock_reads[rp.id]:
                src = self.state[cr.source].clock
                if cr.uniform:
                    top = src.index_select(0, cr.index).amax()  # (), broadcast over the cells
                    read_max = top if read_max is None else torch.maximum(read_max, top)
                    continue
                gathered = None if cr.read is None else self._read_rows.get((rp.id, cr.read))
                valid: Tensor | None
                if gathered is not None and gathered[0] is cells:
                    _, idx, valid = gathered  # the rows the model's inputs were gathered from
                else:
                    idx = self._rows(cr.index, cells)
                    valid = None if cr.valid is None else self._rows(cr.valid, cells)
                clocks = src.take(idx)  # (n, K)
                if valid is not None:
                    clocks = clocks * valid  # clocks are >= 0: zero is the max's identity
                top = clocks.squeeze(1) if clocks.shape[1] == 1 else clocks.amax(dim=1)
                read_max = top if read_max is None else torch.maximum(read_max, top)
            if read_max is None:
                bumped = new_clock + 1
            elif fresh and read_max.dim() == 1:
                bumped = read_max + 1  # max(0, read_max): clocks are never negative
            else:
                bumped = torch.maximum(new_clock, read_max) + 1
            whole = single and commits == cells.numel()
            new_clock = bumped if whole else torch.where(sel, bumped, new_clock)
        return new_clock

    def _const(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, fill: Any) -> Tensor:
        """A filled tensor, made once per (kind, shape, dtype): the fixed parts of an epoch's
        record (keep-current of unset cells, all-valid candidates). Never written in place: the
        records, policies and predicates that receive them treat their inputs as read-only."""
        key = (kind, shape, dtype)
        hit = self._const_cache.get(key)
        if hit is None:
            hit = self._const_cache[key] = torch.full(shape, fill, dtype=dtype)
        return hit

    def _columns(
        self, parts: list[tuple[RulePlan, Tensor, int, Tensor, Tensor]], widths: list[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(C,) rule id, replica and slot of each candidate column (-1: keep); cached per layout."""
        key = tuple((p[0].id, p[2], w) for p, w in zip(parts, widths))
        hit = self._column_cache.get(key)
        if hit is None:
            rule, rep, slot = [-1], [-1], [-1]
            for rid, replica, w in key:
                rule += [rid] * w
                rep += [replica] * w
                slot += list(range(w))
            hit = (torch.tensor(rule), torch.tensor(rep), torch.tensor(slot))
            self._column_cache[key] = hit
        return hit

    def _violations(
        self,
        cp: ConstraintPlan,
        vp: ValuePlan,
        cells: Tensor,
        payload: Tensor,
        valid: Tensor,
        current: Tensor,
        committed: Tensor,
        any_committed: bool,
        snapshot: Mapping[str, Tensor],
        e: int,
        table: Tensor | None,
    ) -> Tensor:
        """(n, C) bool: candidate violates the constraint, before masking by the cells it speaks
        about (:meth:`_applies`) and by the candidates that exist. Keep-current of an unset cell
        satisfies every `forbid` and violates every `require` (an unset cell is in no set).
        ``any_committed``: some cell is committed; ``table``: IN_SET's violation table (see
        :class:`_ValueStatic`)."""
        forbid = cp.kind == "forbid"
        if cp.pred == PredKind.IN_SET:
            assert table is not None
            tok = payload if payload.dtype == torch.int64 else payload.long()
            viol = table.take(tok.clamp(-1, table.numel() - 2))
        else:
            if cp.pred == PredKind.CHANGE:
                holds = (payload != current[:, None]) & committed[:, None]
                holds[:, 0] = False  # keep-current changes nothing (even a NaN payload)
            else:
                holds = self._user_predicate(
                    cp, vp, cells, payload, valid, current, committed, snapshot, e
                )
            viol = holds if forbid else ~holds
        # Column 0 (keep-current) of an unset cell: violates exactly the `require`s.
        if any_committed:
            if forbid:
                viol[:, 0] &= committed
            else:
                viol[:, 0] |= ~committed
        else:
            viol.select(1, 0).fill_(not forbid)
        return viol

    def _applies(self, cp: ConstraintPlan, vp: ValuePlan, cells: Tensor) -> Tensor:
        """(n,) bool: the constraint speaks about the cell (its access covers it)."""
        applies = self._rows(cp.cells, cells)
        if cp.needs_inputs_region:
            applies = applies & (self.state[vp.name].rule.index_select(0, cells) == INPUT_RULE)
        return applies

    def _user_predicate(
        self,
        cp: ConstraintPlan,
        vp: ValuePlan,
        cells: Tensor,
        payload: Tensor,
        valid: Tensor,
        current: Tensor,
        committed: Tensor,
        snapshot: Mapping[str, Tensor],
        e: int,
    ) -> Tensor:
        accesses = []
        for index, avalid in cp.accesses:
            idx = self._rows(index, cells)
            src = vp.name  # accesses of a constraint read the constrained value's snapshot
            mask = self._rows(avalid, cells) & self.state[src].committed.take(idx)
            accesses.append((snapshot[src].take(idx), mask, idx))
        ctx = PredicateInput(
            payload,
            valid,
            current,
            committed,
            cells,
            self._rows(vp.coords, cells),
            tuple(accesses),
            cp.literals,
            e,
        )
        assert cp.predicate is not None
        try:
            out = torch.as_tensor(cp.predicate(ctx))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: a predicate must not end the run
            raise ConstraintEvalError(
                f"predicate `{cp.ir.call.func if cp.ir.call else '?'}` of constraint `{cp.name}` raised "
                f"{type(exc).__name__}: {exc}",
                where={"constraint": cp.name, "epoch": e},
                span=cp.ir.span,
                code="R040",
            ) from exc
        if out.shape != payload.shape or out.dtype != torch.bool:
            raise ConstraintEvalError(
                f"predicate of constraint `{cp.name}` must return a bool tensor of shape "
                f"{tuple(payload.shape)} (cells, candidates), got {out.dtype} {tuple(out.shape)}",
                where={"constraint": cp.name, "epoch": e},
                span=cp.ir.span,
                code="R041",
            )
        return out.clone()

    def _apply(self, ve: ValueEpoch, e: int, commits: int) -> None:
        """Write the ``commits`` changed cells of ``ve`` (payload, metadata) at the epoch boundary."""
        if commits == 0:
            return
        st = self.state[ve.value]
        won_score = ve.score.gather(1, ve.winner.unsqueeze(1)).squeeze(1)
        won_rule = ve.col_rule.index_select(0, ve.winner)
        fields = [ve.cells, ve.new_payload, ve.new_clock, won_rule, won_score]
        if commits < ve.cells.numel():
            rows = ve.changed.nonzero().squeeze(1)
            fields = [t.index_select(0, rows) for t in fields]
        idx, payload, clock, rule, score = fields
        self.backend.update(self._key(ve.value), idx, payload)
        # index_put_ / index_fill_: `st.x[idx] = v` without the Python indexing machinery
        st.committed.index_fill_(0, idx, True)
        st.clock.index_put_((idx,), clock)
        st.rule.index_put_((idx,), rule)
        st.epoch.index_fill_(0, idx, e)
        st.score.index_put_((idx,), score)
