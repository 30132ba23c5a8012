"""K epochs per CUDA-graph replay (lmpm.runtime.data.kepochs), proven on the simulated device.

A window of K epochs captures each epoch's reads, capturable models and compiled steps as one
graph; the host settles the K epochs from one copy of their records. These tests hold windows of
1..16 epochs to single captured epochs and to the eager CPU run (payload, metadata, why-codes and
every epoch's record), the host's cost per window to one launch and one wait, and say why a run
that cannot replay K epochs at a time runs single epochs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.compile import K_PROG, mix

from lmpm.errors import UsageError
from lmpm.ir import compile_file, compile_source
from lmpm.runtime.session import Run, resume
from lmpm.workers import graphs
from lmpm.workers.simcuda import simulated_cuda

sys.path.insert(0, str(Path(__file__).parent))
from test_compiled import EX, same_runs

# Two values on a grid, red-black: A's model reads its neighbours and the epoch; B reads A and B
# (its clocks read A's, committed first in the same epoch). A's constraint keeps some cells unset
# each epoch (why-codes), and later epochs overwrite committed cells (opens_committed).
# The workload is benchmarks/compile.py's (one definition): `mix`, a pure torch model marked
# `lmpm_capture`.
PROG = K_PROG.format(w=4)


# torch calls the host makes per epoch settling a window's records of PROG's two values (measured
# 85 per epoch with the replay itself, against 387 for single captured epochs with eager models:
# see test_a_window_launches_once_and_waits_once)
SETTLE_CALLS_PER_EPOCH = 100


def _run(k: int, epochs: int, backend: str = "simcuda") -> tuple[Run, Any]:
    front = compile_source(PROG, raise_errors=False)
    assert not front.errors, front.errors
    run = Run(
        front,
        bindings={"Mix": mix},
        seed=2,
        backend=backend,
        compile=backend != "cpu",
        epochs_per_replay=k,
    )
    return run, run.run(epochs)


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_windows_of_k_epochs_commit_as_single_epochs_and_as_eager(k: int) -> None:
    """K = 1, 2, 4, 8, 16 over 21 epochs (the first cycle single, then windows cut at the run's
    end: 16 + 2 and a single epoch for K = 16): the same payload, metadata, why-codes and records
    as the eager CPU run."""
    cpu, want = _run(1, 21, backend="cpu")
    assert sum(r.commits for r in want.records) > 0
    with simulated_cuda() as sim:
        gpu, got = _run(k, 21)
        same_runs(cpu, want, gpu, got)
    assert not sim.errors
    w = gpu.engine.windows
    if k == 1:
        assert w is None
    else:
        assert w.note is None, w.note
        st = w.stats
        # the schedule's first cycle (2 epochs) runs singly, then windows; the last epoch alone
        assert st.epochs == 18 and max(st.sizes) == k
        assert f"{k} epochs per replay ({st.epochs} epochs in {st.windows} replays" in w.summary()
    assert gpu.engine.compiled.stats.steps == 2 * 21  # two values, every epoch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_windows_on_the_gpu_commit_as_eager_on_the_cpu() -> None:
    """The real capture: windows of 8 epochs of inductor's Triton steps and the model's kernels,
    replayed as CUDA graphs, commit what the eager CPU run commits."""
    cpu, want = _run(1, 21, backend="cpu")
    gpu, got = _run(8, 21, backend="cuda")
    same_runs(cpu, want, gpu, got)
    assert gpu.engine.windows.note is None and gpu.engine.windows.stats.windows >= 2


def test_a_window_launches_once_and_waits_once() -> None:
    """The host's cost of a window of 8 epochs: one graph launch, one wait (the records' one
    copy), and a bounded number of torch calls per epoch for settling the records."""
    with simulated_cuda():
        run, _ = _run(8, 10)  # captured: windows of 8 from epoch 2
        w = run.engine.windows
        assert w.stats.windows == 1
        with torch.inference_mode(), graphs.count_host() as cost:
            assert w.replay(run.engine.epoch, 8, None)
        assert cost.launches == 1 and cost.waits == 1 and cost.copies == 1
        replay_calls = cost.calls
        # the window's 8 epochs settled on the host, as the run loop does
        with graphs.count_host() as settle:
            run.run(run.engine.epoch + 8)
    assert settle.launches == 0 and settle.waits == 0
    # what we reach: the replay is 3 calls (the first epoch in, the launch's records out, their
    # bytes' view) and one view per record (10 per value and epoch); settling the records on the
    # host (the owner's bookkeeping, the same as a single captured epoch's) stays under a bound
    assert replay_calls <= 3 + 10 * 2 * 8, dict(cost.by_name)
    assert settle.calls / 8 <= SETTLE_CALLS_PER_EPOCH, dict(settle.by_name)


def test_why_a_run_replays_single_epochs() -> None:
    """The examples' models read on the host (ByteLM's `int(slot.max())`): K falls back to 1 and
    the summary says why; so does a schedule that opens cells by the committed state."""
    front = compile_file(EX / "text.lmpm")
    prompt = {"Txt": str(EX / "text" / "prompt.txt")}
    with simulated_cuda():
        run = Run(front, inputs=prompt, backend="simcuda", compile=True, epochs_per_replay=8)
        run.run(4)
    w = run.engine.windows
    assert w.stats.windows == 0
    assert "1 epoch per replay, not 8" in w.summary() and "raster" in w.summary()
    with simulated_cuda():
        run, _ = _run(4, 6)
        run.run(until_stable=True, max_epochs=12)
    assert "stops when stable" in run.engine.windows.summary()


def test_a_logged_run_replays_windows_up_to_each_checkpoint_and_resumes(tmp_path: Path) -> None:
    """With a run directory (checkpoint every 5 epochs) a window ends at each checkpoint, the
    store appends each epoch's committed rows as of that epoch (the payload travels with the
    records), and a resume from the directory ends where the eager CPU run ends."""
    cpu, _ = _run(1, 23, backend="cpu")
    front = compile_source(PROG, raise_errors=False)
    with simulated_cuda() as sim:
        run = Run(
            front,
            bindings={"Mix": mix},
            seed=2,
            backend="simcuda",
            compile=True,
            epochs_per_replay=8,
        )
        run.log_to(tmp_path / "r", source=PROG, checkpoint_every=5)
        run.run(17)
        run.finish()
        w = run.engine.windows
        assert w.note is None and w.stats.sizes == {2, 4}  # windows 2-3, 5-8, 10-13, 15-16
        again = resume(tmp_path / "r", compile=True, backend="simcuda", bindings={"Mix": mix})
        assert again.restored is not None and again.restored.epoch == 17
        again.run(23)
        again.finish()
    assert not sim.errors
    for name in cpu.plan.values:
        assert torch.equal(cpu.payload(name), again.payload(name).cpu()), name
        for f in ("committed", "clock", "rule", "epoch", "score"):
            a, b = getattr(cpu.engine.state[name], f), getattr(again.engine.state[name], f)
            assert torch.equal(a, b), (name, f)


@pytest.mark.parametrize("k", [0, 3, 128, -2])
def test_a_bad_k_is_a_usage_error(k: int) -> None:
    with pytest.raises(UsageError) as err:
        _run(k, 1)
    assert err.value.code == "U109"


def test_k_needs_compile() -> None:
    front = compile_source(PROG, raise_errors=False)
    with pytest.raises(UsageError, match="add --compile") as err:
        Run(front, bindings={"Mix": mix}, epochs_per_replay=4)
    assert err.value.code == "U109"


def test_quorum_replicas_replay_single_captured_epochs() -> None:
    """A window runs one model per value: a value with quorum replicas (or several rules) replays
    single epochs, each value's step still compiled and captured, and says why."""
    src = PROG + "commit A[*] using quorum(2, satisfy)\n"
    runs = []
    for backend in ("cpu", "simcuda"):
        with simulated_cuda():
            run = Run(
                compile_source(src),
                bindings={"Mix": mix},
                seed=2,
                backend=backend,
                compile=backend != "cpu",
                epochs_per_replay=4 if backend != "cpu" else 1,
            )
            runs += [run, run.run(6)]
    same_runs(*runs)
    ce, w = runs[2].engine.compiled, runs[2].engine.windows
    assert ce.specs.keys() == {"A", "B"} and ce.stats.captures >= 2 and w.stats.windows == 0
    assert "several rules or quorum replicas propose `A`" in w.summary()
