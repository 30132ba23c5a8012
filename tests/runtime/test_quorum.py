"""Redundancy: `quorum(k of n, policy)`. The syntax in both parsers, the formatter and the checker;
n replicas per rule, on n different workers when the run has them; a worker whose proposals are
corrupt is outvoted (the commits are a clean run's) and named in the epoch record, the commit log
and `lmpm trace`."""

from __future__ import annotations

import pytest

from lmpm.errors import CheckError
from lmpm.ir import compile_source
from lmpm.ir.printer import call_str
from lmpm.ir.serialize import from_json, to_json
from lmpm.lang.format import format_source
from lmpm.lang.parser import parse, parse_lark

PROGRAM = """\
param N = 10
param K = 2

value Txt : Token[Byte] shape Seq(N) clock Lamport
value MaskPlan : Event shape Set() clock Lamport

visible Txt[t] <- Txt[0..t-1] when t > 0

rule NextByte:
  on Txt[t]
  read {context = Txt[0..t-1]}
  emit proposal Txt[t] := ByteLM(context, k=2, pick="top")
  score TextScore(...)

constraint Plain:
  require Txt[t] in Set(97..122, " ,.") priority 10

commit Txt[*] using POLICY

rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="raster", k=1)
"""


def _src(policy: str) -> str:
    return PROGRAM.replace("POLICY", policy)


# ---- syntax ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        "quorum(2 of 3, satisfy)",
        "quorum(2 of 3, satisfy(max_constraints_then_score))",
        "quorum(K of K+1, winner_takes_all)",
        "quorum(1 of 1)",
        "quorum(2, satisfy)",
    ],
)
def test_both_parsers_build_the_same_ast_and_the_formatter_round_trips(policy: str) -> None:
    text = _src(policy)
    assert parse(text, "q.lmpm") == parse_lark(text, "q.lmpm")
    formatted = format_source(text, "q.lmpm")
    assert f"commit Txt[*] using {policy}" in formatted
    assert format_source(formatted, "q.lmpm") == formatted
    p = compile_source(text, "q.lmpm", strict=False).ir
    assert from_json(to_json(p)) == p
    assert call_str(p.commits[0].policy) == policy


def test_of_is_still_a_name_elsewhere() -> None:
    text = _src("quorum(2 of 3, satisfy)").replace("context", "of")
    assert parse(text, "q.lmpm") == parse_lark(text, "q.lmpm")


@pytest.mark.parametrize(
    ("policy", "message", "caret"),
    [
        ("quorum(4 of 3, satisfy)", "4 of 3 asks for 4 agreeing replicas", "4"),
        ("quorum(0 of 3, satisfy)", "k must be between 1 and 3", "0"),
        ("quorum(1 of 0, satisfy)", "1 of 0 needs at least 1 replica", "0"),
        ("quorum(K of 1, satisfy)", "2 of 1 asks for 2", "K"),
        ("satisfy(2 of 3)", "mode must be a name or a string, got `k of n`", "2 of 3"),
    ],
)
def test_checker_locates_bad_counts(policy: str, message: str, caret: str) -> None:
    text = _src(policy)
    with pytest.raises(CheckError) as info:
        compile_source(text, "q.lmpm", strict=False)
    diag = next(d for d in info.value.diagnostics if d.code == "E210")
    assert message in diag.message
    line = text.splitlines()[diag.span.line - 1]
    assert line[diag.span.col - 1 : diag.span.end_col - 1] == caret
    assert "^" in str(info.value)


def test_k_of_n_only_as_a_policy_argument() -> None:
    text = _src("satisfy").replace('ByteLM(context, k=2, pick="top")', "ByteLM(context, 2 of 3)")
    with pytest.raises(CheckError) as info:
        compile_source(text, "q.lmpm", strict=False)
    assert any(
        d.code == "E108" and "only allowed as a commit policy" in d.message
        for d in info.value.diagnostics
    )
