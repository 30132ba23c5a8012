"""The consensual epoch loop: compute → propose → check → agree → commit.

Every per-cell decision is a tensor operation over all open cells (state as tensors, decisions by
advanced indexing); Python loops run over rules, constraints and values only. Reads see the state at
the start of the epoch; winners are applied together at the epoch boundary, so an epoch's result does
not depend on the order in which work ran.

The control plane (this module) holds metadata only: committed flags, Lamport clocks, provenance,
scores. Payload tensors are resident on the worker backend (``backend.put/get/update``).
"""

from __future__ import annotations

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
from lmpm.workers import WorkItem, get_backend
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
        self._started = False
        self._input_cache: dict[tuple[int, int], dict[str, Tensor]] = {}
        self._parity: dict[str, Tensor] = {}  # red-black colour of each cell, per value
        self._column_cache: dict[
            tuple[tuple[int, int, int], ...], tuple[Tensor, Tensor, Tensor]
        ] = {}
        self._meta_cache: dict[str, tuple[Tensor, Tensor]] = {}

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
        t0 = time.perf_counter()
        while self.epoch < limit:
            if quiet >= self.stable_period() and (until_stable or epochs is None):
                res.stable = True  # a resumed run that had already become stable
                break
            rec = self.step()
            res.epochs += 1
            res.commits += rec.commits
            res.attempts += rec.attempts
            res.model_seconds += rec.model_seconds
            if self.keep_records:
                res.records.append(rec)
            if progress is not None:
                progress(rec)
            quiet = quiet + 1 if rec.commits == 0 else 0
            if quiet >= self.stable_period() and (until_stable or epochs is None):
                res.stable = True
                break
        res.seconds = time.perf_counter() - t0
        for o in self.observers:
            o.on_end(self)
        return res

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
        spec = self.plan.schedule
        out: dict[str, Tensor] = {}
        for name in self._by_target:
            vp = self.plan.values[name]
            st = self.state[name]
            n = vp.ncells
            if spec.strategy == "all":
                m = torch.ones(n, dtype=torch.bool)
            elif spec.strategy == "red-black":
                if name not in self._parity:
                    self._parity[name] = red_black(vp.coords)
                m = self._parity[name] == (e % 2)
            elif spec.strategy == "independent":
                colors = self.plan.colors[name]
                ncol = int(colors.max()) + 1 if n else 1
                m = colors == (e % ncol)
            elif spec.strategy == "raster":
                un = (~st.committed).nonzero().squeeze(1)[: spec.k]
                m = torch.zeros(n, dtype=torch.bool)
                m[un] = True
            elif spec.strategy == "random":
                u = lrng.uniform(self.seed, name, torch.arange(n), e, "schedule")[:, 0]
                u = torch.where(st.committed, torch.full_like(u, 2.0), u)
                m = torch.zeros(n, dtype=torch.bool)
                m[u.argsort()[: spec.k]] = True
                m &= ~st.committed
            else:  # confidence: every unset cell proposes; commits are limited after agreement
                m = ~st.committed
            out[name] = m
        return out

    def step(self) -> EpochRecord:
        """One epoch. Nothing is committed unless every part of the epoch succeeded."""
        # No autograd anywhere in an epoch: inference mode skips its per-op bookkeeping.
        with torch.inference_mode():
            return self._step()

    def _step(self) -> EpochRecord:
        e = self.epoch
        t0 = time.perf_counter()
        open_ = self._open(e)
        self.maskplan.add(("open", e, tuple(sorted((k, int(v.sum())) for k, v in open_.items()))))

        # propose: dispatch every rule's work first, then collect (the only blocking point).
        items: list[WorkItem] = []
        meta: list[tuple[RulePlan, Tensor, int]] = []
        snapshot = {name: self.payload(name) for name in self.plan.values}
        for rp in self.plan.rules:
            vp = self.plan.values[rp.target]
            fire = open_.get(rp.target)
            if fire is None:
                continue
            if rp.trigger != TRUE:
                env: dict[str, Any] = dict(self.plan.env)
                env["e"] = e
                env.update({v: vp.coords[:, k] for k, v in enumerate(rp.ir.vars)})
                fire = fire & mask_of(rp.trigger, env, vp.ncells)
            cells = fire.nonzero().squeeze(1)
            if cells.numel() == 0:
                continue
            inputs = self._inputs(rp, cells, snapshot)
            kwargs = dict(rp.kwargs)
            for k, ex in rp.epoch_args.items():
                from lmpm.ir.eval import evaluate

                kwargs[k] = evaluate(ex, self.plan.env | {"e": e})
            kwargs.setdefault("epoch", e)
            kwargs.setdefault("vocab", vp.vocab)
            kwargs.setdefault("seed", self.seed)
            for rep in range(rp.replicas):
                items.append(
                    WorkItem(
                        rp.name,
                        rp.model,
                        inputs,
                        cells + vp.offset,
                        vp.vocab,
                        kwargs,
                        dtype=vp.dtype,
                        seed=self.seed,
                        epoch=e,
                        value=vp.name,
                        replica=rep,
                    )
                )
                meta.append((rp, cells, rep))
        tm = time.perf_counter()
        results = self.backend.collect(self.backend.dispatch(items)) if items else None
        model_seconds = time.perf_counter() - tm

        # check + agree per value, commit all values together at the boundary.
        per_value: dict[str, list[tuple[RulePlan, Tensor, int, Tensor, Tensor]]] = {}
        for i, (rp, cells, rep) in enumerate(meta):
            assert results is not None
            r = results[i]
            prop, score = r.proposal, r.score.to(torch.float64)
            if prop.dim() == 1:
                prop, score = prop[:, None], score[:, None]
            if rp.score is not None:
                ts = time.perf_counter()
                score = self._score(rp, cells, snapshot, prop)
                model_seconds += time.perf_counter() - ts
            per_value.setdefault(rp.target, []).append((rp, cells, rep, prop, score))
        records = [self._agree(name, e, parts, snapshot) for name, parts in per_value.items()]

        commits = 0
        violations = 0
        attempts = 0
        for ve in records:
            self._apply(ve, e)
            commits += int(ve.changed.sum())
            attempts += int(ve.cells.numel())
            violations += int(ve.violated.any(dim=2).sum())
        self.epoch = e + 1
        rec = EpochRecord(
            e,
            records,
            sum(int(m.sum()) for m in open_.values()),
            commits,
            attempts,
            violations,
            time.perf_counter() - t0,
            model_seconds,
        )
        for o in self.observers:
            o.on_epoch(self, rec)
        return rec

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
        inputs: dict[str, Tensor] = {"cells": cells, "coords": vp.coords[cells]}
        for rd in rp.reads:
            committed = self.state[rd.source].committed
            if rd.uniform:
                # Every cell reads the same cells: one row, broadcast as a view (no (n, K) copy).
                row = rd.index[0]
                k = row.numel()
                idx = row.expand(n, k)
                mask = (rd.valid[0] & committed[row]).expand(n, k)
                data = snapshot[rd.source][row].expand(n, k)
            else:
                idx = rd.index[cells]  # (n, K)
                mask = rd.valid[cells] & committed[idx]
                data = snapshot[rd.source][idx]
            for name in rd.args:
                inputs[name] = data  # (n, K) payload of the read cells
                inputs[f"{name}_mask"] = mask  # (n, K) visible and committed
                inputs[f"{name}_index"] = idx  # (n, K) flat index into the source value
        self._input_cache = {key: inputs}
        return inputs

    def _score(
        self, rp: RulePlan, cells: Tensor, snapshot: Mapping[str, Tensor], prop: Tensor
    ) -> Tensor:
        inputs = self._inputs(rp, cells, snapshot)
        args = {
            k: v
            for k, v in inputs.items()
            if k in ("cells", "coords")
            or k.removesuffix("_mask").removesuffix("_index") in rp.score_args
        }
        args["proposal"] = prop
        assert rp.score is not None
        try:
            out = torch.as_tensor(rp.score(args, epoch=self.epoch))
        except Exception as exc:
            raise ModelError(
                f"score `{rp.ir.score.func if rp.ir.score else '?'}` raised "
                f"{type(exc).__name__}: {exc}",
                where={"rule": rp.name, "cells": cells[:5].tolist(), "backend": "control"},
                span=rp.ir.score.span if rp.ir.score else None,
                code="R030",
            ) from exc
        if out.shape != prop.shape[:2] or not bool(torch.isfinite(out).all()):
            raise ModelError(
                f"score of rule `{rp.name}` must be finite with shape {tuple(prop.shape[:2])}, "
                f"got {tuple(out.shape)}",
                where={"rule": rp.name, "cells": cells[:5].tolist()},
                code="R031",
            )
        return out.to(torch.float64)

    def _agree(
        self,
        name: str,
        e: int,
        parts: list[tuple[RulePlan, Tensor, int, Tensor, Tensor]],
        snapshot: Mapping[str, Tensor],
    ) -> ValueEpoch:
        vp = self.plan.values[name]
        st = self.state[name]
        # Sorted, unique rows: a single rule's cells already are (they come from nonzero()).
        cells = parts[0][1] if len(parts) == 1 else torch.unique(torch.cat([p[1] for p in parts]))
        n = cells.numel()
        widths = [p[3].shape[1] for p in parts]
        ncol = 1 + sum(widths)
        current = snapshot[name][cells]
        col_rule, col_rep, col_slot = self._columns(parts, widths)
        if len(parts) == 1:
            # One rule proposing for every row: the candidate table is keep | proposals.
            _, _, _, prop, sc = parts[0]
            payload = torch.cat([current[:, None], prop.to(vp.dtype)], dim=1)
            valid = torch.ones((n, ncol), dtype=torch.bool)
            score = torch.cat([st.score[cells][:, None], sc], dim=1)
        else:
            payload = torch.zeros((n, ncol), dtype=vp.dtype)
            payload[:, 0] = current
            valid = torch.zeros((n, ncol), dtype=torch.bool)
            valid[:, 0] = True
            score = torch.full((n, ncol), -torch.inf, dtype=torch.float64)
            score[:, 0] = st.score[cells]
            c = 1
            for (_, rcells, _, prop, sc), w in zip(parts, widths):
                rows = torch.searchsorted(cells, rcells)
                payload[rows, c : c + w] = prop.to(vp.dtype)
                valid[rows, c : c + w] = True
                score[rows, c : c + w] = sc
                c += w

        # A proposal equal to the committed payload *is* keep-current, freshly scored: fold it into
        # column 0 so a stale committed score never outranks the rule's current opinion.
        committed = st.committed[cells]
        same = valid & (payload == current[:, None]) & committed[:, None]
        same[:, 0] = False
        fresh = torch.where(same, score, torch.full_like(score, -torch.inf)).max(dim=1).values
        score[:, 0] = torch.where(same.any(dim=1), fresh, score[:, 0])
        valid &= ~same

        cps = self._constraints.get(name, [])
        violated = torch.zeros((n, ncol, len(cps)), dtype=torch.bool)
        applies = torch.zeros((n, len(cps)), dtype=torch.bool)
        for k, cp in enumerate(cps):
            applies[:, k] = self._applies(cp, vp, cells)
            violated[:, :, k] = self._violations(
                cp, vp, cells, payload, valid, current, committed, snapshot, e, applies[:, k]
            )
        priority, constraint_ids = self._constraint_meta(name)
        agree = Agree(payload, valid, score, violated, priority, col_rule, col_rep, col_slot)
        decision = vp.policy(agree, *vp.policy_args)
        winner = decision.winner
        new_payload = decision.payload.to(vp.dtype)
        changed = (winner != 0) & (~committed | (new_payload != current))
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
        # Lamport: clock = 1 + max(own clock, clock of every cell the winning rule read).
        new_clock = st.clock[cells].clone()
        for rp in self._by_target.get(name, []):
            sel = changed & (col_rule[winner] == rp.id)
            if not bool(sel.any()):
                continue
            rc = cells[sel]
            read_max = torch.zeros(rc.numel(), dtype=torch.int64)
            for rd in rp.reads:
                clock = self.state[rd.source].clock
                if rd.index.shape[1] == 0:
                    continue
                if rd.uniform:
                    row = rd.index[0][rd.valid[0]]
                    top = clock[row].max() if row.numel() else torch.tensor(0)
                    read_max = torch.maximum(read_max, top.expand_as(read_max))
                else:
                    clocks = torch.where(rd.valid[rc], clock[rd.index[rc]], 0)
                    read_max = torch.maximum(read_max, clocks.max(dim=1).values)
            new_clock[sel] = 1 + torch.maximum(new_clock[sel], read_max)
        return ValueEpoch(
            name,
            cells,
            payload,
            valid,
            score,
            col_rule,
            violated,
            constraint_ids,
            winner,
            changed,
            new_payload,
            new_clock,
            committed,
            applies,
        )

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

    def _constraint_meta(self, value: str) -> tuple[Tensor, Tensor]:
        """(K,) priorities and plan ids of the constraints evaluated on ``value``."""
        hit = self._meta_cache.get(value)
        if hit is None:
            cps = self._constraints.get(value, [])
            hit = (
                torch.tensor([cp.priority for cp in cps], dtype=torch.int64),
                torch.tensor([cp.id for cp in cps], dtype=torch.int64),
            )
            self._meta_cache[value] = hit
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
        snapshot: Mapping[str, Tensor],
        e: int,
        applies: Tensor,
    ) -> Tensor:
        """(n, C) bool: candidate violates the constraint. Keep-current of an unset cell satisfies
        every `forbid` and violates every `require` (an unset cell is in no set). ``applies``: (n,)
        from :meth:`_applies`."""
        applies = applies[:, None]
        forbid = cp.kind == "forbid"
        if cp.pred == PredKind.CHANGE:
            holds = (payload != current[:, None]) & committed[:, None]
            holds[:, 0] = False
        elif cp.pred == PredKind.IN_SET:
            assert cp.table is not None
            tok = payload.long().clamp(0, cp.table.numel() - 1)
            holds = cp.table[tok] & (payload.long() >= 0) & (payload.long() < cp.table.numel())
            holds[:, 0] &= committed
        else:
            holds = self._user_predicate(
                cp, vp, cells, payload, valid, current, committed, snapshot, e
            )
            if forbid:
                holds[:, 0] &= committed
        viol = holds if forbid else ~holds
        if not forbid:
            viol[:, 0] |= ~committed
        return viol & applies & valid

    def _applies(self, cp: ConstraintPlan, vp: ValuePlan, cells: Tensor) -> Tensor:
        """(n,) bool: the constraint speaks about the cell (its access covers it)."""
        applies = cp.cells[cells]
        if cp.needs_inputs_region:
            applies = applies & (self.state[vp.name].rule[cells] == INPUT_RULE)
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
            idx = index[cells]
            src = vp.name  # accesses of a constraint read the constrained value's snapshot
            mask = avalid[cells] & self.state[src].committed[idx]
            accesses.append((snapshot[src][idx], mask, idx))
        ctx = PredicateInput(
            payload,
            valid,
            current,
            committed,
            cells,
            vp.coords[cells],
            tuple(accesses),
            cp.literals,
            e,
        )
        assert cp.predicate is not None
        try:
            out = torch.as_tensor(cp.predicate(ctx))
        except Exception as exc:
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

    def _apply(self, ve: ValueEpoch, e: int) -> None:
        st = self.state[ve.value]
        rows = ve.changed.nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        idx = ve.cells[rows]
        self.backend.update(self._key(ve.value), idx, ve.new_payload[rows])
        st.committed[idx] = True
        st.clock[idx] = ve.new_clock[rows]
        st.rule[idx] = ve.col_rule[ve.winner[rows]]
        st.epoch[idx] = e
        st.score[idx] = ve.score[rows, ve.winner[rows]]
