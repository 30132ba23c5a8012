"""Property tests over generated programs: parse → IR → JSON → IR is the identity; `fmt` is
idempotent, keeps every comment and the IR; the IR lint is clean after build and after check."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmpm.errors import DiagnosticSink
from lmpm.ir import build, check, lint
from lmpm.ir.serialize import from_json, to_dict, to_json
from lmpm.lang import fast
from lmpm.lang.format import format_source
from lmpm.lang.parser import parse, parse_lark

SETTINGS = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

AXES = {"Seq": ("t",), "Grid2D": ("x", "y"), "Grid3D": ("t", "x", "y")}
COMMENTS = ["// a note", "//x", "// ünïcode ✓", '// "quoted" // twice']


@st.composite
def index(draw: Any, var: str) -> str:
    k = draw(st.integers(0, 3))
    form = draw(st.sampled_from(["v", "v-k", "v+k", "range", "star", "div", "const", "paren"]))
    return {
        "v": var,
        "v-k": f"{var}-{k}",
        "v+k": f"{var} + {k}",
        "range": f"{var}-{k}..{var}+{k}",
        "star": "*",
        "div": f"{var}/2",
        "const": str(k),
        "paren": f"({var}-{k})*2",
    }[form]


@st.composite
def programs(draw: Any) -> str:
    out: list[str] = []

    def comment() -> None:
        if draw(st.booleans()):
            out.append(draw(st.sampled_from(COMMENTS)))
        if draw(st.integers(0, 4)) == 0:
            out.append("")

    def trail() -> str:
        return "  " + draw(st.sampled_from(COMMENTS)) if draw(st.integers(0, 3)) == 0 else ""

    n_params = draw(st.integers(0, 2))
    params = [f"P{i}" for i in range(n_params)]
    for p in params:
        comment()
        default = draw(st.sampled_from(["", " = 8", " = 16", " = 4*4", " = (2+2)*2"]))
        out.append(f"param {p}{default}{trail()}")
    values: list[tuple[str, str]] = []
    for i in range(draw(st.integers(1, 3))):
        comment()
        shape = draw(st.sampled_from(sorted(AXES)))
        dims = ", ".join(
            draw(st.sampled_from([*params, "8", "16", "N", "W/2"])) for _ in AXES[shape]
        )
        vocab = draw(st.sampled_from(["Byte", "16", "VQ", *params]))
        clock = draw(st.sampled_from(["", " clock Lamport"]))
        out.append(f"value V{i} : Token[{vocab}] shape {shape}({dims}){clock}{trail()}")
        values.append((f"V{i}", shape))
    if draw(st.booleans()):
        out.append("value Plan : Event shape Set()")
    for _ in range(draw(st.integers(0, 4))):
        comment()
        (t, ts), (s, ss) = draw(st.sampled_from(values)), draw(st.sampled_from(values))
        tv = AXES[ts]
        srcv = [tv[min(k, len(tv) - 1)] for k in range(len(AXES[ss]))]
        idx = ", ".join(draw(index(v)) for v in srcv)
        guard = draw(
            st.sampled_from(
                [
                    "",
                    f" when {tv[0]} > 0",
                    f" when {tv[0]} > 0 and not {tv[-1]} == 1",
                    f" when {tv[-1]} >= 1 or {tv[0]} < 2",
                ]
            )
        )
        out.append(f"visible {t}[{','.join(tv)}] <- {s}[{idx}]{guard}{trail()}")
    for r in range(draw(st.integers(0, 2))):
        comment()
        t, ts = draw(st.sampled_from(values))
        tv = AXES[ts]
        out.append(f"rule R{r}:{trail()}")
        out.append(f"  on {t}[{','.join(tv)}]" + draw(st.sampled_from(["", f" when {tv[0]} > 0"])))
        if draw(st.booleans()):
            out.append(f"  read {{ctx = {t}[{', '.join(tv)}], prev_frame}}{trail()}")
            call = draw(st.sampled_from(["M(ctx, prev, e)", "M(ctx, temperature=2, mode=greedy)"]))
        else:
            call = draw(st.sampled_from(["M()", 'M("s", 3, e+1)']))
        out.append(f"  emit proposal {t}[{','.join(tv)}] := {call}")
        if draw(st.booleans()):
            out.append("  score S(...)")
    for c in range(draw(st.integers(0, 3))):
        comment()
        t, ts = draw(st.sampled_from(values))
        tv = AXES[ts]
        pred = draw(
            st.sampled_from(
                [
                    f"change({t}[{', '.join(tv)}])",
                    f"read_future({t}[{', '.join(tv)}])",
                    f'{t}[{", ".join(tv)}] in Set(1, 2..3, "ab")',
                    f'{t}[{tv[0]}, region("sky")]' + ' in Palette("blue")'
                    if len(tv) > 1
                    else f"change({t}[lo..hi])",
                ]
            )
        )
        kind = draw(st.sampled_from(["forbid", "require"]))
        # `hard` (E118 on read_future, which is proved at compile time, not checked)
        hard = " hard" if "read_future" not in pred and draw(st.booleans()) else ""
        if draw(st.booleans()):
            out.append(f"constraint C{c}: {kind} {pred} priority {draw(st.integers(0, 999))}{hard}")
        else:
            out.append(f"constraint C{c}:")
            out.append(f"  {kind} {pred} priority {draw(st.integers(0, 999))}{hard}{trail()}")
    for name, _ in values:
        if draw(st.booleans()):
            comment()
            out.append(f"commit {name}[*] using satisfy(max_constraints_then_score){trail()}")
    if draw(st.booleans()):
        out.append(draw(st.sampled_from(COMMENTS)))
    return "\n".join(out) + "\n"


def _strip_spans(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _strip_spans(v) for k, v in x.items() if k not in ("span", "file")}
    if isinstance(x, list):
        return [_strip_spans(i) for i in x]
    return x


def _ir(text: str) -> Any:
    sink = DiagnosticSink()
    return build(parse(text, "p.lmpm"), sink), sink


def _comments(text: str) -> list[str]:
    out = []
    for line in text.split("\n"):
        if "//" in line:
            out.append(line[line.index("//") :].rstrip())
    return out


@SETTINGS
@given(programs())
def test_fast_parser_equals_lark(text: str) -> None:
    assert tuple(fast.parse_items(text, "p.lmpm")) == parse_lark(text, "p.lmpm").items


@SETTINGS
@given(programs())
def test_ir_json_round_trip_and_lint(text: str) -> None:
    ir, sink = _ir(text)
    assert lint(ir) == []
    assert from_json(to_json(ir)) == ir
    if not sink.has_errors:
        checked = check(ir, DiagnosticSink())
        assert lint(checked) == []
        assert from_json(to_json(checked)) == checked


@SETTINGS
@given(programs())
def test_fmt_is_idempotent_and_keeps_comments_and_ir(text: str) -> None:
    once = format_source(text)
    assert format_source(once) == once
    assert _comments(once) == _comments(text)
    before, _ = _ir(text)
    after, _ = _ir(once)
    assert _strip_spans(to_dict(after)) == _strip_spans(to_dict(before))
