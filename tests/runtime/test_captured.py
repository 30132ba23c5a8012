"""The compiled epoch on CUDA (``lmpm run --compile --backend cuda``, lmpm.runtime.data.captured),
proven on a CPU.

On the simulated CUDA device (:mod:`lmpm.workers.simcuda`) each value's step is "captured" by
running its own function on the graph's buffers, and the capture refuses a step that would wait
for the device (a host read, a data-dependent size, a copy to or from the host), as a real capture
does. These tests hold the captured steps, over the device's mirror of the owner's metadata, to
the eager CPU epoch: the payload, clocks, provenance, why-codes and every epoch's record. The real
capture runs on a GPU (the gpu-marked test below, ``scripts/gpu_check.sh``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from lmpm.ir import compile_file, compile_source
from lmpm.runtime.data.compiled import flat_step, value_step
from lmpm.runtime.session import Run, resume
from lmpm.workers import graphs
from lmpm.workers.simcuda import SimTensor, simulated_cuda

sys.path.insert(0, str(Path(__file__).parent))
from test_compiled import EX, _video, same_runs, step_only
from test_runtime_dataplane import ENGINE_EXAMPLES, _examples
from test_runtime_differential import BINDINGS, programs, used

# the examples with a value whose step compiles (every one: latent's M has two rules, its Z a
# bound predicate, an eager island; lmpm show --compiled)
CAPTURED = {"gpt", "text", "text_free", "video", "video_free", "sudoku", "latent", "latent256"}


@pytest.mark.parametrize("name", ENGINE_EXAMPLES)
def test_every_example_captured_on_the_simulated_gpu_commits_as_eager_on_the_cpu(
    name: str, tmp_path: Path
) -> None:
    prog, params, inputs, epochs = _examples(tmp_path)[name]
    cpu = Run.from_file(prog, params=params, inputs=inputs, seed=3)
    want = cpu.run(epochs)
    with simulated_cuda() as sim:
        gpu = Run.from_file(
            prog, params=params, inputs=inputs, seed=3, backend="simcuda", compile=True
        )
        got = gpu.run(epochs)
        same_runs(cpu, want, gpu, got)
        resident = gpu.dataplane.payload
        assert all(isinstance(t, SimTensor) for t in resident.values())
    assert not sim.errors
    stats = gpu.engine.compiled.stats  # type: ignore[union-attr]
    if name in CAPTURED:
        assert stats.steps > 0 and 1 <= stats.captures <= stats.steps
        assert stats.eager_epochs == 0
    else:
        assert stats.captures == 0


def test_each_step_is_captured_once_per_bucket_and_replayed() -> None:
    """Causal text opens one cell per epoch: one graph, replayed every epoch (no recapture)."""
    front = compile_file(EX / "text.lmpm")
    prompt = {"Txt": str(EX / "text" / "prompt.txt")}
    with simulated_cuda():
        run = Run(front, inputs=prompt, backend="simcuda", compile=True)
        run.run(12)
    stats = run.engine.compiled.stats  # type: ignore[union-attr]
    assert stats.steps == 12 and stats.captures == 1
    assert run.dataplane.mirror.uploads == 1  # nothing but the steps changed it
    summary = run.engine.compiled.summary()  # type: ignore[union-attr]
    assert "12 compiled steps, replayed as 1 CUDA graph)" in summary


def test_eager_epochs_between_captured_ones_refresh_the_device_mirror() -> None:
    """An epoch a tap watches runs eagerly and writes the host metadata: the next captured step
    must read it (the owner's version of the value moved, so the mirror copies it up again)."""
    cpu = _video(3, 8, 8, seed=4)(False)
    want = cpu.run(7)
    with simulated_cuda():
        run = _video(3, 8, 8, seed=4, backend="simcuda")(True)
        got = [run.run(2)]  # (run(n): up to epoch n)
        run.dataplane.taps.append(lambda *_: None)
        got.append(run.run(4))
        run.dataplane.taps.clear()
        got.append(run.run(7))
    stats = run.engine.compiled.stats  # type: ignore[union-attr]
    assert stats.eager_epochs == 2 and stats.steps > 0
    assert run.dataplane.mirror.uploads > 1
    records = [r for res in got for r in res.records]
    assert [r.commits for r in records] == [r.commits for r in want.records]
    for name in cpu.plan.values:
        assert torch.equal(cpu.payload(name), run.payload(name)), name
        for f in ("committed", "clock", "rule", "epoch", "score"):
            a, b = getattr(cpu.engine.state[name], f), getattr(run.engine.state[name], f)
            assert torch.equal(a, b), (name, f)
    for name, why in cpu.engine.why.items():
        assert torch.equal(why, run.engine.why[name]), name


def test_resume_a_captured_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run on the simulated GPU stopped after 10 epochs and resumed there ends where an eager
    CPU run does: the resume loads new payload tensors, so the step is captured again over them,
    and the mirror takes the restored metadata."""
    step_only(monkeypatch)
    program = EX / "text.lmpm"
    front = compile_file(program)
    prompt = {"Txt": str(EX / "text" / "prompt.txt")}
    with simulated_cuda() as sim:
        first = Run(front, inputs=prompt, compile=True, backend="simcuda")
        first.log_to(tmp_path / "r", source=program.read_text(), checkpoint_every=4)
        first.run(10)
        first.finish()
        again = resume(tmp_path / "r", compile=True, backend="simcuda")
        assert again.restored is not None and again.restored.epoch == 10
        res = again.run(until_stable=True)
        again.finish()
    assert not sim.errors
    eager = Run(front, inputs=prompt)
    want = eager.run()
    assert again.engine.epoch == want.epochs and res.stable
    assert torch.equal(again.payload("Txt").cpu(), eager.payload("Txt"))
    for f in ("committed", "clock", "rule", "epoch", "score"):
        a, b = getattr(again.engine.state["Txt"], f), getattr(eager.engine.state["Txt"], f)
        assert torch.equal(a, b), f


def test_the_simulated_capture_refuses_a_step_that_waits_for_the_device() -> None:
    """The negative control of the checks above: a step that reads a value on the host, or makes
    a data-dependent size, cannot be captured (a real capture fails on it too)."""
    with simulated_cuda():
        x = torch.arange(8, device="cuda")
        for body in (lambda: [x * int(x.sum())], lambda: [x[x > 3]], lambda: [x.cpu()]):
            with pytest.raises(graphs.NotCapturable, match="cannot be captured"):
                graphs.capture(body)
        # what a capture writes in place is put back (a real capture runs nothing)
        _, replay = graphs.capture(lambda: [x.add_(1)], keep=[x])
        assert x.tolist() == list(range(8))
        replay()
        assert x.tolist() == list(range(1, 9))


def test_the_traced_steps_of_the_examples_make_no_host_round_trip(tmp_path: Path) -> None:
    """Each example's compiled step itself, called on the simulated device with the arguments a
    run gives it: no host read, no data-dependent size, no copy to or from the host."""
    seen = 0
    for name in sorted(CAPTURED):
        prog, params, inputs, _ = _examples(tmp_path)[name]
        with simulated_cuda() as sim:
            run = Run.from_file(
                prog, params=params, inputs=inputs, seed=3, backend="simcuda", compile=True
            )
            ce = run.engine.compiled
            assert ce is not None
            calls = _spy(ce)
            run.run(2)
            for spec, layout, args in calls:
                before = len(sim.warnings)
                with torch.inference_mode():
                    flat_step(value_step(spec, layout), _lens(ce, spec))(*[a.clone() for a in args])
                assert sim.warnings[before:] == [], (name, [w.op for w in sim.warnings[before:]])
                seen += 1
    assert seen >= len(CAPTURED)


def _spy(ce: Any) -> list[tuple[Any, Any, tuple[torch.Tensor, ...]]]:
    """The (spec, layout, arguments) of every step ``ce`` compiles from now on."""
    calls: list[tuple[Any, Any, tuple[torch.Tensor, ...]]] = []
    real = ce._compile

    def spy(spec: Any, layout: Any, args: tuple[torch.Tensor, ...], *rest: Any) -> Any:
        calls.append((spec, layout, args))
        return real(spec, layout, args, *rest)

    ce._compile = spy
    return calls


def _lens(ce: Any, spec: Any) -> tuple[int, ...]:
    vtables, where, index, valid = ce._tables[spec.value]
    return (len(vtables), len(where), len(index), len(valid), len(spec.others))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# text: one open cell per epoch; sudoku: a captured value reading an eager one's clocks (video's
# captured steps run in the GPU check's bench:compile, which keeps this test's compiles few)
@pytest.mark.parametrize("name", ["text", "sudoku"])
def test_captured_on_the_gpu_commits_as_eager_on_the_cpu(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real capture: inductor's Triton kernels replayed as CUDA graphs commit what the eager
    CPU epoch commits (the built-in text models' compiled forward left out: its float scores
    move in the last bits, tests/models/test_model_compile.py)."""
    step_only(monkeypatch)
    prog, params, inputs, epochs = _examples(tmp_path)[name]
    cpu = Run.from_file(prog, params=params, inputs=inputs, seed=3)
    want = cpu.run(epochs)
    gpu = Run.from_file(prog, params=params, inputs=inputs, seed=3, backend="cuda", compile=True)
    got = gpu.run(epochs)
    same_runs(cpu, want, gpu, got)
    assert gpu.engine.compiled.stats.captures >= 1  # type: ignore[union-attr]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_captured_commit_as_eager_on_the_cpu(
    case: tuple[str, dict[str, Any]],
) -> None:
    """Random programs (several values reading each other's clocks, eager and compiled values
    mixed): captured on the simulated GPU, as the eager CPU epoch."""
    src, kw = case
    front = compile_source(src, raise_errors=False)
    assert not front.errors
    bindings = used(front, BINDINGS)
    cpu = Run(front, bindings=bindings, seed=kw["seed"])
    want = cpu.run(kw["epochs"])
    with simulated_cuda() as sim:
        gpu = Run(front, bindings=bindings, seed=kw["seed"], backend="simcuda", compile=True)
        got = gpu.run(kw["epochs"])
        same_runs(cpu, want, gpu, got)
    assert not sim.errors


def test_a_captured_text_epoch_waits_for_the_device_once_outside_the_model() -> None:
    """Per epoch of causal text, outside the model (which reads its context on the host), the
    runtime waits for the device once: for the records' one copy to the host. It reads nothing
    else back, and the request's open cell goes up without a wait."""
    front = compile_file(EX / "text.lmpm")
    with simulated_cuda() as sim:
        prompt = {"Txt": str(EX / "text" / "prompt.txt")}
        run = Run(front, inputs=prompt, backend="simcuda", compile=True)
        run.run(3)
        before = len(sim.warnings)
        run.run(13)
        ours = [w for w in sim.warnings[before:] if "/lmpm/runtime/" in w.file]
    where = sorted({(w.file.split("/lmpm/")[1], w.func) for w in ours})
    assert where == [("runtime/data/captured.py", "run")]
    assert len(ours) == 10


def test_a_ruleset_change_reaches_the_captured_step() -> None:
    """The RuleSet is an input of the graph: disabling and enabling a constraint between epochs
    changes what the captured step commits exactly as it changes the eager CPU epoch."""
    from test_runtime_ruleset import PROG

    import lmpm

    def drive(run: Run) -> list[int]:
        got = [r.commits for r in run.run(3).records]
        run.disable("Never")
        got += [r.commits for r in run.run(5).records]
        run.enable("Never")
        got += [r.commits for r in run.run(7).records]
        return got

    program = lmpm.compile(text=PROG)
    want = drive(program.runner(seed=3))
    with simulated_cuda() as sim:
        run = program.runner(seed=3, backend="simcuda", compile=True)
        assert drive(run) == want and sum(want) > 0 and want[:3] == [0, 0, 0]
        assert run.engine.compiled.stats.captures == 1  # type: ignore[union-attr]
    assert not sim.errors


def test_a_simulated_capture_puts_back_every_input_the_step_writes() -> None:
    """What a simulated capture puts back (captured.WRITTEN, named by StepInputs field) covers
    every input the traced step writes in place, and what changes per epoch is copied in."""
    from lmpm.commands._compiled_view import trace_value, written_inputs
    from lmpm.runtime.data.captured import PER_EPOCH, WRITTEN
    from lmpm.runtime.data.compiled import StepInputs

    run = Run(compile_file(EX / "text.lmpm"), compile=True)
    traced = trace_value(run, "Txt", None)
    written = set(written_inputs(traced.graph))
    names = StepInputs._fields
    assert {names[i] for i in written} >= {"payload", "committed", "clock", "rule", "why"}
    assert written <= set(WRITTEN)
    assert {names[i] for i in PER_EPOCH} == {"e", "cells", "prop", "sc", "fired", "active"}
