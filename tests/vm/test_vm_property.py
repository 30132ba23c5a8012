"""Property tests: the VM against the plain per-stream interpreter (lmpm.vm.reference) on random
workflows, and identical results for any split of the streams into batches."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lmpm.errors import CheckError
from lmpm.ir import compile_source
from lmpm.lang import fast
from lmpm.lang.parser import parse_lark
from lmpm.vm import VM, compile_workflow
from lmpm.vm.reference import Reference

sys.path.insert(0, str(Path(__file__).parent))
from vm_helpers import program, rng_sampler, run_advance, run_reference, run_vm

ALPHABET = "ab."


def echo(calls: list[list[Any]]) -> list[str]:
    return [str(a[0])[::-1][:3] + "!" for a in calls]


@st.composite
def workflows(draw: st.DrawFn) -> str:
    nz = draw(st.integers(1, 4))
    names = [f"z{i}" for i in range(nz)]
    lines = []
    captured = False
    for i in range(nz):
        lines.append(f"  zone {names[i]}:")
        feed = draw(st.text(ALPHABET, max_size=3))
        if feed:
            lines.append(f'    feed "{feed}"')
        if draw(st.booleans()):
            lines.append("    feed who")
            feed = feed or "who"
        gen = draw(st.booleans()) or not feed
        if not gen:
            continue
        mx = draw(st.one_of(st.none(), st.integers(1, 6)))
        allowed = draw(st.sets(st.sampled_from(ALPHABET), min_size=1))
        letters = "".join(sorted(allowed))
        lines.append("    generate" + (f" max {mx}" if mx else "") + f' in Set("{letters}")')
        nex = draw(st.integers(0 if mx else 1, 3))
        for _ in range(nex):
            pat = draw(st.text(letters, min_size=1, max_size=3))
            target = draw(st.one_of(st.none(), st.sampled_from(names)))
            line = f'    until "{pat}"'
            if target is not None:
                line += f" jump {target}"
                if draw(st.integers(0, 3)):
                    line += f" limit {draw(st.integers(1, 2))}"
            lines.append(line)
        if draw(st.integers(0, 3)):
            lines.append(f"    capture c{i}")
            captured = True
            if draw(st.integers(0, 2)):
                lines.append(f"    call Echo(c{i})")
        if draw(st.booleans()):
            lines.append(f"    tag t{draw(st.integers(0, 2))}")
    del captured
    return "\n".join(lines) + "\n"


def _compile(zones: str, streams: int, length: int) -> Any:
    try:
        return compile_workflow(compile_source(program(zones, streams, length)).ir)
    except CheckError:
        return None


WHO = ["", "a", "ab.", "b", "..", "ba"]


@settings(max_examples=60, deadline=None)
@given(zones=workflows())
def test_fast_parser_builds_lark_s_ast(zones: str) -> None:
    text = program(zones, 2, 8)
    assert tuple(fast.parse_items(text, "f")) == parse_lark(text, "f").items


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(zones=workflows(), seed=st.integers(0, 2**16), length=st.integers(4, 40))
def test_vm_matches_the_reference_interpreter(zones: str, seed: int, length: int) -> None:
    ins = _compile(zones, 6, length)
    assume(ins is not None)
    matches_reference(ins, seed)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    zones=workflows(),
    seed=st.integers(0, 2**16),
    length=st.integers(4, 40),
    k=st.sampled_from((1, 2, 4, 8, 16)),
)
def test_k_steps_per_replay_match_the_reference(zones: str, seed: int, length: int, k: int) -> None:
    """Driven K steps at a time (tools answered only between the K steps; streams that wait or
    finish idle), the VM writes what the reference writes stepping stream by stream."""
    ins = _compile(zones, 6, length)
    assume(ins is not None)
    matches_reference(ins, seed, steps_per_replay=k)


def matches_reference(
    ins: Any, seed: int, compile: bool = False, steps_per_replay: int | None = None
) -> None:
    """The VM (eager or compiled) and the reference interpreter write the same streams
    (``steps_per_replay``: the VM driven K steps at a time, ``VM.advance``)."""
    k = steps_per_replay or 1
    vm = VM(ins, inputs={"who": WHO}, tools={"Echo": echo}, compile=compile, steps_per_replay=k)
    if steps_per_replay is None:
        run_vm(vm, seed)
    else:
        run_advance(vm, rng_sampler(ins, seed), max_steps=500 + k)
    ref = Reference(ins, inputs={"who": WHO}, tools={"Echo": echo})
    run_reference(ref, seed)
    assert vm.done and ref.done
    assert vm.generative_sequence() == [ref.tok.decode(s.tokens) for s in ref.streams]
    assert vm.extract() == [s.captures() for s in ref.streams]
    assert vm.decisions() == [s.decisions for s in ref.streams]
    assert vm.stream_status() == ["truncated" if s.truncated else "done" for s in ref.streams]
    status = vm.status
    for b, s in enumerate(ref.streams):
        n = len(s.tokens)
        got = list(
            zip(
                status["zone"][b, :n].tolist(),
                status["token_num"][b, :n].tolist(),
                status["triggers"][b, :n].tolist(),
                status["kind"][b, :n].tolist(),
                status["tags"][b, :n].tolist(),
            )
        )
        assert got == s.status


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(zones=workflows(), seed=st.integers(0, 2**16), cut=st.integers(1, 5))
def test_any_batch_split_gives_identical_streams(zones: str, seed: int, cut: int) -> None:
    ins = _compile(zones, 6, 20)
    assume(ins is not None)
    whole = VM(ins, inputs={"who": WHO}, tools={"Echo": echo})
    run_vm(whole, seed)
    parts = []
    for lo, hi in ((0, cut), (cut, 6)):
        vm = VM(ins, streams=hi - lo, inputs={"who": WHO[lo:hi]}, tools={"Echo": echo})
        run_vm(vm, seed, offset=lo)
        parts.append(vm)
    assert whole.generative_sequence() == [t for p in parts for t in p.generative_sequence()]
    assert whole.decisions() == [d for p in parts for d in p.decisions()]
    assert torch.equal(whole.raw_stream, torch.cat([p.raw_stream for p in parts]))
