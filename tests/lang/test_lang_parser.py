"""The parser: the seed's constructs, spans, the fast path against the lark reference, decisions."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from lmpm.ir import compile_source
from lmpm.ir.nodes import ArgKind, AxisKind, ReadKind, RuleKind, Status
from lmpm.lang import ast, fast
from lmpm.lang.parser import parse, parse_lark

ROOT = Path(__file__).resolve().parents[2]
SEED = Path(__file__).with_name("seed_verbatim.lmpm")
H = "param N = 8\nvalue A : Token[Byte] shape Seq(N)\n"


def _fast(text: str, file: str = "<input>") -> ast.Program:
    """The fast path alone: declining (Fallback) fails the test instead of falling back."""
    return ast.Program(file, tuple(fast.parse_items(text, file)))


PARSERS = {"fast": _fast, "lark": parse_lark}


@pytest.fixture(params=sorted(PARSERS))
def parse_with(request: pytest.FixtureRequest) -> object:
    """Each parser test runs on both parsers: they must build the identical AST."""
    return PARSERS[request.param]


def test_fast_keywords_are_the_grammars_keywords() -> None:
    grammar = (ROOT / "src" / "lmpm" / "lang" / "lmpm.lark").read_text()
    words = set(re.findall(r'"([A-Za-z_]+)"', grammar))
    assert words == set(fast.KEYWORDS)


def test_decimal_literals(parse_with: Any) -> None:
    text = H + "rule R:\n  on A[t]\n  emit proposal A[t] := M(a=0.7, b=1e-3, c=-2.5E+2, d=3)\n"
    rule = parse_with(text, "f").items[2]
    call = rule.body[1].call
    values = [a.value for a in call.args]
    assert isinstance(values[0], ast.Float) and values[0].value == 0.7
    assert values[0].text == "0.7" and (values[0].span.col, values[0].span.end_col) == (29, 32)
    assert isinstance(values[1], ast.Float) and values[1].value == 1e-3
    assert isinstance(values[2], ast.Neg) and values[2].operand.value == 250.0
    assert isinstance(values[3], ast.Int)
    # `0..5` stays a range
    rng = parse_with(H + "visible A[t] <- A[0..5]\n", "f").items[2].source.indices[0]
    assert isinstance(rng, ast.Range) and isinstance(rng.lo, ast.Int)


def test_internal_failures_are_not_retried_under_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(fast.Parser, "program", broken)
    with pytest.raises(KeyError):
        parse(H, "f")
    monkeypatch.delenv(fast.STRICT_ENV)
    assert parse(H, "f").items  # outside the tests: lark decides


def test_every_example_parses_identically_on_both_paths() -> None:
    for path in [*sorted((ROOT / "examples").glob("*.lmpm")), SEED]:
        text = path.read_text()
        assert tuple(fast.parse_items(text, "f")) == parse_lark(text, "f").items


def test_spans_cover_their_node(parse_with: Any) -> None:
    prog = parse_with(H + "visible A[t] <- A[0..t-1] when t > 0\n", "f")
    vis = prog.items[2]
    assert isinstance(vis, ast.Visible)
    assert (vis.span.line, vis.span.col, vis.span.end_col) == (3, 1, 37)
    assert isinstance(vis.guard, ast.Cmp) and (vis.guard.span.col, vis.guard.span.end_col) == (
        32,
        37,
    )


def test_parentheses_keep_their_span_and_group(parse_with: Any) -> None:
    prog = parse_with(H + "visible A[t] <- A[(t-1)*2] when not (t > 0)\n", "f")
    vis = prog.items[2]
    assert isinstance(vis, ast.Visible) and isinstance(vis.source, ast.Subscript)
    idx = vis.source.indices[0]
    assert isinstance(idx, ast.BinOp) and idx.op == "*"
    assert isinstance(idx.lhs, ast.BinOp) and idx.lhs.span.col == 19  # the '(' is included
    assert isinstance(vis.guard, ast.Not)


def test_keywords_as_names_fall_back_to_lark() -> None:
    text = H + "visible A[t] <- A[t] when t > when\n"
    with pytest.raises(fast.Fallback):
        fast.parse_items(text, "f")
    # lark's contextual lexer reads `when` as a name there; the checker then reports it.
    assert compile_source(text, raise_errors=False).diagnostics[0].code == "E110"


def test_string_escapes(parse_with: Any) -> None:
    prog = parse_with(H + 'constraint C: require A[t] in Set("a\\"b\\\\c\\q") priority 1\n', "f")
    con = prog.items[2]
    assert isinstance(con, ast.Constraint) and isinstance(con.pred, ast.In)
    call = con.pred.rhs
    assert isinstance(call, ast.Call) and isinstance(call.args[0].value, ast.Str)
    assert call.args[0].value.value == 'a"b\\c\\q'


def test_seed_decisions() -> None:
    ir = compile_source(SEED.read_text(), "seed.lmpm").ir
    # free names become implicit parameters
    implicit = {p.name for p in ir.params if not p.declared}
    assert implicit == {"N", "T", "W", "H", "BPE", "VQ", "x1", "x2", "y1", "y2"}
    (gen,) = [r for r in ir.rules if r.name == "LocalGen"]
    kinds = {r.name: (r.kind, r.optional) for r in gen.reads}
    assert kinds == {
        "neighbors": (ReadKind.NEIGHBORS, False),
        "prev_frame": (ReadKind.PREV, False),
        "txt": (ReadKind.INDEX, False),
        "coarse": (ReadKind.VISIBLE, True),
    }
    # `prev` binds to `prev_frame` by prefix; `...` forwards to the score
    assert [a.value for a in gen.proposal.args] == ["neighbors", "prev_frame", "txt", "coarse"]
    assert gen.score is not None and gen.score.args[0].kind == ArgKind.FORWARD
    (sched,) = [r for r in ir.rules if r.name == "Schedule"]
    assert sched.kind == RuleKind.SCHEDULE
    assert [(a.key, a.kind) for a in sched.proposal.args] == [
        ("strategy", ArgKind.STR),
        ("epoch", ArgKind.EXPR),
    ]
    cons = {c.name: c for c in ir.constraints}
    assert cons["HardLock"].pattern_vars == ("t",)
    region = cons["TextPaint"].access
    assert (
        region is not None and region.axes[1].kind == AxisKind.REGION and region.axes[1].width == 2
    )
    assert cons["Topology"].status == Status.PROVED
    assert [a.kind for a in ir.commits[0].access.axes] == [AxisKind.ALL] * 3


def test_keyword_arguments_pass_through() -> None:
    text = H + (
        "visible A[t] <- A[0..t-1] when t > 0\nrule R:\n  on A[t] when t > 0\n"
        "  read {ctx = A[0..t-1]}\n  emit proposal A[t] := M(x=ctx, temp=3, mode=greedy)\n"
    )
    (rule,) = compile_source(text, raise_errors=False).ir.rules
    assert [(a.key, a.kind, a.value) for a in rule.proposal.args] == [
        ("x", ArgKind.READ, "ctx"),
        ("temp", ArgKind.INT, 3),
        ("mode", ArgKind.NAME, "greedy"),
    ]


def test_a_hard_constraint(parse_with: Any) -> None:
    text = H + "constraint Lower:\n  require A[t] in Set(97..122) priority 10 hard\n"
    con = parse_with(text, "f").items[2]
    assert isinstance(con, ast.Constraint) and con.hard
    assert (con.span.end_line, con.span.end_col) == (4, 48)  # the span ends after `hard`
    soft = parse_with(text.replace(" hard", ""), "f").items[2]
    assert not soft.hard
    # `hard` is still a name wherever a name fits (the fast parser leaves such text to lark)
    named = parse(H + "param hard = 3\n", "f").items[2]
    assert named.name == "hard"


def test_fmt_keeps_hard() -> None:
    from lmpm.lang.format import format_source

    text = H + "constraint Lower: require A[t] in Set(97..122) priority 10 hard\n"
    out = format_source(text, "f")
    assert "priority 10 hard" in out and format_source(out, "f") == out
