"""`lmpm check PROGRAM --device cuda`: is a program, with its models, ready for a GPU?

The program runs a few epochs the way ``lmpm run --backend cuda`` runs it — every rule's model and
score and every predicate called as the run calls them, on a worker whose tensors are on the
device — and each finding becomes a diagnostic located twice: at the program's call
(file:line:col, caret) and at the line of the model's own file that did it.

- Without a GPU the device is simulated (:mod:`lmpm.workers.simcuda`): errors are what PyTorch
  raises on a real GPU (a CPU tensor combined with or indexing by a CUDA one, ``.numpy()`` of a
  CUDA tensor); warnings are what works but waits for the GPU on every call (a value read on the
  host, ``.tolist()``, a copy to the host, an output whose size depends on the data).
- With a GPU the check runs there (``backend="cuda"``): errors are the ones the device raised;
  host syncs come from ``torch.cuda.set_sync_debug_mode("warn")``.

Example:
    >>> from lmpm.runtime.devcheck import check_device
    >>> report = check_device("examples/sudoku.lmpm",
    ...                       inputs={"Grid": "examples/sudoku/puzzle.json"}, epochs=2)
    >>> report.ready, report.errors
    (True, [])
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmpm.bindings import Bindings
from lmpm.errors import Diagnostic, LmpmError, ModelError, RuntimeFault, Span
from lmpm.workers import simcuda

__all__ = ["DeviceReport", "check_device"]

# Diagnostic codes (docs/runtime.md, "Devices"): errors fail on a real GPU, warnings stall it.
G_MIXED = "G001"  # a tensor on another device combined with, or indexing, one on the device
G_NUMPY = "G002"  # .numpy() of a device tensor
G_FAILED = "G003"  # the call failed on the device for another reason (named in the message)
G_SYNC = "G101"  # a tensor's value read on the host (.item(), int(), float(), bool(), an `if`)
G_SHAPE = "G102"  # an op whose output size depends on the data (nonzero, mask indexing, unique)
G_COPY = "G103"  # a copy to the host (.cpu(), .to("cpu"))
G_TOLIST = "G104"  # .tolist()
G_H2D = "G105"  # a blocking copy of host memory to the device (each call)
_WARNING_CODES = {
    "sync": G_SYNC,
    "data-dependent": G_SHAPE,
    "host-copy": G_COPY,
    "tolist": G_TOLIST,
    "h2d": G_H2D,
}
_WHAT = {
    G_SYNC: "reads a tensor's value on the host (`.item()`, `int()`, `float()`, `bool()` or an "
    "`if` on a tensor): it works on a GPU, and waits for it",
    G_SHAPE: "runs an op whose output size depends on the data (`nonzero`, boolean-mask "
    "indexing, `unique`, `masked_select`): the host waits for the GPU to learn the size",
    G_COPY: "copies a tensor to the host (`.cpu()`, `.to('cpu')`): the host waits for the GPU",
    G_TOLIST: "calls `.tolist()` on a device tensor: the host waits for the GPU and copies it",
    G_H2D: "copies host memory to the device and waits for it (`torch.tensor(..., "
    "device=...)`, `.to(device)` of a CPU tensor): make the tensor on the device, or move it "
    "once and keep it",
}
HINT_SYNC = (
    "keep the value on the device (`torch.where`, masks with a fixed shape, `clamp` instead of "
    "Python `min`), or compute it once outside the model call"
)
_LMPM = Path(__file__).resolve().parents[1]
_RUNTIME_DIRS = (
    *(str(_LMPM / d) for d in ("runtime", "workers", "resolve", "vm")),
    # the built-in models' weights and tables, moved to a device once and cached (not per call)
    str(_LMPM / "models" / "weights" / "__init__.py"),
)


@dataclass(slots=True)
class DeviceReport:
    """What ``check_device`` found: diagnostics, and which of the program's calls it ran."""

    device: str  # "simulated on the CPU" or the GPU's name
    simulated: bool
    epochs: int  # epochs run
    diagnostics: list[Diagnostic] = field(default_factory=list)
    exercised: set[str] = field(default_factory=set)  # rules whose model (and score) ran
    not_exercised: list[str] = field(default_factory=list)  # rules that never fired

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]

    @property
    def ready(self) -> bool:
        return not self.errors


class _Calls:
    """Maps the frames of a model, score or predicate call to the program's call site."""

    def __init__(self, rules: Mapping[str, Any], constraints: Mapping[str, Any]) -> None:
        from lmpm.runtime.data.checks import Checks
        from lmpm.vm.runner import WorkflowRun
        from lmpm.workers import batch

        self.model_code = batch.execute.__code__
        self.score_code = batch.rule_score.__code__
        self.predicate_code = Checks.user_predicate.__code__
        self.vm_model_code = WorkflowRun.logits.__code__
        self.rules = rules  # name -> RulePlan (or the workflow's IR rule)
        self.constraints = constraints  # name -> ConstraintPlan

    def __call__(self) -> tuple[str, str] | None:
        f = sys._getframe(1)
        while f is not None:
            code = f.f_code
            if code is self.model_code:
                return ("model", f.f_locals["call"].rule)
            if code is self.score_code:
                return ("score", f.f_locals["call"].rule)
            if code is self.predicate_code:
                return ("predicate", f.f_locals["cp"].name)
            if code is self.vm_model_code:
                return ("model", f.f_locals["self"].rule_name)
            f = f.f_back  # type: ignore[assignment]
        return None

    def span(self, call: tuple[str, str]) -> Span | None:
        kind, name = call
        if kind == "predicate":
            cp = self.constraints.get(name)
            if cp is None:
                return None
            return cp.ir.call.span if cp.ir.call is not None else cp.ir.span
        rp = self.rules.get(name)
        if rp is None:
            return None
        rule = getattr(rp, "ir", rp)  # a RulePlan, or a workflow's rule (IR)
        if kind == "score" and rule.score is not None:
            return rule.score.span  # type: ignore[no-any-return]
        return rule.proposal.span  # type: ignore[no-any-return]


class _Recording:
    """A worker backend that notes the rules whose work it was handed; the rest is the wrapped
    backend's own."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rules: set[str] = set()

    def dispatch(self, work: Any) -> Any:
        from lmpm.workers.batch import as_items

        items = as_items(work)
        self.rules.update(item.rule for item in items)
        return self.inner.dispatch(items)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _in_runtime(file: str) -> bool:
    """LMPM's own runtime (worker, data plane, policies): not the program's models."""
    return str(Path(file).resolve()).startswith(_RUNTIME_DIRS)


def _call_name(call: tuple[str, str]) -> str:
    kind, name = call
    return f"the {kind} of rule `{name}`" if kind != "predicate" else f"predicate `{name}`"


def _warnings_of(events: Sequence[simcuda.DeviceEvent], calls: _Calls) -> list[Diagnostic]:
    """One warning per (kind, line of the model's file), with how often it happened."""
    seen = Counter((ev.kind, ev.file, ev.line, ev.func, ev.call) for ev in events)
    out = []
    for (kind, file, line, func, call), n in seen.items():
        if call is None or _in_runtime(file):
            continue  # the runtime's own per-epoch reads are not the program's business
        code = _WARNING_CODES[kind]
        times = f" ({n} times)" if n > 1 else ""
        out.append(
            Diagnostic(
                code,
                "warning",
                f"{_call_name(call)} {_WHAT[code]}{times} (at {file}:{line}, in {func})",
                calls.span(call),
                HINT_SYNC,
            )
        )
    return out


def _error_of(exc: LmpmError) -> Diagnostic:
    cause = exc.__cause__
    message = exc.message
    if (
        isinstance(cause, simcuda.SimulatedDeviceError)
        or "same device" in message  # PyTorch's own words on a GPU, and R059's
        or "device type tensor to numpy" in message
    ):
        code = G_NUMPY if "numpy" in exc.message else G_MIXED
        hint = simcuda.HINT_MIXED
    else:
        code, hint = G_FAILED, exc.hint or ""
    return Diagnostic(code, "error", exc.message, exc.span, hint)


SYNC_WARNING = "called a synchronizing CUDA operation"  # PyTorch's detector, per sync


@contextmanager
def _sync_warnings_on_gpu() -> Iterator[simcuda.Simulation]:
    """On a real GPU: PyTorch's own sync detector (``set_sync_debug_mode("warn")``), each of its
    warnings recorded where it happened, as the simulated device records its events."""
    seen = simcuda.Simulation()

    def show(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
        # each sync's warning; not the one that turning the detector on gives (a prototype)
        if SYNC_WARNING not in str(message):
            return
        func, f = "?", sys._getframe(1)
        while f is not None:  # the frame that did it: the warning's file and line
            if f.f_code.co_filename == filename and f.f_lineno == lineno:
                func = f.f_code.co_name
                break
            f = f.f_back  # type: ignore[assignment]
        call = seen.locate() if seen.locate else None
        seen.warnings.append(simcuda.DeviceEvent("sync", "sync", filename, lineno, func, call))

    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode(before)


def _names(plan: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return {rp.name: rp for rp in plan.rules}, {cp.name: cp for cp in plan.constraints}


WORKFLOW_STREAMS = 8  # streams a workflow's check runs (the step is the same for any number)
WORKFLOW_STEPS = 32  # VM steps per epoch of --epochs


@dataclass(frozen=True, slots=True)
class _Setup:
    """How the checked program runs, as ``lmpm run`` would run it."""

    params: Mapping[str, int] | None  # the --set overrides
    loaded: Bindings  # the --bind modules, loaded
    inputs: Mapping[str, str] | None  # --input NAME=PATH
    epochs: int  # epochs to run (a workflow: × WORKFLOW_STEPS steps; training: × TRAINING_STEPS)
    seed: int
    tokenizers: Mapping[str, str | Path] | None  # --tokenizer NAME=PATH


def _check_workflow(
    front: Any, report: DeviceReport, setup: _Setup, diags: list[Diagnostic]
) -> DeviceReport:
    """A program with a workflow runs on the token-stream VM (`lmpm vm run`): its model and the
    VM's step on the device, a few streams for ``epochs`` × WORKFLOW_STEPS steps."""
    from lmpm.vm import WorkflowRun

    rule = None
    events: Sequence[simcuda.DeviceEvent] = ()
    steps = 0
    ctx = _watch(report.simulated)
    try:
        with ctx as sim:
            run = WorkflowRun(
                front.ir,
                overrides=setup.params,
                bindings=setup.loaded,
                seed=setup.seed,
                streams=WORKFLOW_STREAMS,
                device="cuda",
            )
            rule = run.ins.rule
            calls = _Calls({run.rule_name: rule}, {})
            sim.locate = calls
            try:
                while not run.vm.done and steps < setup.epochs * WORKFLOW_STEPS:
                    run.step()
                    steps += 1
            finally:
                events = sim.errors + sim.warnings
    except (ModelError, RuntimeFault) as exc:
        diags.append(_error_of(exc))
    if rule is not None:
        diags.extend(_warnings_of([e for e in events if e.kind != "error"], calls))
        report.exercised = {run.rule_name} if steps else set()
    report.epochs = steps
    report.diagnostics = diags
    return report


TRAINING_STEPS = 2  # inner steps per epoch of --epochs (a training rule's H is often 50)


def _check_training(
    front: Any, report: DeviceReport, setup: _Setup, diags: list[Diagnostic]
) -> DeviceReport:
    """A training program (a `Params` value proposed by `minimize(...)`): one worker's inner
    loop — forward, loss, backward, optimizer step, the proposal's norms and checksums, the
    score on held-out data — on the device, ``epochs`` × TRAINING_STEPS inner steps."""
    from lmpm.train.cli import load_data
    from lmpm.train.frontend import train_spec
    from lmpm.train.worker import TrainWorker

    spec = train_spec(front.ir, dict(setup.params or {}))
    assert spec is not None  # (is_training)
    data, init = load_data(spec, dict(setup.inputs or {}))
    name = spec.rule.rule
    ctx = _watch(report.simulated)
    events: Sequence[simcuda.DeviceEvent] = ()
    ran = 0
    try:
        with ctx as sim:
            worker = TrainWorker(
                spec,
                0,
                1,
                data,
                total_steps=setup.epochs * TRAINING_STEPS,
                init=init,
                device="cuda",
            )
            try:
                for e in range(setup.epochs):
                    worker.propose(e, steps=TRAINING_STEPS)
                    worker.evaluate()
                    ran += 1
            finally:
                events = sim.errors + sim.warnings
    except (ModelError, RuntimeFault) as exc:
        diags.append(_error_of(exc))
    except simcuda.SimulatedDeviceError as exc:
        diags.append(Diagnostic(G_MIXED, "error", f"rule `{name}`: {exc}", spec.rule.span))
    # (the trainer is LMPM's own code: its syncs are one per inner step, reported as a count)
    syncs = sum(1 for ev in events if ev.kind != "error")
    if syncs and ran:
        diags.append(
            Diagnostic(
                G_SYNC,
                "warning",
                f"rule `{name}`: the inner loop waited for the device {syncs} times in "
                f"{ran * TRAINING_STEPS} steps (the loss read on the host each step, "
                "checksums of the proposal)",
                spec.rule.span,
            )
        )
    report.exercised = {name} if ran else set()
    report.epochs = ran
    report.diagnostics = diags
    return report


def check_device(
    program: str | Path,
    *,
    device: str = "cuda",
    params: Mapping[str, int] | None = None,
    bind: Sequence[str] = (),
    inputs: Mapping[str, str] | None = None,
    epochs: int = 3,
    seed: int = 0,
    simulate: bool | None = None,
    tokenizers: Mapping[str, str | Path] | None = None,
) -> DeviceReport:
    """Run ``program`` for ``epochs`` epochs on ``device`` (simulated where there is no GPU, or
    when ``simulate``) and report what fails or stalls there. Source errors raise as usual."""
    from lmpm.ir import compile_file

    if device != "cuda":
        from lmpm.errors import UsageError

        raise UsageError(f"--device {device}: the device check knows cuda", code="U110")
    if simulate is None:
        simulate = not torch.cuda.is_available()
    loaded = Bindings(bind)  # checked against the names the run binds, as `lmpm run` checks
    front = compile_file(program, overrides=dict(params or {}), bound_names=loaded.user_names())
    diags: list[Diagnostic] = []  # (the program's own warnings are `lmpm check`'s)
    report = DeviceReport(
        "simulated on the CPU" if simulate else torch.cuda.get_device_name(),
        simulate,
        0,
    )
    setup = _Setup(params, loaded, inputs, epochs, seed, tokenizers)
    if front.ir.workflows:
        return _check_workflow(front, report, setup, diags)
    from lmpm.train.frontend import is_training

    if is_training(front.ir):
        return _check_training(front, report, setup, diags)
    return _check_cells(front, report, setup, diags)


def _watch(simulated: bool) -> Any:
    """What records the device's events: the simulated device, or PyTorch's sync detector on a
    real GPU (both yield a :class:`simcuda.Simulation`)."""
    return simcuda.simulated_cuda() if simulated else _sync_warnings_on_gpu()


def _check_cells(
    front: Any, report: DeviceReport, setup: _Setup, diags: list[Diagnostic]
) -> DeviceReport:
    """A program of cell values: ``epochs`` epochs of the engine with its worker on the device."""
    from lmpm.runtime.session import Run

    run: Run | None = None
    backend: _Recording | None = None
    calls: _Calls | None = None
    events: Sequence[simcuda.DeviceEvent] = ()
    try:
        with _watch(report.simulated) as sim:
            run = Run(
                front,
                params=setup.params,
                bindings=setup.loaded,
                inputs=setup.inputs,
                seed=setup.seed,
                backend="simcuda" if report.simulated else "cuda",
                tokenizers=setup.tokenizers,
            )
            backend = run.dataplane.backend = _Recording(run.dataplane.backend)
            calls = sim.locate = _Calls(*_names(run.plan))
            try:
                for _ in range(setup.epochs):
                    run.run(1)
                    report.epochs += 1
            finally:
                events = sim.errors + sim.warnings
    except (ModelError, RuntimeFault) as exc:
        diags.append(_error_of(exc) if calls is not None else exc.diagnostics[0])
    finally:
        if run is not None:
            run.close()
    if backend is not None:
        report.exercised = set(backend.rules)
    if calls is not None:
        diags.extend(_warnings_of([e for e in events if e.kind != "error"], calls))
        report.not_exercised = [r for r in calls.rules if r not in report.exercised]
    report.diagnostics = diags
    return report
