"""One test per diagnostic code: the exact line and column it points at."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmpm.errors import BindError, Diagnostic, LmpmError, ParseError
from lmpm.ir import compile_file, compile_source
from lmpm.ir.eval import bind_params

H = "param N = 8\nvalue A : Token[Byte] shape Seq(N)\n"  # two header lines
G = "param W = 8\nvalue G : Token[Byte] shape Grid2D(W, W)\n"
COMMIT = "commit A[*] using satisfy(max_constraints_then_score)\n"

# code -> (program, line, col)
CASES: dict[str, tuple[str, int, int]] = {
    "P001": ("value A : Token[Byte] shape Seq(4) $\n", 1, 36),
    "P002": ("value A Token[Byte] shape Seq(4)\n", 1, 9),
    "P003": (H + "rule R:\n    on A[t]\n  emit proposal A[t] := M()\n", 5, 1),
    "P004": (H + "visible A[t] <- A[" + "(" * 70 + "t" + ")" * 70 + "]\n", 3, 82),
    "P005": (H + "visible A[t] <- A[t))\n", 3, 20),
    "P006": (H + "visible A[t] <- \x00A[t]\n", 3, 17),
    "P008": (H + "visible A[t] <- A[1" + "0" * 40 + "]\n", 3, 19),
    "E101": (H + "visible A[t] <- B[t]\n", 3, 17),
    "E102": (H + "value A : Token[Byte] shape Seq(N)\n", 3, 1),
    "E103": (G + "visible G[x, y] <- G[x]\n", 3, 20),
    "E104": (H + "value S : Event shape Set()\nvisible A[t] <- S[t]\n", 4, 17),
    "E105": ("value A : Banana shape Seq(4)\n", 1, 11),
    "E106": ("value A : Token[Byte] shape Cube(4)\n", 1, 29),
    "E107": (H + "visible A[t+1] <- A[t]\n", 3, 11),
    "E108": (H + "value B : Token[A] shape Seq(N)\n", 3, 17),
    "E109": (H + "visible A[t] <- A[t+d] when d in N5\n", 3, 34),
    "E110": (H + "visible A[t] <- A[t] when t > q\n", 3, 31),
    "E111": (H + "rule R:\n  on A[t]\n  read {}\n", 3, 6),
    "E112": (H + "rule R:\n  on A[t]\n  read {ghost}\n  emit proposal A[t] := M(ghost)\n", 5, 9),
    "E113": (H + "param K\nconstraint C:\n  forbid change(A[t]) priority K\n", 5, 32),
    "E114": (H + "visible A[t] <- A[t*t]\n", 3, 19),
    "E115": (H + "constraint C:\n  forbid 3 priority 1\n", 4, 10),
    "E116": (H + "constraint C:\n  forbid change(A[t], A[t]) priority 1\n", 4, 10),
    "E117": (H + "commit A[0..3] using satisfy(max_constraints_then_score)\n", 3, 8),
    "E199": (H + "visible A[t] <- A[t" + "+1" * 3000 + "]\n", 3, 1),
    "E201": (
        H
        + "rule R:\n  on A[t]\n  read {ctx = A[0..t-1]}\n  emit proposal A[t] := M(ctx)\n"
        + COMMIT,
        5,
        9,
    ),
    "E203": ("param W = 30\nvalue A : Token[Byte] shape Seq(W/8)\n", 2, 33),
    "E204": (
        H
        + "visible A[t] <- A[t+1] when t < N-1\nconstraint C:\n  forbid read_future(A[t]) priority 1\n",
        3,
        1,
    ),
    "E207": (H + "rule R:\n  on A[t]\n  emit proposal A[t] := Mystery()\n" + COMMIT, 5, 25),
    "E208": (H + "commit A[*] using satisfy(x)\ncommit A[*] using average()\n", 4, 1),
    "E209": ("param N = 0\nvalue A : Token[Byte] shape Seq(N)\n", 2, 33),
    "W105": ("value S : Token[Byte] shape Set()\n", 1, 29),
    "W202": (H + "visible A[t] <- A[t-1]\n", 3, 1),
    "W205": (H + "rule R:\n  on A[t] when t > 100\n  emit proposal A[t] := M()\n" + COMMIT, 4, 16),
    "W206": (H + "constraint C:\n  forbid change(A[t]) priority 1\n", 3, 1),
    "W207": (H + "rule R:\n  on A[t]\n  emit proposal A[t] := M()\n", 3, 1),
    "W208": (
        "value A : Token[8] shape Seq(4)\nconstraint C:\n  require A[t] in Set(0..9) priority 1\n",
        3,
        19,
    ),
    "W209": ("value A : Token[BPE] shape Seq(4)\n", 1, 1),
    "B002": ("param M\nparam N = M + 1\nvalue A : Token[Byte] shape Seq(N)\n", 2, 1),
}


def _diagnostics(code: str, text: str) -> list[Diagnostic]:
    kw: dict[str, object] = {}
    if code == "E207":
        kw = {"strict": True, "known_names": {"satisfy"}}
    try:
        return list(compile_source(text, "p.lmpm", raise_errors=False, **kw).diagnostics)  # type: ignore[arg-type]
    except ParseError as e:
        return e.diagnostics


@pytest.mark.parametrize("code", sorted(CASES))
def test_diagnostic_points_at_its_line_and_column(code: str) -> None:
    text, line, col = CASES[code]
    diags = _diagnostics(code, text)
    hits = [d for d in diags if d.code == code]
    assert hits, [d.render() for d in diags]
    d = hits[0]
    assert d.span is not None
    assert (d.span.line, d.span.col) == (line, col), d.render()
    assert d.severity == ("warning" if code.startswith("W") else "error")
    rendered = d.render()
    assert f"p.lmpm:{line}:{col}: " in rendered and f"[{code}]" in rendered
    if code not in ("P006",):
        assert "^" in rendered  # the source line with a caret


def test_p007_invalid_utf8_points_at_the_byte(tmp_path: Path) -> None:
    p = tmp_path / "bad.lmpm"
    p.write_bytes(b"param N = 8\nvalue A\xff : Token[Byte] shape Seq(N)\n")
    with pytest.raises(ParseError) as ei:
        compile_file(p)
    assert ei.value.code == "P007"
    assert ei.value.span is not None and (ei.value.span.line, ei.value.span.col) == (2, 8)


def test_b001_unknown_set_name_lists_the_parameters() -> None:
    front = compile_source(H, "p.lmpm", overrides={"Q": 1}, raise_errors=False)
    (d,) = [d for d in front.diagnostics if d.code == "B001"]
    assert d.span is None and "Q" in d.message and "N" in d.message


def test_b003_parameter_without_value() -> None:
    ir = compile_source("param K\nvalue A : Token[Byte] shape Seq(8)\n").ir
    with pytest.raises(BindError) as ei:
        bind_params(ir, require_all=True)
    assert ei.value.code == "B003" and "--set K=" in (ei.value.hint or "")


def test_w202_hint_names_the_guard_to_add() -> None:
    text, _, _ = CASES["W202"]
    (d,) = [d for d in _diagnostics("W202", text) if d.code == "W202"]
    assert d.hint == "add `when t > 0`"
    text = H + "visible A[t] <- A[t+2]\n"
    (d,) = [d for d in _diagnostics("W202", text) if d.code == "W202"]
    assert d.hint == "add `when t < N-2`"


def test_binder_indices_are_clipped_silently() -> None:
    front = compile_source(
        G + "visible G[x,y] <- G[x+dx, y+dy] when (dx,dy) in N8\n", raise_errors=False
    )
    assert not front.diagnostics


def test_checks_raise_check_error_by_default() -> None:
    with pytest.raises(LmpmError) as ei:
        compile_source(CASES["E101"][0], "p.lmpm")
    assert ei.value.code == "E101"
