"""The compiled VM step (``VM(compile=True)``, ``lmpm vm run --compile``) commits exactly what the
eager step commits: tokens, status, captures, zone paths, tool calls, on the example, on random
workflows against the reference interpreter, with inputs that leave zones empty, multi-byte
tokens, one stream, and through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lmpm.errors import UsageError, WorkflowError
from lmpm.ir import compile_file
from lmpm.vm import VM, compile_workflow

sys.path.insert(0, str(Path(__file__).parent))
from test_vm_property import WHO, _compile, echo, matches_reference, workflows
from test_vm_run import count, make
from vm_helpers import PairTokenizer, instructions, run_vm, scripted

ROOT = Path(__file__).resolve().parents[2]


def same_vm(a: VM, b: VM) -> None:
    """``b`` (streams on any device) committed what ``a`` (on the CPU) committed."""
    assert a.generative_sequence() == b.generative_sequence()
    assert a.extract() == b.extract()
    assert a.decisions() == b.decisions()
    assert a.stream_status() == b.stream_status()
    assert a.tool_calls == b.tool_calls
    for key, table in a.status.items():
        assert torch.equal(table, b.status[key].cpu()), key
    assert torch.equal(a.raw_stream, b.raw_stream.cpu())


def test_example_with_the_model_commits_what_eager_commits() -> None:
    runs = [make(5, seed=7, compile=c) for c in (False, True)]
    vms = [r.run() for r in runs]
    same_vm(*vms)
    eager, comp = (r.stats for r in runs)
    for key in ("steps", "committed", "forced", "asked", "model_calls", "steps_all_forced"):
        assert getattr(eager, key) == getattr(comp, key), key
    assert vms[1].compiled is not None and vms[1].compiled.steps == comp.steps
    assert comp.compile_seconds > 0 and eager.compile_seconds == 0
    assert vms[0].compiled is None


def test_bundled_example_and_a_wider_tool_result_recompile_once() -> None:
    # examples/vm.lmpm at 6 streams: Count's results are wider than the queue, so a second
    # graph is built for the wider queue, and no other
    prog = ROOT / "examples" / "vm.lmpm"
    got = []
    for comp in (False, True):
        ins = compile_workflow(compile_file(prog, overrides={"B": 6}).ir, overrides={"B": 6})
        vm = VM(ins, tools={"Count": count}, compile=comp)
        run_vm(vm, seed=11)
        got.append(vm)
    same_vm(*got)
    assert got[1].compiled is not None and got[1].compiled.compiles == 2
    # both graphs are called directly, not through compile_fx's Python wrappers
    assert all(fn.__name__ == "direct" for fn, _ in got[1].compiled._graphs.values())


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(zones=workflows(), seed=st.integers(0, 2**16), length=st.integers(4, 24))
def test_random_workflows_compiled_match_the_reference(zones: str, seed: int, length: int) -> None:
    ins = _compile(zones, 6, length)
    assume(ins is not None)
    matches_reference(ins, seed, compile=True)


def test_empty_inputs_settle_through_zones_as_eagerly() -> None:
    # zones fed only an input that is empty for some streams end at once (settle rounds), inside
    # the compiled step as after a tool result
    zones = (
        "  zone a:\n    feed who\n"
        "  zone b:\n    feed who\n"
        '  zone c:\n    generate max 2 in Set("ab")\n    capture x\n    call Echo(x)\n'
        "  zone d:\n    feed who\n"
        '  zone e:\n    generate max 1 in Set("b")\n'
    )
    ins = instructions(zones, streams=6, length=30)
    got = []
    for comp in (False, True):
        vm = VM(ins, inputs={"who": WHO}, tools={"Echo": echo}, compile=comp)
        run_vm(vm, seed=5)
        got.append(vm)
    same_vm(*got)
    assert got[1].core.settle_rounds == 3
    # a stream with an empty input skipped both zones without a token
    assert got[1].decisions()[0][:3] == ["a", "b", "c"]


def test_multibyte_tokens_and_one_stream() -> None:
    zones = '  zone g:\n    generate max 9\n    until "yzq"\n  zone h:\n    feed "."\n'
    for streams in (1, 3):
        ins = instructions(zones, streams=streams, length=16)
        got = []
        for comp in (False, True):
            vm = VM(ins, tokenizer=PairTokenizer(), compile=comp)
            scripted(vm, [[ord("x"), 2, 3, 4, 4, 4, 4, 4, 4]] * streams)
            got.append(vm)
        same_vm(*got)
        assert got[1].decisions()[0] == ["g", "h", "<end>"]


def test_polling_between_steps_reads_the_graph_s_flags() -> None:
    ins = instructions('  zone q:\n    feed "Q"\n    generate max 2\n    capture a\n', streams=2)
    vm = VM(ins, compile=True)
    assert not vm.done and vm.core.flags is None  # nothing compiled yet: computed eagerly
    f = vm.forced()
    vm.step(torch.tensor([120, 121]), f)
    assert vm.core.flags == (False, False) and vm.core.next_forced is not None
    assert vm.forced() is vm.core.next_forced  # no tensor operation to poll
    while not vm.done:
        vm.step(torch.tensor([120, 121]), vm.forced())
    assert bool(vm.core.finished.all())
    assert vm.extract() == [{"a": "xx"}, {"a": "yy"}]


def test_sampled_tokens_of_the_wrong_shape_are_a_located_error() -> None:
    ins = instructions("  zone q:\n    generate max 2\n", streams=2)
    for compile in (False, True):
        vm = VM(ins, compile=compile)
        with pytest.raises(WorkflowError) as info:
            vm.step(torch.tensor([[1], [2]]), vm.forced())
        assert info.value.code == "R159" and "(2,) tensor" in str(info.value)


def test_compiled_step_runs_on_the_cpu_only() -> None:
    ins = instructions("  zone q:\n    generate max 2\n", streams=2)
    with pytest.raises(UsageError) as info:
        VM(ins, device="meta", compile=True)
    assert info.value.code == "U104"


def test_cli_compile_prints_its_graphs_and_the_same_streams(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text(
        "import lmpm\n\n@lmpm.bind('Count')\n"
        "def count(calls):\n    return [f' ({len(str(a[0]).split())} words)' for a in calls]\n"
    )
    prog = ROOT / "examples" / "vm.lmpm"
    base = [sys.executable, "-m", "lmpm", "vm", "run", str(prog), "--set", "B=4", "--bind"]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, str(tools), *extra], capture_output=True, text=True, cwd=ROOT, timeout=600
        )

    eager, comp = run("--json"), run("--json", "--compile")
    assert eager.returncode == 0 and comp.returncode == 0, comp.stderr
    a, b = json.loads(eager.stdout), json.loads(comp.stdout)
    assert a["streams"] == b["streams"]
    assert b["stats"]["compile_seconds"] > 0
    text = run("--compile")
    assert text.returncode == 0, text.stderr
    assert "compiled: 2 graphs" in text.stdout
    assert "compiling the VM step (4 streams)" in text.stderr
