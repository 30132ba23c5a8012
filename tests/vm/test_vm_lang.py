"""Workflows in the language: parsing (lark; the fast path declines), formatting, the IR, the
checker's located errors, and `lmpm show` / `lmpm show --vm`."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from lmpm.cli import main
from lmpm.errors import CheckError
from lmpm.ir import compile_source, lint
from lmpm.ir.printer import print_ir
from lmpm.ir.serialize import from_json, to_json
from lmpm.lang import fast
from lmpm.lang.format import format_source
from lmpm.lang.parser import parse, parse_lark

ROOT = Path(__file__).resolve().parents[2]

HEAD = """param B = 4
value Txt : Token[Byte] shape Grid2D(B, 32) clock Lamport
visible Txt[b, t] <- Txt[b, 0..t-1] when t > 0
rule Write:
  on Txt[b, t]
  read {context = Txt[b, 0..t-1]}
  emit proposal Txt[b, t] := ByteLM(context)
"""

GOOD = (
    HEAD
    + """workflow Quiz on Txt:
  zone ask:
    feed "Q: "
    feed question
    generate max 6 in Set(97..122, " ")
    until "no" jump ask limit 3
    until " "
    capture answer
    call Count(answer, "x", 2)
    tag answer
  zone close:
    feed "."
"""
)


def errors(src: str) -> list[tuple[str, int]]:
    try:
        compile_source(src)
    except CheckError as e:
        return [
            (d.code, d.span.line if d.span else 0) for d in e.diagnostics if d.severity == "error"
        ]
    return []


def test_parse_builds_the_workflow_identically_on_both_paths() -> None:
    prog = parse(GOOD)
    wf = prog.items[-1]
    assert type(wf).__name__ == "Workflow" and [z.name for z in wf.zones] == ["ask", "close"]
    assert prog == parse_lark(GOOD)
    assert tuple(fast.parse_items(GOOD, "<input>")) == prog.items


def test_fast_path_declines_workflow_words_used_as_zone_names() -> None:
    src = HEAD + 'workflow Q on Txt:\n  zone shape:\n    feed "x"\n'
    with pytest.raises(fast.Fallback):
        fast.parse_items(src, "<input>")
    assert parse(src).items[-1].zones[0].name == "shape"  # type: ignore[union-attr]


@pytest.mark.parametrize("word", ["feed", "zone", "max", "jump", "tag", "capture"])
def test_workflow_words_as_names_parse_the_same_on_both_paths(word: str) -> None:
    src = f"param {word} = 3\nvalue A : Token[Byte] shape Seq({word})\n"
    assert parse(src) == parse_lark(src)


def test_format_roundtrip_and_ir_json() -> None:
    out = format_source(GOOD)
    assert format_source(out) == out
    assert compile_source(out).ir.workflows[0].zones == compile_source(GOOD).ir.workflows[0].zones
    ir = compile_source(GOOD).ir
    assert from_json(to_json(ir)) == ir
    assert lint(ir) == []
    text = print_ir(ir)
    assert "until 'no' -> jump ask limit 3" in text and 'call Count(answer, "x", 2)' in text


def test_ir_of_zone() -> None:
    z = compile_source(GOOD).ir.workflows[0].zones[0]
    assert [(f.text, f.input) for f in z.feeds] == [("Q: ", None), (None, "question")]
    assert z.generate and z.capture == "answer" and z.tags == ("answer",)
    assert [(x.pattern, x.target) for x in z.exits] == [("no", "ask"), (" ", None)]


@pytest.mark.parametrize(
    ("body", "code", "line"),
    [
        # unknown zone (jump target), with a suggestion
        ('  zone a:\n    generate max 3\n    until "x" jump b\n', "E145", 11),
        # unreachable zone: `a` only loops on itself
        ('  zone a:\n    generate\n    until "x" jump a\n  zone b:\n    feed "."\n', "E241", 12),
        # a zone that can never end
        ("  zone a:\n    generate\n", "E146", 10),
        # unreachable: a zone after one that can never advance
        (
            '  zone a:\n    generate max 2\n    until "x" jump a\n  zone b:\n    feed "."\n'
            '  zone c:\n    generate max 2\n    until "y" jump b\n',
            None,
            0,
        ),
        # trigger outside the zone's allowed set can never match
        ('  zone a:\n    generate max 3 in Set("abc")\n    until "z"\n', "E242", 11),
        # `until` without generate: a bad exit
        ('  zone a:\n    feed "x"\n    until "x"\n', "E146", 9),
        # a feed that is neither text nor an input
        ("  zone a:\n    feed 3\n", "E142", 10),
        # tool on something never captured
        ("  zone a:\n    generate max 2\n    call Count(nothing)\n", "E147", 11),
        # duplicate zone
        ('  zone a:\n    feed "x"\n  zone a:\n    feed "y"\n', "E141", 11),
        # max must be >= 1
        ("  zone a:\n    generate max 0\n", "E148", 10),
    ],
)
def test_checker_errors_are_located(body: str, code: str | None, line: int) -> None:
    src = HEAD + "workflow W on Txt:\n" + body
    got = errors(src)
    if code is None:
        assert got == []
    else:
        assert (code, line) in got, got


def test_unreachable_zone_is_reported_at_the_zone() -> None:
    src = (
        HEAD
        + 'workflow W on Txt:\n  zone a:\n    generate\n    until "x" jump a limit 2\n'
        + '    until "y" jump c\n  zone b:\n    feed "."\n  zone c:\n    feed ","\n'
    )
    assert errors(src) == []  # the limit makes `a` advance into b
    src = (
        HEAD
        + 'workflow W on Txt:\n  zone a:\n    generate\n    until "x" jump c\n'
        + '  zone b:\n    feed "."\n  zone c:\n    feed ","\n    generate max 2\n'
        + '    until "y" jump a\n'
    )
    assert ("E241", 12) in errors(src)  # b: no zone advances or jumps into it


def test_trigger_outside_the_program_constraint_never_matches() -> None:
    src = (
        HEAD
        + "constraint P:\n  require Txt[b, t] in Set(97..122) priority 1\n"
        + 'workflow W on Txt:\n  zone a:\n    generate max 4\n    until "."\n'
    )
    assert ("E242", 13) in errors(src)


def test_workflow_needs_a_token_value_and_a_model() -> None:
    src = 'value V : Float shape Seq(4)\nworkflow W on V:\n  zone a:\n    feed "x"\n'
    assert ("E140", 2) in errors(src)
    src = 'value V : Token[Byte] shape Seq(4)\nworkflow W on V:\n  zone a:\n    feed "x"\n'
    assert ("E243", 2) in errors(src)


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue()


def test_show_prints_workflows_and_vm_tensors() -> None:
    prog = str(ROOT / "examples" / "vm.lmpm")
    rc, out = _cli("show", prog)
    assert rc == 0 and "workflows:" in out and "until ' ' -> jump way limit 2" in out
    rc, out = _cli("show", "--vm", prog)
    assert rc == 0
    assert "advance_mask (zone x trigger)" in out and "jump_address" in out
    assert "token_data (18 tokens)" in out
    rc, _ = _cli("fmt", "--check", prog)
    assert rc == 0
