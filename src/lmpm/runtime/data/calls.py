"""The model calls of a worker: every fired rule's work items (inputs gathered by
:mod:`lmpm.runtime.data.inputs`, the logit masks of :mod:`lmpm.runtime.data.checks`) dispatched
to the backend together before any is collected, and each replica's proposals and scores shaped
as (n, k, *cell) and (n, k) float64.

The models called are, per rule: the compiled one (``lmpm_compile`` under ``--compile``), else the
user's bound one moved to the worker's device once (docs/runtime.md, "Devices"), else the plan's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lmpm.errors import ModelError
from lmpm.models.compile import compiled_model
from lmpm.resolve.plan import Plan, RulePlan, ValuePlan
from lmpm.runtime.data.checks import Checks
from lmpm.runtime.data.inputs import ModelInputs
from lmpm.runtime.data.resident import Resident, ours, placed
from lmpm.runtime.protocol import ProposeRequest
from lmpm.workers import Results, WorkItem


class Proposal(NamedTuple):
    """One rule replica's proposals for a value."""

    rule: RulePlan
    cells: Tensor  # (n,) the open cells it proposed for, on the worker's device
    replica: int
    proposals: Tensor  # (n, k, *cell)
    scores: Tensor  # (n, k) float64


def item_outputs(results: Results, n_items: int) -> list[tuple[Tensor, Tensor]]:
    """(proposal, score) of every dispatched item, in dispatch order."""
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


def corrupt(prop: Tensor, vp: ValuePlan) -> Tensor:
    """Injected corruption: every proposal changed to another valid payload (the next token of
    the vocabulary, or the number plus 1), so it differs from what the model proposed."""
    if prop.is_floating_point():
        return prop + 1
    return (prop + 1) % vp.vocab if vp.vocab else prop + 1


class ModelCalls:
    """A worker's model calls on ``backend`` (see the module doc)."""

    def __init__(
        self,
        plan: Plan,
        res: Resident,
        backend: Any,
        worker: str,
        inputs: ModelInputs,
        checks: Checks,
    ) -> None:
        self.plan = plan
        self.res = res
        self.backend = backend
        self.worker = worker
        self.inputs = inputs
        self.checks = checks
        # rule id -> (model, score) the worker calls instead of the plan's (compile_models)
        self.models: dict[int, tuple[Any, Any]] = {}
        # the user's bound models and scores on this worker's device (an nn.Module moved once,
        # here; docs/runtime.md, "Devices"): rule id -> (model, score)
        dev = res.device
        self.placed: dict[int, tuple[Any, Any]] = {
            rp.id: (placed(rp.model, dev), placed(rp.score, dev) if rp.score else None)
            for rp in plan.rules
            if not ours(rp.model) or (rp.score is not None and not ours(rp.score))
        }
        self.work_cells: dict[int, Tensor] = {}  # rule id -> this epoch's cells, on the host

    def run(
        self, req: ProposeRequest, seed: int, corrupt_from: int | None
    ) -> tuple[dict[str, list[Proposal]], float]:
        """Gather every fired rule's reads, run all models and scores: per value, each rule
        replica's (rule, cells, replica, proposals (n, k, *cell), scores (n, k)); and the seconds
        the models took. From epoch ``corrupt_from`` on every proposal is corrupted."""
        e = req.epoch
        res, gather = self.res, self.inputs
        res.phase = dict(req.phases or {})
        res.active = req.active
        items: list[WorkItem] = []
        meta: list[tuple[RulePlan, Tensor, int]] = []
        models = self.models
        for rw in req.rules:
            rp = self.plan.rules[rw.rule]
            # compiled (compile_models), else moved to this device (placed), else as bound
            model, score = models.get(rp.id) or self.placed.get(rp.id) or (rp.model, rp.score)
            vp = self.plan.values[rp.target]
            cells = res.here(rw.cells)
            self.work_cells[rp.id] = rw.cells  # (on the host)
            clocked = "clocks" in gather.read_opts.get(rp.id, ())
            if clocked:  # the write clock of this rule's previous call (-1: none this generation)
                gather.since[rp.id] = gather.read_clocks.since(rp.id)
            inputs = gather.gather(rp, cells, rw.cells)
            kwargs = gather.kwargs(rp, vp, e)
            if clocked:  # (kwargs: this call's own dict)
                kwargs["generation"] = gather.read_clocks.generation
                gather.read_clocks.called(rp.id)
            own = inputs["cells"]
            global_cells = own + vp.offset if vp.offset else own
            score_inputs = gather.score_keys(rp, inputs) if rp.score else ()
            for rep in range(rp.replicas) if rw.replicas is None else rw.replicas:
                items.append(
                    WorkItem(
                        rp.name,
                        model,
                        inputs,
                        global_cells,
                        vp.vocab,
                        kwargs,
                        dtype=vp.dtype,
                        seed=seed,
                        epoch=e,
                        value=vp.name,
                        replica=rep,
                        score=score,
                        score_inputs=score_inputs,
                        mask=self.checks.vocab_mask(rp, cells, req.fresh.get(rp.target, False)),
                    )
                )
                meta.append((rp, cells, rep))
        tm = time.perf_counter()
        try:
            results = self.backend.collect(self.backend.dispatch(items)) if items else None
        except ModelError as exc:
            self.locate_model_error(exc)
            raise
        model_seconds = time.perf_counter() - tm

        per_value: dict[str, list[Proposal]] = {}
        outputs = item_outputs(results, len(items)) if results is not None else []
        corrupting = corrupt_from is not None and e >= corrupt_from
        for (rp, cells, rep), (prop, score) in zip(meta, outputs):
            vp = self.plan.values[rp.target]
            prop, score = self.shape(rp, vp, prop, score)
            if corrupting:
                prop = corrupt(prop, vp)
            per_value.setdefault(rp.target, []).append(Proposal(rp, cells, rep, prop, score))
        return per_value, model_seconds

    def shape(
        self, rp: RulePlan, vp: ValuePlan, prop: Tensor, score: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Proposals as (n, k, *cell) and scores as (n, k) float64; a wrong rank is the model's
        fault, named with its rule."""
        if score.dtype != torch.float64:
            score = score.double()
        cdims = len(vp.cell_shape)
        rank = prop.dim()
        if rank == 1 + cdims and score.dim() == 1:
            prop, score = prop.unsqueeze(1), score.unsqueeze(1)
            rank += 1
        if rank != 2 + cdims or (cdims and tuple(prop.shape[2:]) != vp.cell_shape):
            raise ModelError(
                f"rule `{rp.name}` proposed a tensor of shape {tuple(prop.shape)}; `{vp.name}` "
                f"holds cells of shape {vp.cell_shape or '()'}, so proposals must be "
                f"(cells, k{''.join(', ' + str(d) for d in vp.cell_shape)}) or "
                f"(cells{''.join(', ' + str(d) for d in vp.cell_shape)})",
                where={"rule": rp.name, "backend": self.backend.name, "worker": self.worker},
                span=rp.ir.proposal.span,
                code="R054",  # the wrong rank (lmpm.workers.batch.R_RANK)
            )
        return prop, score

    def locate_model_error(self, exc: ModelError) -> None:
        """Point a rule's failed model call at its source: a failed score (R030/R031) at the
        `score` call, a failed model (R05x) at the `emit proposal` call."""
        if exc.span is not None:
            return
        for rp in self.plan.rules:
            if rp.name != exc.where.get("rule"):
                continue
            if exc.code in ("R030", "R031") and rp.ir.score is not None:
                exc.span = rp.ir.score.span
            elif exc.code is not None and exc.code.startswith("R05"):
                exc.span = rp.ir.proposal.span
            return

    def model_of(self, rp: RulePlan) -> Any:
        """The model this worker calls for ``rp``: compiled (compile_models), else moved to its
        device, else as bound (what :meth:`run` calls)."""
        return (self.models.get(rp.id) or self.placed.get(rp.id) or (rp.model, None))[0]

    def on_device(
        self, rules: list[tuple[RulePlan, Tensor, Tensor]], phases: dict[str, int | None], e: Tensor
    ) -> dict[str, tuple[RulePlan, Tensor, Tensor, Tensor, Tensor]]:
        """Inside a window's capture (lmpm.runtime.data.kepochs): every rule's reads and its
        capturable model on (host cells, device cells), ``e`` a 0-d device tensor: per value
        (rule, host cells, cells, proposals (n, k, *cell), scores (n, k) float64)."""
        self.res.phase = dict(phases)
        out = {}
        for rp, on_host, cells in rules:
            model = self.model_of(rp)
            vp = self.plan.values[rp.target]
            inputs = self.inputs.gather(rp, cells, on_host)
            got = model(inputs, **{**self.inputs.kwargs(rp, vp, 0), "epoch": e})
            if isinstance(got, Mapping):
                got = (got.get("proposal"), got.get("score"))
            if not (isinstance(got, tuple | list) and len(got) == 2):
                got = (None, None)
            prop, score = got
            if not (isinstance(prop, Tensor) and isinstance(score, Tensor)):
                raise ModelError(
                    f"the model bound to rule '{rp.name}' declares lmpm_capture but did not "
                    "return (proposal, score) tensors",
                    where={"rule": rp.name, "worker": self.worker},
                    code="R052",
                    hint="a capturable model returns (proposal, score); else drop lmpm_capture",
                )
            prop, score = self.shape(rp, vp, prop, score)
            out[rp.target] = (rp, on_host, cells, prop, score)
        return out

    def compile_models(self) -> dict[str, tuple[Any, Any]]:
        """Call the compiled version of every model and score that opted in (``lmpm_compile``,
        lmpm.models.compile) from now on. Returns rule name -> (model, score) wrappers (None where
        that one did not opt in)."""
        out: dict[str, tuple[Any, Any]] = {}
        for rp in self.plan.rules:
            if rp.id in self.models:
                continue
            model = compiled_model(rp.model, rp.name, "model")
            score = compiled_model(rp.score, rp.name, "score")
            if model is not None or score is not None:
                out[rp.name] = (model, score)
                self.models[rp.id] = (model or rp.model, score or rp.score)
        return out
