"""The constraint checks of a worker: every constraint of a value evaluated on every candidate of
its table, where the payload lives (built-in predicates as table lookups and comparisons, a user's
bound predicate called with copies), and the masks a lowered constraint puts on a model's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lmpm.errors import ConstraintEvalError, user_frame
from lmpm.ir.nodes import PredKind
from lmpm.resolve.plan import ConstraintPlan, Plan, RulePlan, ValuePlan
from lmpm.resolve.policies import aggregates
from lmpm.runtime.data.resident import Resident, ours, placed
from lmpm.runtime.records import AccessInput, PredicateInput
from lmpm.workers import MaskSets, VocabMask


@dataclass(frozen=True, slots=True)
class ValueTables:
    """What the worker needs about one proposed value, built once and kept on its device."""

    rules: tuple[RulePlan, ...]
    constraints: tuple[ConstraintPlan, ...]
    covers_all: tuple[bool, ...]  # per constraint: it speaks about every cell
    # IN_SET: (vocab + 2,) bool violation table indexed by the token clamped to [-1, vocab]: the
    # set for `forbid`, its complement for `require`, two trailing entries for out-of-vocabulary
    tables: tuple[Tensor | None, ...]
    cells: tuple[Tensor, ...]  # per constraint: (ncells,) bool cells it speaks about
    checksums: bool  # the value's policy compares payloads (quorum, user policies)
    folds: bool  # a proposal equal to the committed payload folds into keep-current (not for
    #              aggregating policies: it counts in the aggregate like any proposal)


class CandidateTable(NamedTuple):
    """One value's candidate table as the checks see it: ``n`` open cells, ``C`` candidates each
    (column 0 keep-current), in epoch ``epoch``."""

    name: str
    vp: ValuePlan
    epoch: int
    cells: Tensor  # (n,) flat cell ids
    table: Tensor  # (n, C, *cell) candidate payloads
    valid: Tensor  # (n, C) bool: the candidate exists
    current: Tensor  # (n, 1, *cell) committed payload, as a column (undefined where not committed)
    committed: Tensor  # (n,) bool before the epoch
    any_committed: bool  # some open cell is committed
    all_valid: bool  # every candidate exists (``valid`` all True)


def value_tables(
    plan: Plan, res: Resident, checksum_policies: frozenset[str]
) -> dict[str, ValueTables]:
    """Every proposed value's :class:`ValueTables` on ``res``'s device."""
    out: dict[str, ValueTables] = {}
    live = plan.live_constraints
    for name, rules in plan.rules_by_target.items():
        cps = tuple(live.get(name, []))
        tables: list[Tensor | None] = []
        for cp in cps:
            if cp.pred == PredKind.IN_SET:
                assert cp.table is not None
                table = torch.cat([cp.table, torch.zeros(2, dtype=torch.bool)])
                tables.append(res.dev(table if cp.kind == "forbid" else ~table))
            else:
                tables.append(None)
        vp = plan.values[name]
        out[name] = ValueTables(
            tuple(rules),
            cps,
            tuple(bool(cp.cells.all()) and not cp.needs_inputs_region for cp in cps),
            tuple(tables),
            tuple(res.dev(cp.cells) for cp in cps),
            vp.policy_text.split("(")[0] in checksum_policies,
            not aggregates(vp.policy, vp.policy_args),
        )
    return out


class Checks:
    """A worker's constraint checks over the resident state ``res`` (see the module doc)."""

    def __init__(
        self, plan: Plan, res: Resident, worker: str, checksum_policies: frozenset[str]
    ) -> None:
        self.plan = plan
        self.res = res
        self.worker = worker
        self.tables = value_tables(plan, res, checksum_policies)
        self._col0 = torch.zeros(1, dtype=torch.int64, device=res.device)  # keep-current's column
        self._applies_all: dict[tuple[int, int], Tensor] = {}  # (n, K): every verdict counts
        # per value with a lowered mask (lmpm.resolve.masks): its sets on this device, and the
        # index of each lowered constraint among the value's live ones
        self.masks: dict[str, tuple[MaskSets, tuple[int, ...]]] = {}
        for name, vm in plan.masks.items():
            at = [cp.id for cp in self.tables[name].constraints]
            sets = vm.sets
            self.masks[name] = (
                MaskSets(res.dev(sets.ok), sets.levels, sets.hard),
                tuple(at.index(cid) for cid in vm.constraints),
            )
        # the user's bound predicates on this worker's device (docs/runtime.md, "Devices")
        self.predicates: dict[int, Any] = {
            cp.id: placed(cp.predicate, res.device)
            for cp in plan.constraints
            if cp.predicate is not None and not ours(cp.predicate)
        }

    def check(self, ct: CandidateTable, tabs: ValueTables) -> tuple[Tensor, Tensor]:
        """(n, C, K) violations of ``ct``'s candidates (its value's constraints: ``tabs``), masked
        by the cells each constraint speaks about and by the candidates that exist, and the (n, K)
        applies mask."""
        name, cells, valid = ct.name, ct.cells, ct.valid
        n, ncol = valid.shape
        k = len(tabs.constraints)
        res = self.res
        dev = res.device
        if k == 0:
            return (
                torch.zeros((n, ncol, 0), dtype=torch.bool, device=dev),
                torch.ones((n, 0), dtype=torch.bool, device=dev),
            )
        verdicts: tuple[Tensor, ...] = ()
        applies_cols: tuple[Tensor | None, ...] = ()
        everywhere = True  # every constraint speaks about every open cell
        active = res.active
        for cp, whole, vtable, ccells in zip(
            tabs.constraints, tabs.covers_all, tabs.tables, tabs.cells
        ):
            if active is not None and cp.id not in active:
                # not in the RuleSet this epoch: not evaluated, speaks about no cell
                verdicts += (torch.zeros((n, ncol), dtype=torch.bool, device=dev),)
                applies_cols += (torch.zeros(n, dtype=torch.bool, device=dev),)
                everywhere = False
                continue
            verdict = self.violations(cp, ct, vtable)
            if whole:
                where = None
            else:
                phase = res.phase.get(name)
                where = res.rows(ccells, cells, None if phase is None else ("cp", cp.id, phase))
                if cp.needs_inputs_region:
                    where = where & res.from_input[name].index_select(0, cells)
                verdict = verdict & where.unsqueeze(1)
                everywhere = False
            if not ct.all_valid:
                verdict = verdict & valid
            verdicts += (verdict,)
            applies_cols += (where,)
        violated = verdicts[0].unsqueeze(2) if k == 1 else torch.stack(verdicts, dim=2)
        if everywhere:  # one all-True mask per shape (read only, as the replies are)
            applies = self._applies_all.get((n, k))
            if applies is None:
                applies = self._applies_all[(n, k)] = res.ones((n, k))
        else:
            ones = torch.ones(n, dtype=torch.bool, device=dev)
            applies = torch.stack([ones if a is None else a for a in applies_cols], dim=1)
        return violated, applies

    def violations(self, cp: ConstraintPlan, ct: CandidateTable, vtable: Tensor | None) -> Tensor:
        """(n, C) bool: candidate violates the constraint, before masking (``vtable``: its
        :attr:`ValueTables.tables` entry). Keep-current of an unset cell satisfies every `forbid`
        and violates every `require`."""
        table, committed = ct.table, ct.committed
        forbid = cp.kind == "forbid"
        if cp.pred == PredKind.IN_SET:
            assert vtable is not None
            tok = table if table.dtype == torch.int64 else table.long()
            viol = vtable.take(tok.clamp(-1, vtable.shape[0] - 2))
        else:
            if cp.pred == PredKind.CHANGE:
                differs = table != ct.current
                if ct.vp.cell_shape:
                    differs = differs.flatten(2).any(dim=2)
                holds = differs & committed.unsqueeze(1)
                holds[:, 0] = False  # keep-current changes nothing (even a NaN payload)
            else:
                holds = self.user_predicate(cp, ct)
            viol = holds if forbid else ~holds
        if ct.any_committed:
            if forbid:
                viol[:, 0] &= committed
            else:
                viol[:, 0] |= ~committed
        else:  # (one indexed fill: a select and a fill are two operations)
            viol.index_fill_(1, self._col0, not forbid)
        return viol

    def user_predicate(self, cp: ConstraintPlan, ct: CandidateTable) -> Tensor:
        """(n, C) bool: a user's bound predicate holds on ``ct``'s candidates, called with copies
        (:class:`~lmpm.runtime.records.PredicateInput`)."""
        vp, cells, valid, e = ct.vp, ct.cells, ct.valid, ct.epoch
        res = self.res
        accesses = []
        payload = res.payload[vp.name]
        for index, avalid in cp.accesses:
            idx = res.rows(index, cells)
            mask = res.rows(avalid, cells) & res.committed[vp.name].take(idx)
            data = payload.index_select(0, idx.reshape(-1)).reshape(*idx.shape, *vp.cell_shape)
            accesses.append(AccessInput(data, mask, idx))
        ctx = PredicateInput(
            ct.table.clone(),
            valid.clone(),
            ct.current.squeeze(1).clone(),
            ct.committed.clone(),
            cells.clone(),
            res.rows(vp.coords, cells),
            tuple(accesses),
            cp.literals,
            e,
        )
        assert cp.predicate is not None
        predicate = self.predicates.get(cp.id, cp.predicate)
        try:
            out = torch.as_tensor(predicate(ctx))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: a predicate must not end the run
            func = cp.ir.call.func if cp.ir.call else "?"
            raise self._refused(
                cp,
                e,
                f"predicate `{func}` of constraint `{cp.name}` raised "
                f"{type(exc).__name__}: {exc}{user_frame(exc)}",
                "R040",
            ) from exc
        if tuple(out.shape) != tuple(valid.shape) or out.dtype != torch.bool:
            raise self._refused(
                cp,
                e,
                f"predicate of constraint `{cp.name}` must return a bool tensor of shape "
                f"{tuple(valid.shape)} (cells, candidates), got {out.dtype} {tuple(out.shape)}",
                "R041",
            )
        if out.device != valid.device:  # (host metadata: no device sync)
            raise self._refused(
                cp,
                e,
                f"predicate of constraint `{cp.name}` returned its verdicts on {out.device}; "
                f"it gets its candidates on {valid.device} and must answer there "
                '(docs/runtime.md, "Devices")',
                "R041",
                hint="compute the verdicts from the candidates (`ctx.candidates.norm(dim=2) <= b`),"
                " or make new tensors with `device=ctx.candidates.device`",
            )
        return out.clone()

    def _refused(
        self, cp: ConstraintPlan, e: int, message: str, code: str, hint: str | None = None
    ) -> ConstraintEvalError:
        """The error for a bound predicate's call in epoch ``e``, pointed at its call site."""
        return ConstraintEvalError(
            message,
            where={"constraint": cp.name, "epoch": e, "worker": self.worker},
            span=cp.ir.call.span if cp.ir.call is not None else cp.ir.span,
            code=code,
            hint=hint,
        )

    def vocab_mask(self, rp: RulePlan, cells: Tensor, fresh: bool) -> VocabMask | None:
        """The mask on ``rp``'s logits for ``cells`` this epoch (None: its value has none, or the
        rule gets none): which lowered constraints speak about each cell (their cells, the
        `inputs()` region, the RuleSet) and, where the schedule may open committed cells
        (``fresh`` False), each cell's committed token (-1: unset)."""
        got = self.masks.get(rp.target)
        if got is None or rp.id not in self.plan.masks[rp.target].rules:
            return None
        sets, at = got
        name = rp.target
        tabs = self.tables[name]
        res = self.res
        n = cells.numel()
        active = res.active
        if active is None and all(tabs.covers_all[j] for j in at):
            applies = res.ones((n, len(at)))
        else:
            phase = res.phase.get(name)
            cols = []
            for j in at:
                cp = tabs.constraints[j]
                if active is not None and cp.id not in active:
                    cols.append(torch.zeros(n, dtype=torch.bool, device=res.device))
                    continue
                key = None if phase is None else ("cp", cp.id, phase)
                where = res.rows(tabs.cells[j], cells, key)
                if cp.needs_inputs_region:
                    where = where & res.from_input[name].index_select(0, cells)
                cols.append(where)
            applies = torch.stack(cols, dim=1)
        current = None
        if not fresh:  # the schedule may open committed cells: each one's token, -1 where unset
            committed = res.committed[name].index_select(0, cells)
            current = torch.where(committed, res.payload[name].index_select(0, cells), -1)
        return VocabMask(sets, applies, current)
