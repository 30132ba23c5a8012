"""The VM step: teacher forcing, triggers across token boundaries, advance / jump / bounded loops,
captures and tool callbacks, streams ending at different steps, `done`, truncation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lmpm.errors import WorkflowError
from lmpm.vm import FORCED, GENERATED, TOOL, VM

sys.path.insert(0, str(Path(__file__).parent))
from vm_helpers import PairTokenizer, instructions, scripted, text


def test_teacher_forcing_is_exact_and_skips_the_model() -> None:
    ins = instructions(
        '  zone a:\n    feed "Hello, "\n    feed who\n    generate max 3\n  zone b:\n'
        '    feed "!end"\n',
        streams=3,
    )
    vm = VM(ins, inputs={"who": ["ann", "bo", ""]})
    asked = scripted(vm, [text("xyz")] * 3)
    assert vm.generative_sequence() == ["Hello, annxyz!end", "Hello, boxyz!end", "Hello, xyz!end"]
    assert asked == [3, 3, 3]  # only generated tokens came from the "model"
    kinds = vm.status["kind"][0, :17].tolist()
    assert kinds == [FORCED] * 10 + [GENERATED] * 3 + [FORCED] * 4
    assert vm.status["zone"][0, :17].tolist() == [0] * 13 + [1] * 4
    assert vm.status["token_num"][0, :13].tolist() == list(range(13))
    assert vm.done and vm.stream_status() == ["done"] * 3


def test_forced_before_model() -> None:
    ins = instructions('  zone a:\n    feed "ab"\n    generate max 1\n', streams=2)
    vm = VM(ins)
    f = vm.forced()
    assert f.mask.tolist() == [True, True] and f.ask.tolist() == [False, False]
    assert f.tokens.tolist() == [ord("a")] * 2


def test_trigger_spanning_token_boundaries() -> None:
    ins = instructions(
        '  zone a:\n    feed ">"\n    generate max 9\n    until "xyzq"\n    capture c\n'
        '  zone b:\n    feed "."\n',
        streams=4,
    )
    vm = VM(ins, tokenizer=PairTokenizer())
    xy, yz, zq, xyzq = 1, 2, 3, 4
    x, y, z, q = (ord(ch) for ch in "xyzq")
    scripts = [
        [xy, zq, 0, 0],  # "xy" + "zq": ends on the second token
        [x, yz, q, 0],  # "x" + "yz" + "q"
        [q, xyzq, 0, 0],  # one token holds the whole pattern
        [x, y, z, x, y, zq],  # a near miss, then "xy" "zq"
    ]
    asked = scripted(vm, scripts)
    assert asked == [2, 3, 2, 6]
    assert vm.generative_sequence() == [">xyzq.", ">xyzq.", ">qxyzq.", ">xyzxyzq."]
    assert [c["c"] for c in vm.extract()] == ["xyzq", "xyzq", "qxyzq", "xyzxyzq"]
    # the trigger flag is set on the token that completed the pattern
    assert vm.status["triggers"][0, :3].tolist() == [0, 0, 1]


def test_prompt_bytes_never_complete_a_trigger() -> None:
    ins = instructions(
        '  zone a:\n    feed "ab"\n    generate max 4\n    until "abc"\n  zone b:\n    feed "."\n',
        streams=1,
    )
    vm = VM(ins)
    scripted(vm, [text("cabc")])
    assert vm.generative_sequence() == ["abcabc."]  # the first "c" did not fire: "ab" was forced


def test_advance_jump_and_bounded_loop() -> None:
    ins = instructions(
        '  zone ask:\n    feed "?"\n    generate max 4\n    until "y"\n    until "n" jump ask limit 2\n'
        '    capture answer\n  zone done:\n    feed "."\n',
        streams=3,
    )
    vm = VM(ins)
    scripted(vm, [text("y"), text("nny"), text("nnnn")])
    assert vm.decisions() == [
        ["ask", "done", "<end>"],
        ["ask", "ask", "ask", "done", "<end>"],
        ["ask", "ask", "ask", "done", "<end>"],  # the third "n" advances: the limit is 2
    ]
    assert vm.generative_sequence() == ["?y.", "?n?n?y.", "?n?n?n."]
    assert [c["answer"] for c in vm.extract()] == ["y", "y", "n"]


def test_first_exit_in_source_order_wins_and_max_ends_the_zone() -> None:
    ins = instructions(
        '  zone a:\n    generate max 3\n    until "b" jump c\n    until "ab"\n  zone b:\n'
        '    feed "B"\n  zone c:\n    feed "C"\n',
        streams=2,
    )
    vm = VM(ins)
    scripted(vm, [text("ab"), text("xxx")])
    assert vm.decisions() == [["a", "c", "<end>"], ["a", "b", "c", "<end>"]]
    assert vm.generative_sequence() == ["abC", "xxxBC"]


def test_tool_callbacks_for_all_ready_streams_at_once() -> None:
    ins = instructions(
        '  zone a:\n    feed "n="\n    generate max 5\n    until ";"\n    capture n\n'
        '    call Twice(n, "!")\n  zone b:\n    feed "|"\n',
        streams=3,
    )
    calls: list[list[list[object]]] = []

    def twice(args: list[list[object]]) -> list[str]:
        calls.append(args)
        return [str(a[0]).rstrip(";") * 2 + str(a[1]) for a in args]

    vm = VM(ins, tools={"Twice": twice})
    scripted(vm, [text("ab;"), text("c;"), text("ab;")])
    assert vm.generative_sequence() == ["n=ab;abab!|", "n=c;cc!|", "n=ab;abab!|"]
    # streams 0 and 2 became ready at the same step: one call for both
    assert [len(c) for c in calls] == [1, 2]
    assert vm.status["kind"][1, 4:7].tolist() == [TOOL] * 3
    assert vm.tool_calls == 2


def test_tool_errors_are_typed() -> None:
    ins = instructions("  zone a:\n    generate max 1\n    capture n\n    call T(n)\n", streams=2)
    vm = VM(ins, tools={"T": lambda args: ["only one"]})
    with pytest.raises(WorkflowError, match="one string per stream"):
        scripted(vm, [text("a"), text("b")])
    vm = VM(ins, tools={})
    with pytest.raises(WorkflowError, match="not bound"):
        scripted(vm, [text("a"), text("b")])


def test_streams_finish_at_different_steps_and_done() -> None:
    ins = instructions('  zone a:\n    generate max 9\n    until "."\n', streams=3)
    vm = VM(ins)
    finished_at: list[int] = [-1, -1, -1]
    scripts = [text("."), text("abc."), text("abcdefg.")]
    asked = [0, 0, 0]
    step = 0
    while not vm.done:
        f = vm.forced()
        sampled = torch.zeros(3, dtype=torch.int64)
        for b in f.ask.nonzero().flatten().tolist():
            sampled[b] = scripts[b][asked[b]]
            asked[b] += 1
        out = vm.step(sampled, f)
        step += 1
        for b, fin in enumerate(vm.core.finished.tolist()):
            if fin and finished_at[b] < 0:
                finished_at[b] = step
        # a finished stream commits nothing
        assert not (out.active & vm.core.finished & (out.kind < 0)).any()
    assert finished_at == [1, 4, 8]
    assert vm.core.pos.tolist() == [1, 4, 8]
    assert vm.raw_stream[0, 1].item() == -1


def test_truncation_at_the_stream_length() -> None:
    ins = instructions(
        '  zone a:\n    feed "abc"\n    generate\n    until "."\n', streams=1, length=6
    )
    vm = VM(ins)
    scripted(vm, [text("xxxxxxx")])
    assert vm.done and vm.stream_status() == ["truncated"]
    assert vm.generative_sequence() == ["abcxxx"]


def test_missing_input_is_a_typed_error() -> None:
    ins = instructions("  zone a:\n    feed who\n", streams=2)
    with pytest.raises(WorkflowError, match="input `who`"):
        VM(ins)
    with pytest.raises(WorkflowError, match="3 entries for 2 streams"):
        VM(ins, inputs={"who": ["a", "b", "c"]})
