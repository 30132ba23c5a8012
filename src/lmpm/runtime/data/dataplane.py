"""The data plane: a worker that owns payload and runs an epoch's work where the payload lives.

A :class:`DataPlane` holds the payload of its cells (today: every cell of every value; one worker)
on its backend's device for the whole run, and answers its owner's messages
(:mod:`lmpm.runtime.protocol`; the owner of the cells decides them, :mod:`lmpm.runtime.data.owner`):

- ``propose``: gather every fired rule's reads from the resident payload (the plan's gather tables),
  dispatch all models (and their scores) to the backend before collecting any, build each value's
  candidate table (column 0 keep-current, a proposal equal to the committed payload folded into it),
  evaluate every constraint on every candidate, and return metadata only;
- ``apply``: write the winners it is told (by column, or an aggregate from weights), append the
  committed rows to its store (durable before the control plane logs the epoch), return which rows
  changed.

What the worker needs of the cells' metadata (committed, given as input) it mirrors itself from the
inputs and commits it applies. A data plane that owns its cells (one worker: ``decides``) holds their
metadata and decisions too (:class:`~lmpm.runtime.data.owner.Owner`: clocks, provenance, agreement) and
answers the control plane's one message, ``epoch`` (:class:`~lmpm.runtime.port.DataPlanePort`);
``compile`` makes it a fused data plane, which runs each eligible value's epoch after its model as
one compiled step (:mod:`lmpm.runtime.data.compiled`, ``--compile``).

Everything handed to user code (models, scores, predicates) is a fresh tensor: a model that writes
into its inputs cannot change the payload, the plan's tables or a later epoch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from lmpm.errors import (
    ConstraintEvalError,
    InputError,
    ModelError,
    RunDirError,
    UsageError,
    user_frame,
)
from lmpm.ir.eval import evaluate
from lmpm.ir.nodes import PredKind
from lmpm.models.compile import compiled_model
from lmpm.resolve.plan import (
    ConstraintPlan,
    Plan,
    RulePlan,
    ValuePlan,
)
from lmpm.resolve.policies import aggregates
from lmpm.runtime.data.captured import CapturedSteps, Mirror
from lmpm.runtime.data.compiled import CompiledEpoch, ReadGathers
from lmpm.runtime.data.kepochs import EpochWindows
from lmpm.runtime.data.owner import Owner, pick
from lmpm.runtime.data.reads import ReadClocks, dense_read, read_options
from lmpm.runtime.data.store import PayloadStore
from lmpm.runtime.protocol import (
    Applied,
    ApplyReply,
    ApplyRequest,
    Candidates,
    EpochReport,
    EpochRequest,
    ProposeReply,
    ProposeRequest,
    Traffic,
)
from lmpm.runtime.records import ValueEpoch
from lmpm.workers import MaskSets, Results, VocabMask, WorkItem, get_backend, simcuda

if TYPE_CHECKING:
    from lmpm.runtime.data.validate import EagerValidator

# splitmix64's multipliers as signed int64 (torch has no uint64 arithmetic); products wrap.
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _mix(z: Tensor) -> Tensor:
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


def checksum(payload: Tensor, cell_dims: int) -> Tensor:
    """int64 checksum of each cell's payload: ``payload`` (..., *cell) -> (...). Integer arithmetic
    on the payload's bits, so it is identical on every device; equal payloads, equal checksums.

    >>> import torch
    >>> a = checksum(torch.tensor([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0]]), 1)
    >>> bool(a[0] == a[1]), bool(a[0] == a[2])
    (True, False)
    """
    x = payload
    if x.is_floating_point():
        x = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    elif x.dtype != torch.int64:
        x = x.to(torch.int64)
    if cell_dims:
        x = x.flatten(-cell_dims)
        pos = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=torch.int64) * _GOLDEN
        x = _mix(x + pos).sum(dim=-1)
    return _mix(x + _GOLDEN)


# one rule replica's proposals for a value: (rule, cells (n,), replica, proposals (n, k, *cell),
# scores (n, k) float64)
Proposal = tuple[RulePlan, Tensor, int, Tensor, Tensor]


@dataclass(frozen=True, slots=True)
class _ValueTables:
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


def _item_outputs(results: Results, n_items: int) -> list[tuple[Tensor, Tensor]]:
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


def _corrupt(prop: Tensor, vp: ValuePlan) -> Tensor:
    """Injected corruption: every proposal changed to another valid payload (the next token of
    the vocabulary, or the number plus 1), so it differs from what the model proposed."""
    if prop.is_floating_point():
        return prop + 1
    return (prop + 1) % vp.vocab if vp.vocab else prop + 1


# A worker's model results stay where its payload lives: the CUDA backend's default copies them to
# the host (for callers outside a run), which would mix devices in the worker's checks and commits.
_RESIDENT: dict[str, dict[str, Any]] = {
    "cuda": {"results_to_host": False},
    "simcuda": {"results_to_host": False},  # the same backend on the simulated device
}


def _placed(fn: Any, device: torch.device) -> Any:
    """A bound model, score or predicate ready for a worker on ``device``: an ``nn.Module`` is
    moved there (in place, once per worker), an object with ``.to`` is replaced by
    ``fn.to(device)``; a plain function is called as it is, with its inputs on ``device``."""
    if isinstance(fn, torch.nn.Module):
        return fn.to(device)
    to = getattr(fn, "to", None)
    if callable(to) and not isinstance(fn, type):
        moved = to(device)
        return moved if callable(moved) else fn
    return fn


def _ours(fn: Any) -> bool:
    """A callable (or module instance) defined in LMPM itself."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return module == "lmpm" or module.startswith("lmpm.")


class AccessInput(NamedTuple):
    """One further access argument of a predicate call, per open cell: the K cells it reads."""

    payload: Tensor  # (n, K[, *cell]) their payload
    mask: Tensor  # (n, K) bool: the cell exists and is committed
    cells: Tensor  # (n, K) int64 their flat cell index within the accessed value


@dataclass(frozen=True, slots=True)
class PredicateInput:
    """What a user-bound predicate receives (n open cells, C candidates each). Copies: a predicate
    that writes into them changes nothing."""

    candidates: Tensor  # (n, C, *cell) candidate payloads
    valid: Tensor  # (n, C) bool
    current: Tensor  # (n, *cell) committed payload (undefined where not committed)
    committed: Tensor  # (n,) bool
    cells: Tensor  # (n,) flat cell index within the value
    coords: Tensor  # (n, rank)
    accesses: tuple[AccessInput, ...]  # per further access argument (P(A, B): B's)
    args: tuple[Any, ...]  # literal arguments
    epoch: int


@dataclass(slots=True)
class _Staged:
    """One value's candidate table between propose and apply (never leaves the worker)."""

    cells: Tensor  # (n,) on the device
    table: Tensor  # (n, C, *cell) candidate payloads; column 0 is the committed payload
    committed: Tensor  # (n,) bool before the epoch


class DataPlane:
    """One worker: resident payload, models, constraint checks, commits. See the module doc."""

    def __init__(
        self,
        plan: Plan,
        *,
        backend: str | Any = "cpu",
        seed: int = 0,
        worker: str | None = None,
        checksum_policies: frozenset[str] = frozenset(),
        decides: bool = True,
    ) -> None:
        self.plan = plan
        self.backend = (
            get_backend(backend, **_RESIDENT.get(backend, {}))
            if isinstance(backend, str)
            else backend
        )
        self.device: torch.device = self.backend.device
        self._host = self.device.type == "cpu"  # replies need no copy to the host
        self._score_keys_cache: dict[int, tuple[str, ...]] = {}
        self.worker = worker or self.backend.worker
        self.seed = int(seed)
        dev = self.device
        self.payload: dict[str, Tensor] = {}
        self.committed: dict[str, Tensor] = {}
        self.from_input: dict[str, Tensor] = {}
        for name, vp in plan.values.items():
            self.payload[name] = torch.zeros(
                (vp.ncells, *vp.cell_shape), dtype=vp.dtype, device=dev
            )
            self.committed[name] = torch.zeros(vp.ncells, dtype=torch.bool, device=dev)
            self.from_input[name] = torch.zeros(vp.ncells, dtype=torch.bool, device=dev)
        self._dev_cache: dict[int, tuple[Tensor, Tensor]] = {}
        self._tables: dict[str, _ValueTables] = {}
        by_target = plan.rules_by_target
        live = plan.live_constraints
        for name, rules in by_target.items():
            cps = tuple(live.get(name, []))
            tables: list[Tensor | None] = []
            for cp in cps:
                if cp.pred == PredKind.IN_SET:
                    assert cp.table is not None
                    table = torch.cat([cp.table, torch.zeros(2, dtype=torch.bool)])
                    tables.append(self._dev(table if cp.kind == "forbid" else ~table))
                else:
                    tables.append(None)
            self._tables[name] = _ValueTables(
                tuple(rules),
                cps,
                tuple(bool(cp.cells.all()) and not cp.needs_inputs_region for cp in cps),
                tuple(tables),
                tuple(self._dev(cp.cells) for cp in cps),
                plan.values[name].policy_text.split("(")[0] in checksum_policies,
                not aggregates(plan.values[name].policy, plan.values[name].policy_args),
            )
        # per value with a lowered mask (lmpm.resolve.masks): its sets on this device, and the
        # index of each lowered constraint among the value's live ones
        self._masks: dict[str, tuple[MaskSets, tuple[int, ...]]] = {}
        for name, vm in plan.masks.items():
            at = [cp.id for cp in self._tables[name].constraints]
            sets = vm.sets
            self._masks[name] = (
                MaskSets(self._dev(sets.ok), sets.levels, sets.hard),
                tuple(at.index(cid) for cid in vm.constraints),
            )
        self._staged: dict[str, _Staged] = {}
        self._phase: dict[str, int | None] = {}  # this epoch's schedule phase per value
        self._active: frozenset[int] | None = None  # this epoch's RuleSet (None: all constraints)
        # rules whose model and score are LMPM's own (they never write into their inputs)
        self._trusted = {
            rp.id for rp in plan.rules if _ours(rp.model) and (rp.score is None or _ours(rp.score))
        }
        self._row_cache: dict[tuple[Any, ...], Tensor] = {}  # see _rows
        # values no rule proposes to (inputs only): only set_input, load and the halo transports
        # write them, each through torch (bumping the tensors' versions), so a read of all their
        # cells is kept until their payload or flags change (see _uniform_read)
        self._static = set(plan.values) - {rp.target for rp in plan.rules}
        self._uniform_cache: dict[tuple[int, int], tuple[Any, ...]] = {}  # see _uniform_read
        self._ones_cache: dict[tuple[str, tuple[int, ...]], Tensor] = {}
        # values whose `inputs()` region some constraint reads: the only ones whose input flags
        # the worker must keep up to date
        self._tracks_inputs = {cp.target for cp in plan.constraints if cp.needs_inputs_region}
        self._columns_cache: dict[tuple[tuple[int, int, int], ...], tuple[Tensor, ...]] = {}
        self._kwargs_base: dict[int, dict[str, Any]] = {}
        self.store: Any = (
            None  # a PayloadStore (lmpm.runtime.data.store) once the run has a directory
        )
        # per value: the cells the last apply wrote (the halo transports send the routed ones)
        self.written: dict[str, Tensor] = {}
        # this epoch's requests and replies as they would cross a process boundary, counted when
        # ``count_bytes`` is set (in this process nothing crosses: one-process runs pay nothing)
        self.count_bytes = False
        self.traffic = Traffic()
        # Worker-side instrumentation: tap(epoch, value, cells, table (n, C, *cell), valid (n, C))
        # sees every candidate table where the payload lives (benchmarks, debugging).
        self.taps: list[Any] = []
        # Fault injection (tests, drills): from this epoch on, every proposal of this worker is
        # perturbed after its model ran, as if the model returned corrupt output (see _corrupt)
        self.corrupt_from: int | None = None
        # rule id -> (model, score) the worker calls instead of the plan's (compile_models)
        self.models: dict[int, tuple[Any, Any]] = {}
        # the user's bound models, scores and predicates on this worker's device (an nn.Module
        # moved once, here; docs/runtime.md, "Devices"): rule id -> (model, score), constraint
        # id -> predicate
        self._placed: dict[int, tuple[Any, Any]] = {
            rp.id: (_placed(rp.model, dev), _placed(rp.score, dev) if rp.score else None)
            for rp in plan.rules
            if not _ours(rp.model) or (rp.score is not None and not _ours(rp.score))
        }
        self._predicates: dict[int, Any] = {
            cp.id: _placed(cp.predicate, dev)
            for cp in plan.constraints
            if cp.predicate is not None and not _ours(cp.predicate)
        }
        # --compile: LMPM's own models' reads gathered by compiled graphs (compile_reads)
        self.read_gathers: Any = None
        # the owner of the cells' metadata and decisions (None: a worker of a group, whose
        # owner is the group's)
        self._owner = Owner(plan, self.seed) if decides else None
        self.compiled: CompiledEpoch | None = None  # a fused data plane's steps (compile)
        # LMPM_VALIDATE=eager: checks each compiled epoch against the eager decision (set by
        # Run, lmpm.runtime.session; lmpm.runtime.data.validate)
        self.validator: EagerValidator | None = None
        self._mirror: Mirror | None = None  # off the CPU: the metadata the captured steps read
        self.windows: EpochWindows | None = None  # K epochs per replay (epoch_windows)
        self._work_cells: dict[int, Tensor] = {}  # rule id -> this epoch's cells, on the host
        # what each user model asks of its reads (lmpm.runtime.data.reads: clocks, dense); the
        # write clocks are kept only for the values an opted-in model reads with clocks
        self._read_opts = {
            rp.id: opts for rp in plan.rules if (opts := read_options(rp.model, rp.name))
        }
        self._since: dict[int, int] = {}  # rule id -> write clock of its previous call
        self.read_clocks = ReadClocks(
            rd.source
            for rp in plan.rules
            if "clocks" in self._read_opts.get(rp.id, ())
            for rd in rp.reads
        )

    def trusts(self, rp: RulePlan) -> bool:
        """The rule's model and score are LMPM's own: they get views of the payload, not copies
        (and their reads are gathered by compiled graphs under ``--compile``)."""
        return rp.id in self._trusted

    @property
    def owner(self) -> Owner:
        if self._owner is None:
            raise UsageError(f"worker {self.worker} is part of a group: the group owns its cells")
        return self._owner

    # ---- the port (lmpm.runtime.port.DataPlanePort) -------------------------------------------
    def epoch(self, req: EpochRequest) -> EpochReport:
        """Run one epoch on this worker's cells, which it owns (:meth:`Owner.epoch`)."""
        if self.count_bytes:
            self.traffic = Traffic()
        if self.validator is not None:  # LMPM_VALIDATE=eager (lmpm.runtime.data.validate)
            self.validator.begin()
        fused: Any = self if self.compiled is not None else None
        if self.windows is not None and self.windows.holds(req.epoch):
            fused = self.windows.take(req)  # replayed already, in a window of K epochs
        report = self.owner.epoch(self, req, fused)
        if self.validator is not None:
            self.validator.check(req, report)
        report.control_bytes = self.traffic.control_bytes
        report.message_bytes = self.traffic.message_bytes
        return report

    def replica_worker(self, value: str, replica: int) -> str:
        """The worker that ran ``replica`` of ``value``: this one."""
        return self.worker

    def compile(self) -> CompiledEpoch:
        """Become a fused data plane: each eligible value's epoch after its model runs as one
        compiled step from now on (``--compile``; :mod:`lmpm.runtime.data.compiled`)."""
        if self.compiled is None:
            if self.device.type not in ("cpu", "cuda"):
                raise UsageError(
                    f"--compile runs with the cpu and cuda backends; this run's payload is on "
                    f"{self.device}",
                    code="U103",
                    hint="drop --compile, or run with --backend cpu or cuda",
                )
            owner = self.owner
            self.compiled = CompiledEpoch(self.plan, self.device, quota=owner.schedule.has_quota)
            if not self._host:  # each step a CUDA graph over a device mirror of the metadata
                self.compiled.captured = CapturedSteps(self.compiled.stats)
                self._mirror = Mirror(owner, self.device)
            self.compiled.prepare(self)
            self.compile_reads(self.compiled.stats)
            owner.compiled = self.compiled
            if simcuda.active() is None:  # (inductor has no simulated device: models run eager)
                self.compile_models()  # the models that opted in (lmpm_compile)
        return self.compiled

    def propose_fused(
        self, req: ProposeRequest
    ) -> tuple[ProposeReply, list[str], dict[str, Proposal]]:
        """Run the models; build the eager values' candidates (the compiled values' come in their
        steps, :meth:`step_fused`). Returns the eager reply, the values in commit order and the
        compiled values' proposals. An epoch that something watches (``--trace cells``, taps) or
        that corrupts proposals (fault drills) runs eagerly."""
        assert self.compiled is not None
        if not self.compiled.specs or req.record or self.taps or self.corrupt_from is not None:
            self.compiled.stats.eager_epochs += 1
            reply = self.propose(req)
            return reply, list(reply.values), {}
        per_value, model_seconds = self.run_models(req)
        if self.validator is not None:  # the shadow decides from the same proposals
            self.validator.proposed(per_value, model_seconds)
        self._staged = {}
        values = {}
        fused: dict[str, Proposal] = {}
        for name, parts in per_value.items():
            if self.compiled.compiles(name):
                fused[name] = parts[0]
            else:
                values[name] = self._candidates(name, req.epoch, parts, req.fresh.get(name, False))
        return ProposeReply(self.worker, values, model_seconds), list(per_value), fused

    def step_fused(
        self, owner: Owner, name: str, e: int, part: Proposal, checksums: bool
    ) -> tuple[ValueEpoch, int, int]:
        """One compiled value's epoch: its step (payload and metadata written together), its
        commits appended to the store; its record, commits and violations."""
        assert self.compiled is not None
        _, cells, _, prop, sc = part
        active = owner.active_mask(name, self.device)
        if self._host:  # the step writes the owner's metadata itself
            state, why = owner.state[name], owner.why[name]
            clocks = {s: st.clock for s, st in owner.state.items()}
        else:  # a captured step: the device's mirror of it (its records come back to the host)
            mirror = self._mirror
            assert mirror is not None
            state, got = mirror.get(name)
            assert got is not None  # (a proposed value has why-codes)
            why = got
            spec = self.compiled.specs[name]
            clocks = {s: mirror.get(s)[0].clock for s in spec.clock_sources if s != name}
        quota = owner.quota(name, e)
        out = self.compiled.step(name, e, cells, prop, sc, self, state, why, active, clocks, quota)
        return self.settle_fused(owner, name, e, part, out, checksums)

    def settle_fused(
        self,
        owner: Owner,
        name: str,
        e: int,
        part: Proposal,
        out: Any,
        checksums: bool,
        written: Tensor | None = None,
    ) -> tuple[ValueEpoch, int, int]:
        """A compiled value's step records (``out``: :meth:`CompiledEpoch.step`'s) as its epoch:
        its record (settled into the owner's host state after a captured step), commits appended
        to the store; its record, commits and violations. ``written``: the open cells' payload
        after the step, on the host (a replayed window's, whose later epochs moved the payload
        on)."""
        assert self.compiled is not None
        rp, cells, _, prop, _ = part
        static = owner.static[name]
        winner, changed, score, valid, violated, applies, new_clock, was, counts = out
        if name in self.read_clocks.values:
            self.read_clocks.stamp(name, self.payload[name], cells[changed])
        n_commits, n_viol = counts.tolist()
        ve = ValueEpoch(
            name,
            cells if self._host else self._work_cells[rp.id],
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
        if not self._host:
            owner.settle(name, e, rp.id, ve)
        if n_commits and (self.store is not None or checksums):
            if written is not None:
                rows, new = ve.cells[changed], written[changed]
            elif self._host:
                rows = cells if n_commits == cells.numel() else cells[changed]
            else:  # the committed rows picked on the host (no device-side mask and its wait)
                rows = self._here(ve.cells if n_commits == cells.numel() else ve.cells[changed])
            if written is None:
                new = self.payload[name].index_select(0, rows)
            if self.store is not None:
                self.store.append_commits(e, name, rows, new)
            if checksums:
                sums = torch.zeros(cells.numel(), dtype=torch.int64)
                sums[changed] = checksum(new, len(self.plan.values[name].cell_shape)).cpu()
                ve.checksum = sums
        return ve, n_commits, n_viol

    def sync(self, epoch: int) -> bool:
        """Make the fused steps' commits of ``epoch`` durable (False: this worker keeps no
        store)."""
        if self.store is None:
            return False
        self.store.sync(epoch)
        return True

    def epoch_windows(self, k: int, start: int) -> EpochWindows:
        """Replay K epochs per CUDA graph from epoch ``start`` on where the run allows it
        (:mod:`lmpm.runtime.data.kepochs`; after :meth:`compile`)."""
        self.windows = EpochWindows(self, k, start)
        return self.windows

    def work_cells(self, rule: int, cells: Tensor) -> None:
        """The host copy of ``rule``'s cells in the epoch being settled (a replayed window's)."""
        self._work_cells[rule] = cells

    @property
    def mirror(self) -> Mirror:
        """The device's copy of the owner's metadata (a fused data plane off the CPU)."""
        assert self._mirror is not None
        return self._mirror

    def read_options(self, rule: int) -> tuple[str, ...]:
        """What rule ``rule``'s model asks of its reads (clocks, dense; lmpm.runtime.data.reads)."""
        return tuple(self._read_opts.get(rule, ()))

    def model_of(self, rp: RulePlan) -> Any:
        """The model this worker calls for ``rp``: compiled (compile_models), else moved to its
        device, else as bound (what run_models calls)."""
        return (self.models.get(rp.id) or self._placed.get(rp.id) or (rp.model, None))[0]

    def models_on_device(
        self, rules: list[tuple[RulePlan, Tensor, Tensor]], phases: dict[str, int | None], e: Tensor
    ) -> dict[str, tuple[RulePlan, Tensor, Tensor, Tensor, Tensor]]:
        """Inside a window's capture (lmpm.runtime.data.kepochs): every rule's reads and its
        capturable model on (host cells, device cells), ``e`` a 0-d device tensor: per value
        (rule, host cells, cells, proposals (n, k, *cell), scores (n, k) float64)."""
        self._phase = dict(phases)
        out = {}
        for rp, on_host, cells in rules:
            model = self.model_of(rp)
            vp = self.plan.values[rp.target]
            inputs = self._inputs(rp, cells, on_host)
            got = model(inputs, **{**self._kwargs(rp, vp, 0), "epoch": e})
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
            prop, score = self._shape(rp, vp, prop, score)
            out[rp.target] = (rp, on_host, cells, prop, score)
        return out

    def compile_reads(self, stats: Any = None) -> None:
        """Gather the reads of LMPM's own models with compiled graphs from now on (``--compile``;
        :class:`lmpm.runtime.data.compiled.ReadGathers`; ``stats``: the run's CompileStats)."""
        if self.read_gathers is None:
            self.read_gathers = ReadGathers(stats)
            for rp in self.plan.rules:
                if rp.id in self._trusted:  # the rules whose reads it gathers (see _inputs)
                    self.read_gathers.prepare(rp, self)

    def compile_models(self) -> dict[str, tuple[Any, Any]]:
        """Call the compiled version of every model and score that opted in (``lmpm_compile``,
        lmpm.models.compile) from now on: what ``--compile`` does besides the epoch step. Returns
        rule name -> (model, score) wrappers (None where that one did not opt in)."""
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

    # ---- device-resident static tables -----------------------------------------------------------
    def _dev(self, t: Tensor) -> Tensor:
        """The device copy of a static plan table (made once; the CPU tensor itself on CPU)."""
        if self._host and t.device.type == "cpu":
            return t
        if t.device == self.device:
            return t
        hit = self._dev_cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self._dev_cache[id(t)] = (t, t.to(self.device))
        return hit[1]

    def _ones(self, shape: tuple[int, int]) -> Tensor:
        """An all-True (n, C) mask, made once per shape. Replies share it: the control plane
        only reads replies (a user policy gets copies, lmpm.runtime.data.agree)."""
        return self._fill("ones", shape, torch.bool, True)

    def _fill(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, value: Any) -> Tensor:
        """A filled tensor made once per (kind, shape): never written in place, never handed to
        user code as its own (predicates get copies)."""
        key = (kind, shape)
        hit = self._ones_cache.get(key)
        if hit is None:
            hit = torch.full(shape, value, dtype=dtype, device=self.device)
            self._ones_cache[key] = hit
        return hit

    def _here(self, t: Tensor) -> Tensor:
        """A request's tensor on this worker's device, without waiting for the device: copied
        from pinned memory (PyTorch's caching host allocator keeps the block until the copy is
        done), since a copy from pageable memory may wait for the work queued before it."""
        if self._host or t.device.type != "cpu":
            return t if self._host else t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _meta(self, t: Tensor) -> Tensor:
        """A reply's metadata tensor on the host."""
        return t if self._host else t.cpu()

    # ---- state -----------------------------------------------------------------------------------
    def set_input(self, value: str, payload: Tensor, mask: Tensor) -> Tensor:
        """Commit ``payload[mask]`` as given input; returns the (cpu) cells committed."""
        vp = self.plan.values[value]
        payload = payload.to(vp.dtype).reshape(vp.ncells, *vp.cell_shape)
        mask = mask.reshape(-1).bool()
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
        didx = idx.to(self.device)
        self.payload[value].index_copy_(0, didx, payload.index_select(0, idx).to(self.device))
        self.committed[value].index_fill_(0, didx, True)
        self.from_input[value].index_fill_(0, didx, True)
        self.read_clocks.stamp(value, self.payload[value], didx)
        if self._owner is not None:
            self._owner.mark_input(value, idx)
        return idx

    def load(self, value: str, payload: Tensor, committed: Tensor, from_input: Tensor) -> None:
        """Replace a value's whole state (resume from the store)."""
        vp = self.plan.values[value]
        self.payload[value] = (
            payload.to(vp.dtype).reshape(vp.ncells, *vp.cell_shape).to(self.device)
        )
        self.committed[value] = committed.bool().to(self.device).clone()
        self.from_input[value] = from_input.bool().to(self.device).clone()
        self.read_clocks.reset(value, self.payload[value], self.committed[value])

    # ---- durability ------------------------------------------------------------------------------
    def open_store(self, run_dir: str | Path) -> None:
        """Persist committed payload under ``run_dir`` from now on (lmpm.runtime.data.store)."""
        self.store = PayloadStore(run_dir, self.worker, self.plan)

    def close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def checkpoint(self, label: int) -> tuple[str, int, str]:
        """Write this worker's payload checkpoint for the start of epoch ``label``."""
        assert self.store is not None, "open_store first"
        return self.store.checkpoint(
            label, {name: t.cpu().numpy() for name, t in self.payload.items()}
        )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The workers whose payload shards a checkpoint of this data plane holds."""
        return (self.worker,)

    def checkpoint_shards(self, label: int) -> dict[str, dict[str, Any]]:
        """Per worker, the payload shard written for the start of epoch ``label``."""
        file, size, sha = self.checkpoint(label)
        return {self.worker: {"file": file, "bytes": size, "sha256": sha}}

    def restore_shards(
        self,
        label: int,
        shards: Mapping[str, Mapping[str, Any]],
        upto: int,
        commits: Mapping[tuple[int, str], Tensor],
        committed: Mapping[str, Tensor],
        from_input: Mapping[str, Tensor],
    ) -> None:
        """Resume from the shards a checkpoint names: ``commits[(epoch, value)]`` are the cells the
        control plane logged as committed in epochs ``label .. upto - 1`` (see :meth:`restore`)."""
        shard = shards[self.worker]
        counts = {k: int(c.numel()) for k, c in commits.items()}
        self.restore(
            label, str(shard["file"]), str(shard["sha256"]), upto, counts, committed, from_input
        )

    def restore(
        self,
        label: int,
        file: str,
        sha256: str,
        upto: int,
        counts: dict[tuple[int, str], int],
        committed: Mapping[str, Tensor],
        from_input: Mapping[str, Tensor],
    ) -> None:
        """Resume: the payload after epoch ``upto - 1`` from the store (checkpoint ``file`` of
        epoch ``label`` + committed rows); ``committed``/``from_input`` come from the control
        plane's metadata."""
        assert self.store is not None, "open_store first"
        arrays = self.store.restore(label, file, sha256, upto, counts)
        for name, vp in self.plan.values.items():
            arr = arrays.get(name)
            if arr is None or arr.shape != (vp.ncells, *vp.cell_shape):
                raise RunDirError(
                    f"payload checkpoint {file} does not fit value `{name}` "
                    f"({vp.ncells} cells of {vp.cell_shape or '()'})",
                    code="D007",
                )
            self.load(name, torch.from_numpy(arr), committed[name], from_input[name])

    def read(self, value: str) -> tuple[Tensor, Tensor]:
        """(payload, committed) of a value, copied to the host: outputs and checkpoints. Never
        called by the control plane."""
        return self.payload[value].cpu().clone(), self.committed[value].cpu().clone()

    # ---- propose ---------------------------------------------------------------------------------
    def propose(self, req: ProposeRequest) -> ProposeReply:
        e = req.epoch
        per_value, model_seconds = self.run_models(req)
        self._staged = {}
        values = {
            name: self._candidates(name, e, parts, req.fresh.get(name, False))
            for name, parts in per_value.items()
        }
        if req.record and self.store is not None:
            for name, cells in req.record.items():
                st = self._staged.get(name)
                if st is not None:
                    self.store.record_candidates(e, name, st.cells, st.table, cells)
        reply = ProposeReply(self.worker, values, model_seconds)
        if self.count_bytes:
            self.traffic.count(req, reply)
        return reply

    def run_models(self, req: ProposeRequest) -> tuple[dict[str, list[Proposal]], float]:
        """Gather every fired rule's reads, run all models and scores: per value, each rule
        replica's (rule, cells, replica, proposals (n, k, *cell), scores (n, k)); and the seconds
        the models took."""
        e = req.epoch
        self._phase = dict(req.phases or {})
        self._active = req.active
        items: list[WorkItem] = []
        meta: list[tuple[RulePlan, Tensor, int]] = []
        inputs_of: dict[int, dict[str, Tensor]] = {}
        models = self.models
        for rw in req.rules:
            rp = self.plan.rules[rw.rule]
            # compiled (compile_models), else moved to this device (_placed), else as bound
            model, score = models.get(rp.id) or self._placed.get(rp.id) or (rp.model, rp.score)
            vp = self.plan.values[rp.target]
            cells = self._here(rw.cells)
            self._work_cells[rp.id] = rw.cells  # (on the host)
            clocked = "clocks" in self._read_opts.get(rp.id, ())
            if clocked:  # the write clock of this rule's previous call (-1: none this generation)
                self._since[rp.id] = self.read_clocks.since(rp.id)
            inputs = inputs_of[rp.id] = self._inputs(rp, cells, rw.cells)
            kwargs = self._kwargs(rp, vp, e)
            if clocked:
                kwargs = {**kwargs, "generation": self.read_clocks.generation}
                self.read_clocks.called(rp.id)
            own = inputs["cells"]
            global_cells = own + vp.offset if vp.offset else own
            score_inputs = self._score_keys(rp, inputs) if rp.score else ()
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
                        seed=self.seed,
                        epoch=e,
                        value=vp.name,
                        replica=rep,
                        score=score,
                        score_inputs=score_inputs,
                        mask=self._vocab_mask(rp, cells, req.fresh.get(rp.target, False)),
                    )
                )
                meta.append((rp, cells, rep))
        tm = time.perf_counter()
        try:
            results = self.backend.collect(self.backend.dispatch(items)) if items else None
        except ModelError as exc:
            self._locate_model_error(exc)
            raise
        model_seconds = time.perf_counter() - tm

        per_value: dict[str, list[Proposal]] = {}
        outputs = _item_outputs(results, len(items)) if results is not None else []
        corrupt = self.corrupt_from is not None and e >= self.corrupt_from
        for (rp, cells, rep), (prop, score) in zip(meta, outputs):
            vp = self.plan.values[rp.target]
            prop, score = self._shape(rp, vp, prop, score)
            if corrupt:
                prop = _corrupt(prop, vp)
            per_value.setdefault(rp.target, []).append((rp, cells, rep, prop, score))
        return per_value, model_seconds

    def _vocab_mask(self, rp: RulePlan, cells: Tensor, fresh: bool) -> VocabMask | None:
        """The mask on ``rp``'s logits for ``cells`` this epoch (None: its value has none, or the
        rule gets none): which lowered constraints speak about each cell (their cells, the
        `inputs()` region, the RuleSet) and, where the schedule may open committed cells
        (``fresh`` False), each cell's committed token (-1: unset)."""
        got = self._masks.get(rp.target)
        if got is None or rp.id not in self.plan.masks[rp.target].rules:
            return None
        sets, at = got
        name = rp.target
        tabs = self._tables[name]
        n = cells.numel()
        active = self._active
        if active is None and all(tabs.covers_all[j] for j in at):
            applies = self._ones((n, len(at)))
        else:
            phase = self._phase.get(name)
            cols = []
            for j in at:
                cp = tabs.constraints[j]
                if active is not None and cp.id not in active:
                    cols.append(torch.zeros(n, dtype=torch.bool, device=self.device))
                    continue
                key = None if phase is None else ("cp", cp.id, phase)
                where = self._rows(tabs.cells[j], cells, key)
                if cp.needs_inputs_region:
                    where = where & self.from_input[name].index_select(0, cells)
                cols.append(where)
            applies = torch.stack(cols, dim=1)
        current = None
        if not fresh:  # the schedule may open committed cells: each one's token, -1 where unset
            committed = self.committed[name].index_select(0, cells)
            current = torch.where(committed, self.payload[name].index_select(0, cells), -1)
        return VocabMask(sets, applies, current)

    def _shape(
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

    def _locate_model_error(self, exc: ModelError) -> None:
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

    def _kwargs(self, rp: RulePlan, vp: ValuePlan, e: int) -> dict[str, Any]:
        """The model call's keyword arguments in epoch ``e``: the rule's literals, then the ones
        computed from ``e``, then ``epoch``, ``vocab`` and ``seed`` unless the rule sets them."""
        if not rp.epoch_args and "epoch" not in rp.kwargs:
            base = self._kwargs_base.get(rp.id)
            if base is None:
                base = self._kwargs_base[rp.id] = {"vocab": vp.vocab, "seed": self.seed}
                base.update(rp.kwargs)
            return {**base, "epoch": e}
        kwargs = dict(rp.kwargs)
        for k, ex in rp.epoch_args.items():
            kwargs[k] = evaluate(ex, self.plan.env | {"e": e})
        kwargs.setdefault("epoch", e)
        kwargs.setdefault("vocab", vp.vocab)
        kwargs.setdefault("seed", self.seed)
        return kwargs

    def _rows(self, table: Tensor, cells: Tensor, key: tuple[Any, ...] | None = None) -> Tensor:
        """``table[cells]`` for a static per-cell plan table. With a ``key`` naming the table and
        the schedule's phase, the rows are kept for the next time the phase recurs: callers must
        then copy them before handing them to user code."""
        if key is None:
            return self._dev(table).index_select(0, cells)
        hit = self._row_cache.get(key)
        if hit is None or hit.shape[0] != cells.numel():
            hit = self._row_cache[key] = self._dev(table).index_select(0, cells)
        return hit

    def _inputs(
        self, rp: RulePlan, cells: Tensor, on_host: Tensor | None = None
    ) -> dict[str, Tensor]:
        """The model's inputs for ``cells``: per read, payload / mask / index, each (n, K[, *cell]).
        A user's model and score get their own tensors: writing into one changes nothing outside
        their call. LMPM's own models (``lmpm.*``, which never write into their inputs) get the
        worker's kept rows without copies. ``on_host``: the same cells on the host, where the
        request brought them (read there, not on the device, which would wait for it)."""
        vp = self.plan.values[rp.target]
        n = cells.numel()
        phase = self._phase.get(rp.target)
        key = None if phase is None else (rp.id, phase)
        copy = rp.id not in self._trusted  # copies of anything the worker keeps
        if n == 1 and not copy:  # one open cell (causal generation): views of its rows
            c = int((cells if on_host is None else on_host).item())
            key = None
            rows = lambda t, *_: self._dev(t).narrow(0, c, 1)  # noqa: E731
        else:
            rows = self._rows
        coords = rows(vp.coords, cells, key and ("coords", *key))
        inputs: dict[str, Tensor] = {
            "cells": cells.clone() if copy else cells,
            "coords": coords.clone() if key and copy else coords,
        }
        gathered = (
            self.read_gathers.gather(rp, cells, self)
            if self.read_gathers is not None and n > 1 and not copy
            else {}
        )
        for j, rd in enumerate(rp.reads):
            committed = self.committed[rd.source]
            payload = self.payload[rd.source]
            if j in gathered:
                data, mask, idx = gathered[j]
            elif rd.uniform:
                # Every cell reads the same cells: one gathered row, broadcast (an expanded view
                # cannot be written in place).
                row, mask, data = self._uniform_read(rp, j, payload, committed, copy)
                k = row.numel()
                idx = row.expand(n, k)
                mask = mask.expand(n, k)
                data = data.expand(n, k, *data.shape[1:])
            else:
                idx = rows(rd.index, cells, key and ("index", j, *key))  # (n, K)
                valid = rows(rd.valid, cells, key and ("valid", j, *key))
                mask = valid & committed.take(idx)
                if payload.dim() == 1:
                    data = payload.take(idx)  # the flat gather of a 1-D state tensor
                else:
                    data = payload.index_select(0, idx.reshape(-1)).reshape(
                        *idx.shape, *payload.shape[1:]
                    )
                if key is not None and copy:
                    idx = idx.clone()  # the model gets its own copy of the kept rows
            for name in rd.args:
                inputs[name] = data  # (n, K[, *cell]) payload of the read cells
                inputs[f"{name}_mask"] = mask  # (n, K) visible and committed
                inputs[f"{name}_index"] = idx  # (n, K) flat index into the source value
            opts = self._read_opts.get(rp.id)
            if opts:
                for name in rd.args:
                    inputs.update(self._read_extras(rp, opts, name, rd.source, data, mask, idx))
        return inputs

    def _read_extras(
        self,
        rp: RulePlan,
        opts: frozenset[str],
        name: str,
        source: str,
        data: Tensor,
        mask: Tensor,
        idx: Tensor,
    ) -> dict[str, Tensor]:
        """What an opted-in model asks of read ``name`` beyond its slots
        (:mod:`lmpm.runtime.data.reads`): clocks and the delta since its previous call, and the
        dense layout."""
        out: dict[str, Tensor] = {}
        clock = None
        if "clocks" in opts:
            clocks = self.read_clocks.clocks(source, self.payload[source], self.committed[source])
            clock = torch.where(mask, clocks.take(idx), 0)  # (n, K)
            out[f"{name}_clock"] = clock
            out[f"{name}_changed"] = clock > self._since.get(rp.id, -1)
        if "dense" in opts:
            out.update(dense_read(name, data, mask, idx, clock))
        return out

    def _uniform_read(
        self, rp: RulePlan, j: int, payload: Tensor, committed: Tensor, copy: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Read ``j`` of ``rp``, which every cell makes alike: (cells (K,), mask (K,), payload
        (K, *cell)). For LMPM's own models, a read of a value no rule writes is kept while the
        value's tensors are the same ones at the same version (the caption of every video
        epoch); anyone else's model gets fresh rows (it may write into them)."""
        rd = rp.reads[j]
        # (tensors made in inference mode, by a restore inside an epoch, keep no version)
        cache = (
            not copy
            and rd.source in self._static
            and not payload.is_inference()
            and not committed.is_inference()
        )
        if cache:
            stamp = (payload._version, committed._version)
            hit = self._uniform_cache.get((rp.id, j))
            if hit is not None and hit[0] is payload and hit[1] is committed and hit[2] == stamp:
                return hit[3], hit[4], hit[5]
        row = self._dev(rd.index)[0]
        mask = self._dev(rd.valid)[0] & committed.index_select(0, row)
        data = payload.index_select(0, row)
        if cache:
            self._uniform_cache[(rp.id, j)] = (payload, committed, stamp, row, mask, data)
        return row, mask, data

    def _score_keys(self, rp: RulePlan, inputs: Mapping[str, Tensor]) -> tuple[str, ...]:
        """The model inputs a rule's score call receives: cells, coords and its reads' tensors
        (the same names every epoch: worked out once per rule)."""
        hit = self._score_keys_cache.get(rp.id)
        if hit is None:
            hit = self._score_keys_cache[rp.id] = tuple(
                k
                for k in inputs
                if k in ("cells", "coords")
                or k.removesuffix("_mask").removesuffix("_index") in rp.score_args
            )
        return hit

    def _columns(self, parts: list[Proposal], widths: list[int]) -> tuple[Tensor, ...]:
        """(C,) rule id, replica and slot of each candidate column (-1: keep); per layout."""
        if len(parts) == 1:  # one rule fired (the common case): no generator
            key: tuple[tuple[int, int, int], ...] = ((parts[0][0].id, parts[0][2], widths[0]),)
        else:
            key = tuple((p[0].id, p[2], w) for p, w in zip(parts, widths))
        hit = self._columns_cache.get(key)
        if hit is None:
            rule, rep, slot = [-1], [-1], [-1]
            for rid, replica, w in key:
                rule += [rid] * w
                rep += [replica] * w
                slot += list(range(w))
            hit = (torch.tensor(rule), torch.tensor(rep), torch.tensor(slot))
            self._columns_cache[key] = hit
        return hit  # (the engine hands policies it does not ship copies)

    def _candidates(
        self,
        name: str,
        e: int,
        parts: list[Proposal],
        fresh: bool,
    ) -> Candidates:
        """Build, fold and check one value's candidate table; stage it for apply."""
        vp = self.plan.values[name]
        tabs = self._tables[name]
        dev = self.device
        cells = parts[0][1] if len(parts) == 1 else torch.unique(torch.cat([p[1] for p in parts]))
        n = cells.numel()
        widths = [p[3].shape[1] for p in parts]
        ncol = 1 + sum(widths)
        current = self.payload[name].index_select(0, cells)  # (n, *cell)
        if fresh:
            committed = self._fill("unset", (n,), torch.bool, False)
        else:
            committed = self.committed[name].index_select(0, cells)
        if len(parts) == 1:
            prop, sc = parts[0][3], parts[0][4]
            prop = prop if prop.dtype == vp.dtype else prop.to(vp.dtype)
            table = torch.cat((current.unsqueeze(1), prop), 1)
            valid = self._ones((n, ncol))
            score = torch.cat((self._fill("keep_score", (n, 1), torch.float64, -torch.inf), sc), 1)
            all_valid = True
        else:
            table = torch.zeros((n, ncol, *vp.cell_shape), dtype=vp.dtype, device=dev)
            table[:, 0] = current
            valid = torch.zeros((n, ncol), dtype=torch.bool, device=dev)
            valid[:, 0] = True
            score = torch.full((n, ncol), -torch.inf, dtype=torch.float64, device=dev)
            c = 1
            for (_, rcells, _, prop, sc), w in zip(parts, widths):
                rows = torch.searchsorted(cells, rcells)
                table[rows, c : c + w] = prop.to(vp.dtype)
                valid[rows, c : c + w] = True
                score[rows, c : c + w] = sc
                c += w
            all_valid = False

        # A proposal equal to the committed payload *is* keep-current, freshly scored: fold it into
        # column 0 so a stale committed score never outranks the rule's current opinion.
        refreshed: Tensor | None = None
        any_committed = not fresh and bool(committed.any())
        if any_committed and tabs.folds:
            same = table == current.unsqueeze(1)
            if vp.cell_shape:
                same = same.flatten(2).all(dim=2)
            same &= committed.unsqueeze(1)
            if not all_valid:
                same &= valid
            same[:, 0] = False
            refreshed = same.any(dim=1)
            score[:, 0] = torch.where(same, score, -torch.inf).amax(dim=1)
            valid = valid & ~same
            all_valid = False

        violated, applies = self._check(
            name, vp, tabs, e, cells, table, valid, current, committed, any_committed, all_valid
        )
        col_rule, col_rep, col_slot = self._columns(parts, widths)
        sums = checksum(table, len(vp.cell_shape)) if tabs.checksums else None
        self._staged[name] = _Staged(cells, table, committed)
        for tap in self.taps:
            tap(e, name, cells, table, valid)
        cand = Candidates(
            name,
            cells,
            valid,
            score,
            violated,
            applies,
            col_rule,
            col_rep,
            col_slot,
            refreshed,
            sums,
        )
        return cand if self._host else cand.to_host()

    # ---- check -----------------------------------------------------------------------------------
    def _check(
        self,
        name: str,
        vp: ValuePlan,
        tabs: _ValueTables,
        e: int,
        cells: Tensor,
        table: Tensor,
        valid: Tensor,
        current: Tensor,
        committed: Tensor,
        any_committed: bool,
        all_valid: bool,
    ) -> tuple[Tensor, Tensor]:
        """(n, C, K) violations, masked by the cells each constraint speaks about and by the
        candidates that exist, and the (n, K) applies mask."""
        n, ncol = valid.shape
        k = len(tabs.constraints)
        dev = self.device
        if k == 0:
            return (
                torch.zeros((n, ncol, 0), dtype=torch.bool, device=dev),
                torch.ones((n, 0), dtype=torch.bool, device=dev),
            )
        verdicts: list[Tensor] = []
        applies_cols: list[Tensor | None] = []
        everywhere = True  # every constraint speaks about every open cell
        active = self._active
        for cp, whole, vtable, ccells in zip(
            tabs.constraints, tabs.covers_all, tabs.tables, tabs.cells
        ):
            if active is not None and cp.id not in active:
                # not in the RuleSet this epoch: not evaluated, speaks about no cell
                verdicts.append(torch.zeros((n, ncol), dtype=torch.bool, device=dev))
                applies_cols.append(torch.zeros(n, dtype=torch.bool, device=dev))
                everywhere = False
                continue
            verdict = self._violations(
                cp, vp, cells, table, valid, current, committed, any_committed, e, vtable
            )
            if whole:
                where = None
            else:
                phase = self._phase.get(name)
                where = self._rows(ccells, cells, None if phase is None else ("cp", cp.id, phase))
                if cp.needs_inputs_region:
                    where = where & self.from_input[name].index_select(0, cells)
                verdict = verdict & where.unsqueeze(1)
                everywhere = False
            if not all_valid:
                verdict = verdict & valid
            verdicts.append(verdict)
            applies_cols.append(where)
        violated = verdicts[0].unsqueeze(2) if k == 1 else torch.stack(verdicts, dim=2)
        if everywhere:
            applies = self._ones((n, k))
        else:
            ones = torch.ones(n, dtype=torch.bool, device=dev)
            applies = torch.stack([ones if a is None else a for a in applies_cols], dim=1)
        return violated, applies

    def _violations(
        self,
        cp: ConstraintPlan,
        vp: ValuePlan,
        cells: Tensor,
        table: Tensor,
        valid: Tensor,
        current: Tensor,
        committed: Tensor,
        any_committed: bool,
        e: int,
        vtable: Tensor | None,
    ) -> Tensor:
        """(n, C) bool: candidate violates the constraint, before masking. Keep-current of an
        unset cell satisfies every `forbid` and violates every `require`."""
        forbid = cp.kind == "forbid"
        if cp.pred == PredKind.IN_SET:
            assert vtable is not None
            tok = table if table.dtype == torch.int64 else table.long()
            viol = vtable.take(tok.clamp(-1, vtable.numel() - 2))
        else:
            if cp.pred == PredKind.CHANGE:
                differs = table != current.unsqueeze(1)
                if vp.cell_shape:
                    differs = differs.flatten(2).any(dim=2)
                holds = differs & committed.unsqueeze(1)
                holds[:, 0] = False  # keep-current changes nothing (even a NaN payload)
            else:
                holds = self._user_predicate(cp, vp, cells, table, valid, current, committed, e)
            viol = holds if forbid else ~holds
        if any_committed:
            if forbid:
                viol[:, 0] &= committed
            else:
                viol[:, 0] |= ~committed
        else:
            viol.select(1, 0).fill_(not forbid)
        return viol

    def _user_predicate(
        self,
        cp: ConstraintPlan,
        vp: ValuePlan,
        cells: Tensor,
        table: Tensor,
        valid: Tensor,
        current: Tensor,
        committed: Tensor,
        e: int,
    ) -> Tensor:
        accesses = []
        payload = self.payload[vp.name]
        for index, avalid in cp.accesses:
            idx = self._rows(index, cells)
            mask = self._rows(avalid, cells) & self.committed[vp.name].take(idx)
            data = payload.index_select(0, idx.reshape(-1)).reshape(*idx.shape, *vp.cell_shape)
            accesses.append(AccessInput(data, mask, idx))
        ctx = PredicateInput(
            table.clone(),
            valid.clone(),
            current.clone(),
            committed.clone(),
            cells.clone(),
            self._rows(vp.coords, cells),
            tuple(accesses),
            cp.literals,
            e,
        )
        assert cp.predicate is not None
        predicate = self._predicates.get(cp.id, cp.predicate)
        try:
            out = torch.as_tensor(predicate(ctx))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: a predicate must not end the run
            raise ConstraintEvalError(
                f"predicate `{cp.ir.call.func if cp.ir.call else '?'}` of constraint `{cp.name}` "
                f"raised {type(exc).__name__}: {exc}{user_frame(exc)}",
                where={"constraint": cp.name, "epoch": e, "worker": self.worker},
                span=cp.ir.call.span if cp.ir.call is not None else cp.ir.span,
                code="R040",
            ) from exc
        if tuple(out.shape) != tuple(valid.shape) or out.dtype != torch.bool:
            raise ConstraintEvalError(
                f"predicate of constraint `{cp.name}` must return a bool tensor of shape "
                f"{tuple(valid.shape)} (cells, candidates), got {out.dtype} {tuple(out.shape)}",
                where={"constraint": cp.name, "epoch": e, "worker": self.worker},
                span=cp.ir.call.span if cp.ir.call is not None else cp.ir.span,
                code="R041",
            )
        if out.device != valid.device:  # (host metadata: no device sync)
            raise ConstraintEvalError(
                f"predicate of constraint `{cp.name}` returned its verdicts on {out.device}; "
                f"it gets its candidates on {valid.device} and must answer there "
                '(docs/runtime.md, "Devices")',
                where={"constraint": cp.name, "epoch": e, "worker": self.worker},
                span=cp.ir.call.span if cp.ir.call is not None else cp.ir.span,
                code="R041",
                hint="compute the verdicts from the candidates (`ctx.candidates.norm(dim=2) <= b`),"
                " or make new tensors with `device=ctx.candidates.device`",
            )
        return out.clone()

    def log_cells(self, tracer: Any) -> bool:
        """One worker: the control plane's log writes the per-cell rows itself (False)."""
        return False

    # ---- apply -----------------------------------------------------------------------------------
    def apply(self, req: ApplyRequest) -> ApplyReply:
        """Write the winners of every value, make them durable, report what changed."""
        out: dict[str, Applied] = {}
        self.written = {}
        for name, d in req.values.items():
            st = self._staged[name]
            vp = self.plan.values[name]
            cdims = len(vp.cell_shape)
            rows = None if d.rows is None else self._here(d.rows)
            winner = self._here(d.winner)
            table = st.table if rows is None else st.table.index_select(0, rows)
            cells = st.cells if rows is None else st.cells.index_select(0, rows)
            changed: Tensor | None = None
            if d.weights is None and not cdims:
                new = pick(table, winner)
            elif d.weights is None:
                new = table[torch.arange(table.shape[0], device=self.device), winner]
            else:
                w = self._here(d.weights).to(torch.float64)
                wv = w.reshape(*w.shape, *([1] * cdims))
                total = (wv * table.to(torch.float64)).sum(dim=1)
                new = (total / w.sum(dim=1).clamp(min=1e-300).reshape(-1, *([1] * cdims))).to(
                    vp.dtype
                )
                was = st.committed if rows is None else st.committed.index_select(0, rows)
                same = new == table[:, 0]
                if cdims:
                    same = same.flatten(1).all(dim=1)
                changed = ~(same & was)
                if not bool(changed.all()):
                    keep = changed.nonzero().squeeze(1)
                    cells, new = cells.index_select(0, keep), new.index_select(0, keep)
            self.payload[name].index_copy_(0, cells, new)
            self.read_clocks.stamp(name, self.payload[name], cells)
            self.written[name] = cells
            self.committed[name].index_fill_(0, cells, True)
            if name in self._tracks_inputs:
                self.from_input[name].index_fill_(0, cells, False)
            sums = checksum(new, cdims) if req.checksums else None
            if self.store is not None:
                self.store.append_commits(req.epoch, name, cells, new)
            out[name] = Applied(
                None if changed is None else self._meta(changed),
                None if sums is None else self._meta(sums),
            )
        durable = self.store is not None
        if durable and req.sync:
            self.store.sync(req.epoch)
        self._staged = {}
        reply = ApplyReply(self.worker, out, durable)
        if self.count_bytes:
            self.traffic.count(req, reply)
        return reply

    def record_columns(self, epoch: int, value: str, which: Tensor, cols: list[int]) -> None:
        """Record the staged candidates of ``value``'s cells in ``which`` (``--trace cells``), local
        column j as column ``cols[j]``: a group's merged column (lmpm.runtime.data.group)."""
        st = self._staged.get(value)
        if st is not None and self.store is not None:
            self.store.record_candidates(epoch, value, st.cells, st.table, which, cols)

    def set_corrupt(self, epoch: int | None) -> None:
        """Fault injection: corrupt every proposal from ``epoch`` on (None: heal)."""
        self.corrupt_from = epoch

    def keep_received(self, epoch: int, cells: Mapping[str, Tensor]) -> None:
        """Append to this worker's store the cells other workers wrote this epoch and the halo
        exchange brought here (per value, sorted cells): a `quorum(k of n)` value is written by
        whichever worker's replica won, and every worker's store keeps all of it, so each can be
        restored alone (lmpm.runtime.data.group.WorkerGroup.restore_shards)."""
        if self.store is None:
            return
        for name, c in cells.items():
            if c.numel():
                idx = self._here(c)
                self.store.append_commits(epoch, name, idx, self.payload[name].index_select(0, idx))
        self.store.sync(epoch)
