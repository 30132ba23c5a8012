"""The data plane: a worker that owns payload and runs an epoch's work where the payload lives.

A :class:`DataPlane` holds the payload of its cells (today: every cell of every value; one worker)
on its backend's device for the whole run, and answers its owner's messages
(:mod:`lmpm.runtime.protocol`; the owner of the cells decides them, :mod:`lmpm.runtime.data.owner`):

- ``propose``: gather every fired rule's reads from the resident payload (the plan's gather tables,
  :mod:`lmpm.runtime.data.inputs`), dispatch all models (and their scores) to the backend before
  collecting any (:mod:`lmpm.runtime.data.calls`), build each value's candidate table (column 0
  keep-current, a proposal equal to the committed payload folded into it,
  :mod:`lmpm.runtime.data.candidates`), evaluate every constraint on every candidate
  (:mod:`lmpm.runtime.data.checks`), and return metadata only;
- ``apply``: write the winners it is told (by column, or an aggregate from weights), append the
  committed rows to its store (durable before the control plane logs the epoch), return which rows
  changed.

What the worker needs of the cells' metadata (committed, given as input) it mirrors itself from the
inputs and commits it applies (:mod:`lmpm.runtime.data.resident`). A data plane that owns its cells
(one worker: ``decides``) holds their metadata and decisions too
(:class:`~lmpm.runtime.data.owner.Owner`: clocks, provenance, agreement) and answers the control
plane's one message, ``epoch`` (:class:`~lmpm.runtime.port.DataPlanePort`); ``compile`` makes it a
fused data plane, which runs each eligible value's epoch after its model as one compiled step
(:mod:`lmpm.runtime.data.compiled`, ``--compile``).

Everything handed to user code (models, scores, predicates) is a fresh tensor: a model that writes
into its inputs cannot change the payload, the plan's tables or a later epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from lmpm.errors import InputError, RunDirError, UsageError
from lmpm.resolve.plan import Plan, RulePlan
from lmpm.runtime.data.calls import ModelCalls, Proposal
from lmpm.runtime.data.candidates import Staging
from lmpm.runtime.data.captured import CapturedSteps, Mirror
from lmpm.runtime.data.checks import Checks, ValueTables
from lmpm.runtime.data.compiled import (
    CompiledEpoch,
    Fused,
    Outvoted,
    ReadGathers,
    StepMeta,
    fuse,
)
from lmpm.runtime.data.inputs import ModelInputs
from lmpm.runtime.data.kepochs import EpochWindows
from lmpm.runtime.data.owner import Owner, pick
from lmpm.runtime.data.resident import Resident
from lmpm.runtime.data.store import PayloadStore
from lmpm.runtime.protocol import (
    Applied,
    ApplyReply,
    ApplyRequest,
    EpochReport,
    EpochRequest,
    ProposeReply,
    ProposeRequest,
    Traffic,
    checksum,
)
from lmpm.runtime.records import ValueEpoch
from lmpm.workers import get_backend, simcuda

if TYPE_CHECKING:
    from lmpm.runtime.data.validate import EagerValidator

# A worker's model results stay where its payload lives: the CUDA backend's default copies them to
# the host (for callers outside a run), which would mix devices in the worker's checks and commits.
_RESIDENT: dict[str, dict[str, Any]] = {
    "cuda": {"results_to_host": False},
    "simcuda": {"results_to_host": False},  # the same backend on the simulated device
}
# payload dtypes numpy holds (bfloat16 has no numpy twin): one cell of these is written in numpy
_NUMPY = frozenset(
    (
        *(torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64),
        *(torch.float16, torch.float32, torch.float64),
    )
)


_NO_CLOCKS: dict[str, Tensor] = {}  # a compiled step that reads no other value's clocks


class DataPlane:
    """One worker: resident payload, models, constraint checks, commits. See the module doc.

    Its parts, each over the same :class:`~lmpm.runtime.data.resident.Resident` state:
    ``inputs`` (model inputs), ``checks`` (constraints), ``calls`` (models), ``staging``
    (candidate tables)."""

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
        self.worker = worker or self.backend.worker
        self.seed = int(seed)
        res = self.resident = Resident(plan, self.device)
        self._host = res.host  # replies need no copy to the host
        # the same dicts as the resident state's (the transports and the compiled steps write them)
        self.payload, self.committed, self.from_input = res.payload, res.committed, res.from_input
        self.inputs = ModelInputs(plan, res, self.seed)
        self.checks = Checks(plan, res, self.worker, checksum_policies)
        self.calls = ModelCalls(plan, res, self.backend, self.worker, self.inputs, self.checks)
        # Worker-side instrumentation: tap(epoch, value, cells, table (n, C, *cell), valid (n, C))
        # sees every candidate table where the payload lives (benchmarks, debugging).
        self.taps: list[Any] = []
        self.staging = Staging(plan, res, self.checks, self.taps)
        # rule id -> (model, score) the worker calls instead of the plan's (compile_models)
        self.models = self.calls.models
        self.read_clocks = self.inputs.read_clocks
        # values whose `inputs()` region some constraint reads: the only ones whose input flags
        # the worker must keep up to date
        self._tracks_inputs = {cp.target for cp in plan.constraints if cp.needs_inputs_region}
        self._cdims = {name: len(vp.cell_shape) for name, vp in plan.values.items()}  # cell dims
        self.store: Any = None  # a PayloadStore (lmpm.runtime.data.store) once the run has a dir
        # per value: the cells the last apply wrote (the halo transports send the routed ones)
        self.written: dict[str, Tensor] = {}
        self._views: dict[str, tuple[Tensor, Tensor, tuple[np.ndarray, np.ndarray] | None]] = {}
        # this epoch's requests and replies as they would cross a process boundary, counted when
        # ``count_bytes`` is set (in this process nothing crosses: one-process runs pay nothing)
        self.count_bytes = False
        self.traffic = Traffic()
        # Fault injection (tests, drills): from this epoch on, every proposal of this worker is
        # perturbed after its model ran, as if the model returned corrupt output (calls.corrupt)
        self.corrupt_from: int | None = None
        # the owner of the cells' metadata and decisions (None: a worker of a group, whose
        # owner is the group's)
        self._owner = Owner(plan, self.seed) if decides else None
        self.compiled: CompiledEpoch | None = None  # a fused data plane's steps (compile)
        # per compiled quorum value: its last step's columns (the replicas it outvoted)
        self.outvoted: dict[str, Outvoted | None] = {}
        # LMPM_VALIDATE=eager: checks each compiled epoch against the eager decision (set by
        # Run, lmpm.runtime.session; lmpm.runtime.data.validate)
        self.validator: EagerValidator | None = None
        self._mirror: Mirror | None = None  # off the CPU: the metadata the captured steps read
        self.windows: EpochWindows | None = None  # K epochs per replay (epoch_windows)

    def trusts(self, rp: RulePlan) -> bool:
        """The rule's model and score are LMPM's own: they get views of the payload, not copies
        (and their reads are gathered by compiled graphs under ``--compile``)."""
        return rp.id in self.inputs.trusted

    def dev(self, t: Tensor) -> Tensor:
        """The device copy of a static plan table (made once; the CPU tensor itself on CPU)."""
        return self.resident.dev(t)

    @property
    def tables(self) -> dict[str, ValueTables]:
        """Per proposed value, its constraint tables on this worker's device."""
        return self.checks.tables

    @property
    def owner(self) -> Owner:
        if self._owner is None:
            raise UsageError(f"worker {self.worker} is part of a group: the group owns its cells")
        return self._owner

    def epoch(self, req: EpochRequest) -> EpochReport:
        """Run one epoch on this worker's cells, which it owns (:meth:`Owner.epoch`)."""
        if self.count_bytes:
            self.traffic = Traffic()
        if self.validator is not None:  # LMPM_VALIDATE=eager (lmpm.runtime.data.validate)
            self.validator.begin()
        fused: Any = self if self.compiled is not None else None
        if self.windows is not None and self.windows.holds(req.epoch):
            fused = self.windows.take(req)  # replayed already, in a window of K epochs
        owner = self._owner if self._owner is not None else self.owner  # (a group's: raises)
        report = owner.epoch(self, req, fused)
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
    ) -> tuple[ProposeReply, list[str], dict[str, Fused]]:
        """Run the models; build the eager values' candidates (the compiled values' come in their
        steps, :meth:`step_fused`). Returns the eager reply, the values in commit order and the
        compiled values' proposals (every rule replica's columns, :func:`fuse`). An epoch that
        something watches (``--trace cells``, taps) or that corrupts proposals (fault drills) runs
        eagerly."""
        compiled = self.compiled
        assert compiled is not None
        specs = compiled.specs  # the values that compile
        if not specs or req.record or self.taps or self.corrupt_from is not None:
            compiled.stats.eager_epochs += 1
            reply = self.propose(req)
            return reply, list(reply.values), {}
        per_value, model_seconds = self.run_models(req)
        if self.validator is not None:  # the shadow decides from the same proposals
            self.validator.proposed(per_value, model_seconds)
        self.staging.staged = {}
        values = {}
        fused: dict[str, Fused] = {}
        for name, parts in per_value.items():
            if name in specs:
                fused[name] = fuse(parts, self.plan.values[name].dtype)
            else:
                values[name] = self.staging.build(
                    name, req.epoch, parts, req.fresh.get(name, False)
                )
        return ProposeReply(self.worker, values, model_seconds), list(per_value), fused

    def step_fused(
        self, owner: Owner, name: str, e: int, part: Fused, checksums: bool
    ) -> tuple[ValueEpoch, int, int]:
        """One compiled value's epoch: its step (payload and metadata written together), its
        commits appended to the store; its record, commits and violations."""
        compiled = self.compiled
        assert compiled is not None
        spec = compiled.specs[name]
        others = spec.others  # the values whose clocks its rules read
        if self._host:  # the step writes the owner's metadata itself
            state, why = owner.state[name], owner.why[name]
            clocks = {s: owner.state[s].clock for s in others} if others else _NO_CLOCKS
        else:  # a captured step: the device's mirror of it (its records come back to the host)
            mirror = self._mirror
            assert mirror is not None
            state, got = mirror.get(name)
            assert got is not None  # (a proposed value has why-codes)
            why = got
            clocks = {s: mirror.get(s)[0].clock for s in others}
        active = owner.active_mask(name, self.device)
        quota = owner.quota(name, e) if spec.quota else None  # (a schedule with a quota)
        meta = StepMeta(state, why, active, clocks, quota)
        out = compiled.step(name, e, part, self, meta)
        return self.settle_fused(owner, name, e, part, out, checksums)

    def settle_fused(
        self,
        owner: Owner,
        name: str,
        e: int,
        part: Fused,
        out: Any,
        checksums: bool,
        written: Tensor | None = None,
    ) -> tuple[ValueEpoch, int, int]:
        """A compiled value's step records (``out``: :meth:`CompiledEpoch.step`'s) as its epoch:
        its record (settled into the owner's host state after a captured step), commits appended
        to the store; its record, commits and violations. ``written``: the open cells' payload
        after the step, on the host (a replayed window's, whose later epochs moved the payload
        on)."""
        compiled = self.compiled
        assert compiled is not None
        rp, cells = part.rule, part.cells
        winner, changed, score, valid, violated, applies, new_clock, was, *quorum, counts = out
        if name in self.read_clocks.values:
            self.read_clocks.stamp(name, self.payload[name], cells[changed])
        n_commits, n_viol = counts.tolist()
        col_rule = compiled.columns(part.layout)
        if not self._host:  # the records name the open cells on the host
            cells = part.host_cells if part.host_cells is not None else self.calls.work_cells[rp.id]
        ve = ValueEpoch(
            name,
            cells,
            valid,
            score,
            col_rule,
            violated,
            owner.static[name].constraint_ids,
            winner,
            changed,
            new_clock,
            was,
            applies,
            disagreed=quorum[0] if quorum else None,
        )
        if quorum:
            self.outvoted[name] = Outvoted(quorum[1], col_rule, *compiled.replicas(part.layout))
        else:
            self.outvoted[name] = None
        if not self._host:
            rules = compiled.specs[name].rules
            owner.settle(name, e, rp.id if len(rules) == 1 else col_rule[winner[changed]], ve)
        if n_commits and (self.store is not None or checksums):
            self._store_fused(name, e, ve, written, checksums)
        return ve, n_commits, n_viol

    def _store_fused(
        self, name: str, e: int, ve: ValueEpoch, written: Tensor | None, checksums: bool
    ) -> None:
        """Append a compiled value's committed rows to the store; their checksums on ``ve``."""
        changed, cells = ve.changed, ve.cells
        n_commits = int(changed.count_nonzero())
        if written is not None:
            rows, new = ve.cells[changed], written[changed]
        else:
            if self._host:
                rows = cells if n_commits == cells.numel() else cells[changed]
            else:  # the committed rows picked on the host (no device-side mask and its wait)
                rows = self.resident.here(cells if n_commits == cells.numel() else cells[changed])
            new = self.payload[name].index_select(0, rows)
        if self.store is not None:
            self.store.append_commits(e, name, rows, new)
        if checksums:
            sums = torch.zeros(cells.numel(), dtype=torch.int64)
            sums[changed] = checksum(new, len(self.plan.values[name].cell_shape)).cpu()
            ve.checksum = sums

    def quorum_columns(self, name: str) -> Outvoted | None:
        """A compiled quorum value's candidate columns in its last step (None: not a quorum)."""
        return self.outvoted.get(name)

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
        self.calls.work_cells[rule] = cells

    @property
    def mirror(self) -> Mirror:
        """The device's copy of the owner's metadata (a fused data plane off the CPU)."""
        assert self._mirror is not None
        return self._mirror

    def read_options(self, rule: int) -> tuple[str, ...]:
        """What rule ``rule``'s model asks of its reads (clocks, dense; lmpm.runtime.data.reads)."""
        return tuple(self.inputs.read_opts.get(rule, ()))

    def model_of(self, rp: RulePlan) -> Any:
        """The model this worker calls for ``rp``: compiled (compile_models), else moved to its
        device, else as bound (what run_models calls)."""
        return self.calls.model_of(rp)

    def models_on_device(
        self, rules: list[tuple[RulePlan, Tensor, Tensor]], phases: dict[str, int | None], e: Tensor
    ) -> dict[str, tuple[RulePlan, Tensor, Tensor, Tensor, Tensor]]:
        """Inside a window's capture (lmpm.runtime.data.kepochs): every rule's reads and its
        capturable model (:meth:`ModelCalls.on_device`)."""
        return self.calls.on_device(rules, phases, e)

    def compile_reads(self, stats: Any = None) -> None:
        """Gather the reads of LMPM's own models with compiled graphs from now on (``--compile``;
        :class:`lmpm.runtime.data.compiled.ReadGathers`; ``stats``: the run's CompileStats)."""
        gather = self.inputs
        if gather.read_gathers is None:
            gather.read_gathers = ReadGathers(stats)
            for rp in self.plan.rules:
                if rp.id in gather.trusted:  # the rules whose reads it gathers (ModelInputs.gather)
                    gather.read_gathers.prepare(rp, self.resident)

    def compile_models(self) -> dict[str, tuple[Any, Any]]:
        """Call the compiled version of every model and score that opted in (``lmpm_compile``,
        lmpm.models.compile) from now on: what ``--compile`` does besides the epoch step. Returns
        rule name -> (model, score) wrappers (None where that one did not opt in)."""
        return self.calls.compile_models()

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
    def open_store(self, run_dir: str | Path, durable: bool = False) -> None:
        """Persist committed payload under ``run_dir`` from now on (lmpm.runtime.data.store);
        ``durable`` (--durable): every epoch's commit fsynced, as the commit log's."""
        self.store = PayloadStore(run_dir, self.worker, self.plan, durable)

    def close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def checkpoint(self, label: int, sync: bool = True) -> tuple[str, int, str]:
        """Write this worker's payload checkpoint for the start of epoch ``label`` (fsynced
        unless ``sync`` is False)."""
        assert self.store is not None, "open_store first"
        return self.store.checkpoint(
            label, {name: t.cpu().numpy() for name, t in self.payload.items()}, sync
        )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The workers whose payload shards a checkpoint of this data plane holds."""
        return (self.worker,)

    def checkpoint_shards(self, label: int, sync: bool = True) -> dict[str, dict[str, Any]]:
        """Per worker, the payload shard written for the start of epoch ``label``."""
        file, size, sha = self.checkpoint(label, sync)
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
        staging = self.staging
        staging.staged = {}
        fresh = req.fresh
        values = {}
        for name in per_value:
            values[name] = staging.build(name, e, per_value[name], name in fresh and fresh[name])
        if req.record and self.store is not None:
            for name, cells in req.record.items():
                st = self.staging.staged.get(name)
                if st is not None:
                    self.store.record_candidates(e, name, st.cells, st.table, cells)
        reply = ProposeReply(self.worker, values, model_seconds)
        if self.count_bytes:
            self.traffic.count(req, reply)
        return reply

    def run_models(self, req: ProposeRequest) -> tuple[dict[str, list[Proposal]], float]:
        """Gather every fired rule's reads, run all models and scores: per value, each rule
        replica's (rule, cells, replica, proposals (n, k, *cell), scores (n, k)); and the seconds
        the models took (:meth:`ModelCalls.run`)."""
        return self.calls.run(req, self.seed, self.corrupt_from)

    def log_cells(self, tracer: Any) -> bool:
        """One worker: the control plane's log writes the per-cell rows itself (False)."""
        return False

    # ---- apply -----------------------------------------------------------------------------------
    def apply(self, req: ApplyRequest) -> ApplyReply:
        """Write the winners of every value, make them durable, report what changed."""
        out: dict[str, Applied] = {}
        self.written = {}
        host = self._host
        for name in req.values:
            d = req.values[name]
            st = self.staging.staged[name]
            vp = self.plan.values[name]
            cdims = self._cdims[name]
            rows = None if d.rows is None else self.resident.here(d.rows)
            winner = d.winner if host else self.resident.here(d.winner)
            table = st.table if rows is None else st.table.index_select(0, rows)
            cells = st.cells if rows is None else st.cells.index_select(0, rows)
            changed: Tensor | None = None
            if d.weights is None and not cdims:
                new = pick(table, winner)
            elif d.weights is None:
                new = table[torch.arange(table.shape[0], device=self.device), winner]
            else:
                w = self.resident.here(d.weights).to(torch.float64)
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
            self._write(name, cells, new)
            sums = checksum(new, cdims) if req.checksums else None
            if self.store is not None:
                self.store.append_commits(req.epoch, name, cells, new)
            out[name] = Applied(
                None if changed is None else self.resident.meta(changed),
                None if sums is None else self.resident.meta(sums),
            )
        durable = self.store is not None
        if durable and req.sync:
            self.store.sync(req.epoch)
        self.staging.staged = {}
        reply = ApplyReply(self.worker, out, durable)
        if self.count_bytes:
            self.traffic.count(req, reply)
        return reply

    def _write(self, name: str, cells: Tensor, new: Tensor) -> None:
        """Write ``new`` (m, *cell) into ``cells`` of ``name`` and mark them committed. One cell of
        a scalar value on the host (causal generation) is two numpy stores, the tensors' versions
        bumped as a tensor write bumps them (the read caches key on them)."""
        views = self._cell_views(name) if cells.shape[0] == 1 else None
        if views is None:
            self.payload[name].index_copy_(0, cells, new)
            self.committed[name].index_fill_(0, cells, True)
        else:
            c = int(cells)
            views[0][c] = new.item()
            views[1][c] = True
            increment_version((self.payload[name], self.committed[name]))
        self.read_clocks.stamp(name, self.payload[name], cells)
        self.written[name] = cells
        if name in self._tracks_inputs:
            self.from_input[name].index_fill_(0, cells, False)

    def _cell_views(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """numpy views of a scalar value's host payload and committed flags (made once per
        tensor pair; None: not on the host, cells with a shape, or a dtype numpy lacks)."""
        payload, committed = self.payload[name], self.committed[name]
        hit = self._views.get(name)
        if hit is None or hit[0] is not payload or hit[1] is not committed:
            ok = self._host and payload.dim() == 1 and payload.dtype in _NUMPY
            views = (payload.numpy(), committed.numpy()) if ok else None
            hit = self._views[name] = (payload, committed, views)
        return hit[2]

    def record_columns(self, epoch: int, value: str, which: Tensor, cols: list[int]) -> None:
        """Record the staged candidates of ``value``'s cells in ``which`` (``--trace cells``), local
        column j as column ``cols[j]``: a group's merged column (lmpm.runtime.data.group)."""
        st = self.staging.staged.get(value)
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
                idx = self.resident.here(c)
                self.store.append_commits(epoch, name, idx, self.payload[name].index_select(0, idx))
        self.store.sync(epoch)
