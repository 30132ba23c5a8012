"""The VM step as one CUDA graph (``VM(compile=True, device="cuda")``), proven on a CPU.

On the simulated CUDA device (:mod:`lmpm.workers.simcuda`) the captured step's body runs on the
graph's static buffers at each replay, so these tests hold its buffer discipline (the core's
tensors are the graph's inputs, what escapes a step is copied out, the next ``Forced`` is fed
back) to the eager step's commits; and the traced step itself must make no host round trip (what
a real capture refuses). The real capture runs on a GPU (the gpu-marked test below,
``scripts/gpu_check.sh``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from lmpm.ir import compile_file
from lmpm.vm import VM, compile_workflow
from lmpm.vm.compiled import CONSTANTS, STATE, _step_fn
from lmpm.vm.core import Core
from lmpm.workers.simcuda import simulated_cuda

sys.path.insert(0, str(Path(__file__).parent))
from test_vm_compiled import same_vm
from test_vm_property import WHO, _compile, echo, workflows
from test_vm_run import count
from vm_helpers import instructions, run_vm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vm.lmpm"


def example(streams: int) -> object:
    return compile_workflow(compile_file(EXAMPLE).ir, overrides={"B": streams})


def step_args(core: Core) -> tuple[torch.Tensor, ...]:
    f = core.forced()
    sampled = torch.zeros(core.B, dtype=torch.int64, device=core.device)
    return (
        *(getattr(core, n) for n in STATE),
        *(getattr(core, n) for n in CONSTANTS),
        sampled,
        f.tokens,
        f.mask,
        f.ask,
        f.from_tool,
    )


def test_graphed_step_commits_what_the_eager_step_commits() -> None:
    ins = example(6)
    eager = VM(ins, tools={"Count": count})
    run_vm(eager, seed=3)
    with simulated_cuda() as sim:
        graphed = VM(ins, tools={"Count": count}, compile=True, device="cuda")
        steps = run_vm(graphed, seed=3)
        assert graphed.core.device.type == "cuda" and graphed.compiled is not None
        # one graph per tool-result width (a wider result widens the queue)
        assert graphed.compiled.steps == steps
        assert graphed.compiled.compiles == len(graphed.compiled._replays) >= 1
        # the core's state is the graph's static inputs
        rep = graphed.compiled._replays[graphed.core.inj.shape[1]]
        assert graphed.core.tokens is rep.inputs[STATE.index("tokens")]
        same_vm(eager, graphed)
    assert not sim.errors


def test_the_traced_step_makes_no_host_round_trip() -> None:
    """What the CUDA graph captures: no value read back, no data-dependent size, no copy to or
    from the host. The eager step, which asks whether a settle round is needed, does make one:
    the check sees it."""
    ins = instructions(
        '  zone a:\n    feed who\n  zone b:\n    generate max 3\n    until " "\n    capture c\n',
        streams=4,
    )
    with simulated_cuda() as sim:
        # empty inputs: zone a ends with nothing fed, so the step has a settle round
        core = Core(ins, inputs={"who": ["x", "", "yy", ""]}, device="cuda")
        assert core.settle_rounds == 1
        args = step_args(core)
        before = len(sim.warnings)
        out = _step_fn(core, [])(*args)
        assert len(sim.warnings) == before, [e.where() + " " + e.op for e in sim.warnings[before:]]
        assert all(t.device.type == "cuda" for t in out)
        core.commit(args[len(STATE) + len(CONSTANTS)])
        assert any(e.kind == "sync" for e in sim.warnings[before:])
    assert not sim.errors


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workflows())
def test_graphed_step_on_random_workflows(src: str) -> None:
    ins = _compile(src, len(WHO), 48)
    assume(ins is not None)
    eager = VM(ins, inputs={"who": WHO}, tools={"Echo": echo})
    run_vm(eager, seed=1)
    with simulated_cuda():
        graphed = VM(ins, inputs={"who": WHO}, tools={"Echo": echo}, compile=True, device="cuda")
        run_vm(graphed, seed=1)
        same_vm(eager, graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_step_on_the_gpu_commits_the_cpu_tokens() -> None:
    """The real capture: every stream's tokens, captures and zone path as the eager CPU step's.
    Tool calls and the step count may differ (the host learns late that a tool waits or every
    stream is done; a late step commits nothing on those streams)."""
    ins = example(64)
    eager = VM(ins, tools={"Count": count})
    run_vm(eager, seed=5)
    graphed = VM(ins, tools={"Count": count}, compile=True, device="cuda")
    run_vm(graphed, seed=5)
    assert graphed.generative_sequence() == eager.generative_sequence()
    assert graphed.extract() == eager.extract()
    assert graphed.decisions() == eager.decisions()
    assert graphed.stream_status() == eager.stream_status()
    assert torch.equal(graphed.raw_stream.cpu(), eager.raw_stream)


def test_a_whole_workflow_run_on_cuda_as_on_the_cpu() -> None:
    """The example with its byte model and tool, every stream on the (simulated) GPU with the
    graphed step: the same streams as the eager CPU run."""
    from test_vm_run import make

    cpu = make(3)
    cpu.run()
    with simulated_cuda() as sim:
        gpu = make(3, device="cuda", compile=True)
        gpu.run()
        assert gpu.vm.compiled is not None and gpu.vm.compiled.steps > 0
        assert gpu.vm.generative_sequence() == cpu.vm.generative_sequence()
        assert gpu.vm.extract() == cpu.vm.extract()
    assert not sim.errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cli_device_cuda_without_a_gpu_is_a_clear_error() -> None:
    import subprocess

    res = subprocess.run(
        [sys.executable, "-m", "lmpm.cli", "vm", "run", str(EXAMPLE), "--device", "cuda"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 1
    assert "error[E000]: --device cuda: this machine has no CUDA device" in res.stderr
    assert "Traceback" not in res.stderr
