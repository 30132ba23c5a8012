"""K steps per replay (``VM(steps_per_replay=K).advance(sampler)``): the sampler inside the step,
K steps with no host decision between them (on CUDA one replay of one captured graph), tools
answered between replays.

Every K commits what K = 1 and the eager per-step loop commit (tokens, status, captures, zone
paths); only the step at which a tool's answer arrives moves (``tool_steps_late``). The host-cost
budget: on the simulated CUDA device a replay of K steps is one launch, no wait, one copy (the
flags, to the host) and at most ``HOST_CALLS_PER_REPLAY`` Python-level torch calls."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lmpm.errors import UsageError
from lmpm.ir import compile_file, compile_source
from lmpm.vm import VM, compile_workflow
from lmpm.workers.graphs import count_host
from lmpm.workers.simcuda import simulated_cuda

sys.path.insert(0, str(Path(__file__).parent))
from test_vm_compiled import same_vm
from test_vm_property import WHO, _compile, echo, workflows
from test_vm_run import count
from vm_helpers import rng_sampler, run_advance, run_vm, table_sampler

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vm.lmpm"
KS = (1, 2, 4, 8, 16)
# Python-level torch calls the host makes per replay of K steps on the CUDA path, the driver's
# `vm.done` poll included (measured: 16 to 17 -- the flags' copy and their read, two clones and
# two splits of the escaping outputs, nine views); per step that is 17 / K (~1.1 at K = 16).
HOST_CALLS_PER_REPLAY = 17


def example(streams: int, tools: bool = True) -> object:
    if tools:
        return compile_workflow(compile_file(EXAMPLE).ir, overrides={"B": streams})
    text = EXAMPLE.read_text().replace("    call Count(sky)\n", "")
    return compile_workflow(compile_source(text, str(EXAMPLE)).ir, overrides={"B": streams})


def same_streams(a: VM, b: VM) -> None:
    """``same_vm`` but for the tool calls' count (answers batched per replay differ)."""
    calls = b.tool_calls
    b.tool_calls = a.tool_calls
    try:
        same_vm(a, b)
    finally:
        b.tool_calls = calls


def run_table(vm: VM, table: torch.Tensor) -> None:
    """The per-step loop: stream b commits ``table[b, p]`` at position p where it generates."""
    core = vm.core
    while not vm.done:
        if vm.callbacks_ready:
            vm.resolve_callbacks()
        f = vm.forced()
        vm.step(table[core.ar, core.pos.clamp(max=core.N - 1)], f)


def letters(streams: int, length: int, seed: int = 0) -> torch.Tensor:
    """(streams, length) bytes from the example's alphabet: triggers fire, loops loop."""
    alphabet = torch.tensor(list(b"leftrighupdownblue sky red square  "))
    g = torch.Generator().manual_seed(seed)
    return alphabet[torch.randint(len(alphabet), (streams, length), generator=g)]


@pytest.mark.parametrize("k", KS)
def test_eager_k_steps_commit_what_the_step_loop_commits(k: int) -> None:
    ins = example(6)
    loop = VM(ins, tools={"Count": count})
    run_vm(loop, seed=3)
    vm = VM(ins, tools={"Count": count}, steps_per_replay=k)
    replays = run_advance(vm, rng_sampler(ins, 3))
    same_streams(loop, vm)
    assert vm.steps == replays * k >= loop.steps
    # a zone ending at step j of K waits K - 1 - j steps for its answer; the loop waits none
    assert loop.tool_steps_late == 0
    assert vm.answered == loop.answered > 0
    assert 0 <= vm.tool_steps_late <= k - 1
    assert (vm.tool_steps_late == 0) == (k == 1)


def test_the_k_steps_out_are_rows_of_steps() -> None:
    ins = example(3)
    vm = VM(ins, tools={"Count": count}, steps_per_replay=4)
    out = vm.advance(rng_sampler(ins, 0))
    assert out.tokens.shape == out.active.shape == out.kind.shape == (4, 3)
    # the example opens with a forced prompt: four forced tokens in every stream
    assert bool(out.active.all()) and vm.core.pos.tolist() == [4, 4, 4]


@pytest.mark.parametrize("k", [1, 16])
def test_graphed_k_steps_commit_what_the_eager_cpu_step_commits(k: int) -> None:
    ins = example(5)
    table = letters(5, ins.length, seed=5)
    loop = VM(ins, tools={"Count": count})
    run_table(loop, table)
    with simulated_cuda() as sim:
        vm = VM(ins, tools={"Count": count}, compile=True, device="cuda", steps_per_replay=k)
        replays = run_advance(vm, table_sampler(table.cuda()))
        assert vm.compiled is not None and vm.compiled.replays == replays
        same_streams(loop, vm)
        # one capture per tool-result width, reused by every replay
        assert len(vm.compiled._steps_replays) == vm.compiled.compiles
    assert not sim.errors


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workflows(), st.sampled_from(KS))
def test_graphed_k_steps_on_random_workflows(src: str, k: int) -> None:
    ins = _compile(src, len(WHO), 40)
    assume(ins is not None)
    table = letters(len(WHO), 40, seed=k)
    loop = VM(ins, inputs={"who": WHO}, tools={"Echo": echo})
    run_table(loop, table)
    with simulated_cuda():
        vm = VM(
            ins,
            inputs={"who": WHO},
            tools={"Echo": echo},
            compile=True,
            device="cuda",
            steps_per_replay=k,
        )
        run_advance(vm, table_sampler(table.cuda()), max_steps=500 + k)
        same_streams(loop, vm)


@pytest.mark.parametrize("k", [1, 4, 16])
def test_host_cost_per_replay_on_the_simulated_device(k: int) -> None:
    """Without tools: each replay of K steps is one launch, one copy (the flags, to the host,
    asynchronously), no wait, and at most HOST_CALLS_PER_REPLAY torch calls on the host."""
    b = 8
    ins = example(b, tools=False)
    table = torch.randint(32, 127, (b, ins.length))
    with simulated_cuda() as sim:
        vm = VM(ins, compile=True, device="cuda", steps_per_replay=k)
        sampler = table_sampler(table.cuda())
        vm.advance(sampler)  # captures the graph
        replays = 0
        before = len(sim.warnings)
        with count_host() as cost:
            while not vm.done and replays < 4:
                vm.advance(sampler)
                replays += 1
        assert replays > 0
        assert cost.launches == replays
        assert cost.waits == 0 and len(sim.warnings) == before
        assert cost.copies == replays
        assert cost.calls <= HOST_CALLS_PER_REPLAY * replays, dict(cost.by_name)
        assert cost.calls / (replays * k) <= HOST_CALLS_PER_REPLAY / k


def test_host_cost_with_tools_one_answer_copy_per_replay() -> None:
    """With the example's tool: a replay that answers copies the answers in once more; the
    host reads the waiting streams' captures (its waits) only in the replays that answer."""
    ins = example(4)
    with simulated_cuda():
        vm = VM(ins, tools={"Count": count}, compile=True, device="cuda", steps_per_replay=4)
        sampler = table_sampler(letters(4, ins.length).cuda())
        vm.advance(sampler)
        quiet = answering = 0
        while not vm.done:
            ready = vm.callbacks_ready
            with count_host() as cost:
                vm.advance(sampler)
            assert cost.launches == 1
            if ready:
                answering += 1
                # the answers in, the flags out, and in a replay where streams began to wait,
                # their captures read (the waits)
                assert 2 <= cost.copies <= 3
            else:
                quiet += 1
                assert cost.copies == 1 and cost.waits == 0
        assert quiet > 0 and answering > 0


@pytest.mark.slow
def test_compiled_cpu_k_steps_commit_what_the_step_loop_commits() -> None:
    """The CPU's compiled step with the sampler inside, K = 4 steps per call (inductor: slow)."""
    ins = example(4)
    table = letters(4, ins.length, seed=4)
    loop = VM(ins, tools={"Count": count})
    run_table(loop, table)
    vm = VM(ins, tools={"Count": count}, compile=True, steps_per_replay=4)
    run_advance(vm, table_sampler(table))
    same_streams(loop, vm)
    assert vm.compiled is not None and vm.compiled.replays * 4 == vm.steps


def test_steps_per_replay_outside_1_to_16_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as info:
        VM(example(2), tools={"Count": count}, steps_per_replay=3)
    assert info.value.code == "U146" and "1, 2, 4, 8, 16" in info.value.message
