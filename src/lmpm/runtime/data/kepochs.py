"""K epochs per CUDA-graph replay (``lmpm run --compile --backend cuda --epochs-per-replay K``).

The captured epoch (:mod:`lmpm.runtime.data.captured`) replays one graph per (value, bucket) step
and runs each rule's model eagerly before it, so every epoch costs the model's launches, one graph
launch per value and one wait for the step's records. Where the schedule needs no host decision
between epochs, K whole epochs -- each rule's reads, its model and each value's compiled step, in
the order an epoch runs them -- are captured as one graph and replayed with one launch; the records
of all K epochs land in one static buffer (:func:`lmpm.runtime.protocol.pack`) that reaches the
host in one copy, the replay's one wait. The host then runs the K epochs' bookkeeping in order
through the ordinary :meth:`lmpm.runtime.data.owner.Owner.epoch` (opened cells, why-codes, clocks
and provenance settled from the records, the report, the observers), each epoch's model and step
taken from the window instead of run (:class:`Replayed`). So a window commits exactly what K
single epochs commit, and the records the observers see are the same.

A window is possible when (:func:`reason` says why not):

- every proposed value compiles (an eager value's model reads the payload of its epoch's start,
  which the window has already moved on), and one rule proposes it, without quorum replicas (a
  window runs one model per value: :meth:`lmpm.runtime.data.calls.ModelCalls.on_device`);
- the schedule's open cells depend on the epoch only (``all``, ``red-black``, ``independent``:
  :meth:`Schedule.phase` is not None); ``raster``, ``random`` and ``confidence`` open cells by the
  committed state, a host decision each epoch;
- no rule has a trigger or keyword arguments computed from ``e``, nor a score function, nor asks
  for its reads' clocks, and every model is *capturable*: it declares ``lmpm_capture = True`` and
  is then a pure torch function of its inputs (no value read on the host, no data-dependent
  shape), returning ``(proposal, score)``; it gets ``epoch`` as a 0-d int64 device tensor. A
  capturable model's output is not checked for non-finite scores inside a window (single epochs
  check it);
- the run stops after a number of epochs (``--until stable`` decides after each epoch), runs no
  payload guard and no ``LMPM_VALIDATE=eager``, and traces no candidates.

A window never runs past the run's end or a checkpoint (which reads the payload after its epoch):
the epochs left are run as windows of the largest power of two that fits, then single epochs (a
window of 16 with 7 epochs left runs 4, 2, 1). The open cells' payload after each epoch's step
travels with the records, so a run directory's store appends each epoch's committed rows as of
that epoch. The first
cycle of the schedule after the windows are set up runs singly, so that each value's step is
compiled and each rule's static rows are kept before a window captures them. Where a capture
finds a wait for the device (the simulated device checks every capture), the run goes on with
single epochs and the summary says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import UsageError
from lmpm.runtime.config import check_epochs_per_replay
from lmpm.runtime.data.compiled import Fused, StepMeta
from lmpm.runtime.protocol import (
    EpochRequest,
    Layout,
    ProposeReply,
    ProposeRequest,
    pack,
    unpack,
)
from lmpm.runtime.records import ValueEpoch
from lmpm.workers import graphs

# the records of one value's step: CompiledEpoch.step's 9 outputs and the open cells' payload
# after it (the store appends the committed rows as of their epoch)
_RECORDS = 10


def check_k(k: int) -> int:
    """``k`` if it is a valid number of epochs per replay (a power of two, 1 to 64), else U109."""
    check_epochs_per_replay(k)
    return k


def capturable(model: Any) -> bool:
    """Whether a bound model declares itself capturable (``lmpm_capture = True``): a pure torch
    function of its inputs that reads no value on the host and makes no data-dependent shape."""
    return getattr(model, "lmpm_capture", False) is True


def reason(dataplane: Any) -> str | None:
    """Why ``dataplane``'s epochs cannot be replayed K at a time (None: they can)."""
    compiled = dataplane.compiled
    if compiled is None or compiled.captured is None:
        return "the compiled steps run directly on the CPU (no graph launch to save)"
    plan = dataplane.plan
    for name, why in compiled.reasons.items():
        if why is not None:
            return f"`{name}` runs eagerly ({why})"
        rules = plan.rules_by_target[name]
        if len(rules) > 1 or rules[0].replicas != 1 or compiled.specs[name].quorum:
            return (
                f"several rules or quorum replicas propose `{name}` (a window replays one "
                "model per value)"
            )
    schedule = dataplane.owner.schedule
    for name in plan.rules_by_target:
        if schedule.phase(name, 0) is None:
            return (
                f"the schedule `{schedule.name}` opens the cells of `{name}` by the committed "
                "state (a host decision each epoch)"
            )
    for rp in plan.rules:
        if rp.target not in plan.rules_by_target:
            continue
        model = dataplane.model_of(rp)
        if dataplane.owner.triggered[rp.id]:
            return f"rule `{rp.name}` has a trigger (a host decision each epoch)"
        if rp.epoch_args:
            return f"rule `{rp.name}` computes keyword arguments from e"
        if rp.score is not None:
            return f"rule `{rp.name}` has a score function"
        if dataplane.read_options(rp.id):
            return f"the model of rule `{rp.name}` asks for its reads' clocks or dense reads"
        if not capturable(model):
            return (
                f"the model of rule `{rp.name}` is not capturable (it does not declare "
                "lmpm_capture = True: it may read values on the host)"
            )
    return None


class Replayed:
    """One epoch of a replayed window as :meth:`Owner.epoch` sees a fused data plane: the models'
    outputs and the steps' records come from the window (already run on the device)."""

    def __init__(self, dataplane: Any, parts: dict[str, Any], records: dict[str, Any]) -> None:
        self.dataplane = dataplane
        self.parts = parts  # value -> its rule's proposal (rule, cells, replica, prop, score)
        self.records = records  # value -> the step's records (host tensors)

    def propose_fused(self, req: ProposeRequest) -> tuple[ProposeReply, list[str], dict[str, Any]]:
        return ProposeReply(self.dataplane.worker, {}, 0.0), list(self.parts), self.parts

    def step_fused(
        self, owner: Any, name: str, e: int, part: Any, checksums: bool
    ) -> tuple[ValueEpoch, int, int]:
        *out, written = self.records[name]
        self.dataplane.work_cells(part[0].id, part[1])
        return self.dataplane.settle_fused(owner, name, e, part, out, checksums, written)

    def quorum_columns(self, name: str) -> Any:
        return self.dataplane.quorum_columns(name)

    def sync(self, epoch: int) -> bool:
        return bool(self.dataplane.sync(epoch))


@dataclass
class _Graph:
    """One window's graph: ``m`` epochs from a start phase, its records in one buffer."""

    m: int
    base: Tensor  # () int64 device: the window's first epoch (copied in per replay)
    replay: Any
    packed: Tensor
    layout: Layout
    parts: list[dict[str, Any]]  # per epoch: value -> its rule's Fused proposals (host cells)
    holds: tuple[Tensor, ...]  # the tensors the graph reads at fixed addresses


@dataclass
class WindowStats:
    """What the windows did (the run's summary line)."""

    windows: int = 0  # replays
    epochs: int = 0  # epochs run inside them
    captures: int = 0  # window graphs captured
    host_seconds: float = 0.0  # the host's time in replay() (the launch and the records' copy)
    sizes: set[int] = field(default_factory=set)


class EpochWindows:
    """A fused CUDA data plane's windows of K epochs (see the module's docstring)."""

    def __init__(self, dataplane: Any, k: int, start: int) -> None:
        self.dataplane = dataplane
        self.k = check_k(k)
        self.note = reason(dataplane) if k > 1 else None  # why K is 1 (None: it is not)
        # the schedule's first cycle from here runs singly (steps compiled, static rows kept)
        self.ready_at = start + dataplane.owner.schedule.period
        self.stats = WindowStats()
        self._graphs: dict[tuple[Any, ...], _Graph] = {}
        self._layout: Layout = []  # the records' layout in a graph's buffer (set by its capture)
        self._stash: dict[int, tuple[dict[str, Any], dict[str, Any], frozenset[int] | None]] = {}

    @property
    def on(self) -> bool:
        return self.k > 1 and self.note is None

    def summary(self) -> str:
        """One line for the end of a run."""
        if self.k == 1:
            return "1 epoch per replay"
        if self.note is not None:
            return f"1 epoch per replay, not {self.k}: {self.note}"
        st = self.stats
        return (
            f"{self.k} epochs per replay ({st.epochs} epochs in {st.windows} replays of "
            f"{st.captures} graph{'s' if st.captures != 1 else ''})"
        )

    def size(self, e: int, limit: int) -> int:
        """How many epochs from ``e`` to replay now (1: a single epoch)."""
        if not self.on or e < self.ready_at or e in self._stash:
            return 1
        dp = self.dataplane
        if dp.taps or dp.corrupt_from is not None:
            self.stop("something watches the candidate tables (taps, fault drills)")
        elif dp.validator is not None:
            self.stop("LMPM_VALIDATE=eager decides each epoch eagerly too")
        if not self.on:
            return 1
        m = min(self.k, limit - e)
        return 1 << (m.bit_length() - 1) if m > 1 else 1

    def stop(self, why: str) -> None:
        """Run single epochs from now on, for ``why`` (the summary says it)."""
        if self.note is None and self.k > 1:
            self.note = why

    def holds(self, e: int) -> bool:
        return e in self._stash

    def take(self, req: EpochRequest) -> Replayed:
        """Epoch ``req.epoch`` of the last replay, for :meth:`Owner.epoch`."""
        parts, records, active = self._stash.pop(req.epoch)
        if active != req.active:
            raise UsageError(
                f"the RuleSet changed inside a window of {self.k} epochs (epoch {req.epoch} ran "
                "with the RuleSet of the window's start)",
                code="U108",
                hint="change the RuleSet between runs, or run with --epochs-per-replay 1",
            )
        return Replayed(self.dataplane, parts, records)

    def replay(self, e: int, m: int, active: frozenset[int] | None) -> bool:
        """Run epochs ``e .. e+m-1`` on the device with one launch and bring their records to
        the host (one copy); False (and single epochs from now on) when the window cannot be
        captured."""
        t0 = time.perf_counter()
        dp = self.dataplane
        schedule = dp.owner.schedule
        phases = tuple(
            tuple(schedule.phase(name, e + i) for name in dp.plan.rules_by_target) for i in range(m)
        )
        key = (m, phases, active)
        g = self._graphs.get(key)
        if g is not None and not all(a is b for a, b in zip(g.holds, self._fixed())):
            g = None  # a resume replaced the payload: capture again
        if g is None:
            try:
                g = self._graphs[key] = self._capture(e, m, active)
            except (graphs.NotCapturable, RuntimeError) as exc:  # (a real capture's refusal)
                self.stop(f"an epoch could not be captured ({str(exc).splitlines()[0]})")
                return False
            self.stats.captures += 1
        g.base.fill_(e)
        g.replay()
        out = unpack(g.packed.cpu(), g.layout)  # the window's one wait for the device
        nv = len(g.parts[0])
        for i in range(m):
            recs = out[i * nv * _RECORDS : (i + 1) * nv * _RECORDS]
            records = {
                name: tuple(recs[j * _RECORDS : (j + 1) * _RECORDS])
                for j, name in enumerate(g.parts[i])
            }
            self._stash[e + i] = (g.parts[i], records, active)
        dp.compiled.stats.steps += m * nv
        st = self.stats
        st.windows += 1
        st.epochs += m
        st.sizes.add(m)
        st.host_seconds += time.perf_counter() - t0
        return True

    def _fixed(self) -> tuple[Tensor, ...]:
        dp = self.dataplane
        return (*dp.payload.values(), *dp.committed.values(), *dp.from_input.values())

    def _capture(self, e: int, m: int, active: frozenset[int] | None) -> _Graph:
        """Capture epochs ``e .. e+m-1``: per epoch every rule's reads and model (the state at
        the epoch's start), then every value's step in commit order."""
        dp = self.dataplane
        owner = dp.owner
        owner.set_active(active)
        base = torch.zeros((), dtype=torch.int64, device=dp.device)
        epochs = []  # per epoch: [(rule, host cells, device cells)], its phases
        for i in range(m):
            open_ = owner.open_cells(e + i, 0, e + i)
            work = owner.work(e + i, open_)
            rules = [(dp.plan.rules[rw.rule], rw.cells, rw.cells.to(dp.device)) for rw in work]
            phases = {name: owner.schedule.phase(name, e + i) for name in open_}
            epochs.append((rules, phases))
        mirror = dp.mirror
        states = {}
        for name in dp.plan.rules_by_target:  # the device metadata, current before capturing
            st, why = mirror.get(name)
            states[name] = (st, why)
        actives = {name: owner.active_mask(name, dp.device) for name in dp.plan.rules_by_target}
        parts: list[dict[str, Any]] = []
        compiled = dp.compiled
        written = [*self._fixed()]
        for st, why in states.values():
            written += [st.committed, st.clock, st.rule, st.epoch, st.score]
            if why is not None:
                written.append(why)

        def body() -> list[Tensor]:
            steps = compiled.stats.steps
            parts.clear()
            flat: list[Tensor] = []
            for i, (rules, phases) in enumerate(epochs):
                e_t = base + i
                props = dp.models_on_device(rules, phases, e_t)
                got: dict[str, Any] = {}
                for name, (rp, cells_host, cells, prop, sc) in props.items():
                    st, why = states[name]
                    spec = compiled.specs[name]
                    clocks = {s: states[s][0].clock for s in spec.others}
                    part = Fused(rp, cells, ((rp.id, 0, prop.shape[1]),), prop, sc, None, None)
                    out = compiled.step(
                        name, e_t, part, dp, StepMeta(st, why, actives[name], clocks)
                    )
                    flat += [*out, dp.payload[name].index_select(0, cells)]
                    got[name] = part._replace(cells=cells_host)
                parts.append(got)
            compiled.stats.steps = steps  # (counted per replay)
            packed, self._layout = pack(flat)
            return [packed]

        (packed,), replay = graphs.capture(body, keep=written)
        return _Graph(m, base, replay, packed, self._layout, list(parts), tuple(self._fixed()))
