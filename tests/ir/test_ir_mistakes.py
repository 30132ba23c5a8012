"""A corpus of deliberate mistakes: each is located by `lmpm check` (code + line:col on the exact
sub-expression), and the same checks run before epoch 0 of `lmpm run`.

Run as a script to print how many are located: ``python tests/ir/test_ir_mistakes.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from lmpm.errors import LmpmError
from lmpm.ir import compile_source

TEXT = """param N = 16
value Txt : Token[Byte] shape Seq(N) clock Lamport
value MaskPlan : Event shape Set() clock Lamport
visible Txt[t] <- Txt[0..t-1] when t > 0
rule NextByte:
  on Txt[t]
  read {context = Txt[0..t-1]}
  emit proposal Txt[t] := ByteLM(context, k=2, temperature=0.7)
  score TextScore(...)
constraint Plain:
  require Txt[t] in Set(97..122, " ") priority 10
commit Txt[*] using satisfy(max_constraints_then_score)
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="raster", k=1)
"""

VIDEO = """param T = 2
param W = 16
value Txt : Token[256] shape Seq(8)
value Vid : Token[16] shape Grid3D(T, W, 8)
value Coarse : Token[16] shape Grid3D(T, W/8, 1)
visible Vid[t,x,y] <- Txt[*]
visible Coarse[t,i,j] <- Txt[*]
rule LocalGen:
  on Vid[t,x,y]
  read {Txt[*]}
  emit proposal Vid[t,x,y] := Model(txt)
constraint Sky:
  require Vid[t, region("sky")] in Palette("blue-ish") priority 50
rule CoarsePlan:
  on Coarse[t,i,j]
  read {Txt[*]}
  emit proposal Coarse[t,i,j] := CoarseGen(txt)
"""

SUDOKU = """value Grid : Token[10] shape Grid2D(9, 9)
visible Grid[x, y] <- Grid[x, *]
rule Propose:
  on Grid[x, y]
  read {row = Grid[x, *]}
  emit proposal Grid[x, y] := Digits(row, patience=3)
"""

LATENT = """param R = 3
value Z : Tensor[4] shape Grid2D(6, 4)
visible Z[x, y] <- Z[x+dx, y+dy] when (dx,dy) in N4
rule Message:
  on Z[x, y]
  read {nb in N4}
  emit proposal Z[x, y] := Amplify(nb, k=4)
constraint Bounded: require NormAtMost(Z[x, y], R) priority 10 hard
commit Z[*] using satisfy(max_constraints_then_score)
"""


@dataclass(frozen=True)
class Mistake:
    name: str
    base: str
    old: str  # replaced in the base program...
    new: str  # ...by this
    code: str  # expected diagnostic code
    at: str  # the text the caret must start on (its first occurrence in the changed line)
    sets: tuple[tuple[str, int], ...] = ()

    def source(self) -> str:
        assert self.old in self.base, self.name
        return self.base.replace(self.old, self.new, 1)

    def where(self) -> tuple[int, int]:
        """(line, col) of ``at`` in the first line that differs from the base, else in the first
        line of the program that holds it."""
        lines = self.source().split("\n")
        for i, (a, b) in enumerate(zip(lines, self.base.split("\n")), start=1):
            if a != b and self.at in a:
                return i, a.index(self.at) + 1
        for i, a in enumerate(lines, start=1):
            if self.at in a:
                return i, a.index(self.at) + 1
        raise AssertionError(self.name)


# B sequences along the FIRST axis of a Grid2D: the frontier schedule (rows = the first axis)
# would open cells whose context is not generated yet
GRID = """param N = 16
value Txt : Token[Byte] shape Grid2D(N, 4) clock Lamport
value MaskPlan : Event shape Set() clock Lamport
visible Txt[t, b] <- Txt[0..t-1, b] when t > 0
rule NextByte:
  on Txt[t, b]
  read {context = Txt[0..t-1, b]}
  emit proposal Txt[t, b] := ByteLM(context, k=2)
commit Txt[*] using satisfy(max_constraints_then_score)
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="frontier")
"""


def m(name: str, base: str, old: str, new: str, code: str, at: str, **kw: object) -> Mistake:
    return Mistake(name, base, old, new, code, at, **kw)  # type: ignore[arg-type]


POL = "satisfy(max_constraints_then_score)"
MISTAKES = [
    m("unknown policy", TEXT, POL, "satisfy_all", "E210", "satisfy_all"),
    m("policy mode typo", TEXT, POL, "satisfy(max_constraint_then_score)", "E210", "max_"),
    m("average on tokens", TEXT, POL, "average", "E211", "average"),
    m("quorum k below 1", TEXT, POL, "quorum(0, satisfy)", "E210", "0,"),
    m("quorum k a string", TEXT, POL, 'quorum("two")', "E210", '"two"'),
    m("quorum inner unknown", TEXT, POL, "quorum(2, satisfied)", "E210", "satisfied"),
    m("policy extra argument", TEXT, POL, "winner_takes_all(3)", "E210", "3)"),
    m("unknown strategy", TEXT, '"raster"', '"rster"', "E212", '"rster"'),
    m("schedule k below 1", TEXT, "k=1)", "k=0)", "E212", "0)"),
    m("schedule positional", TEXT, 'strategy="raster"', '"raster"', "E212", '"raster"'),
    m("schedule keyword typo", TEXT, "strategy=", "stratgy=", "E212", "stratgy"),
    m("schedule steps a decimal", TEXT, "k=1)", "steps=2.5)", "E212", "2.5"),
    m("frontier given steps", TEXT, '"raster", k=1)', '"frontier", steps=4)', "E212", "steps"),
    m(
        "frontier on the first axis",
        GRID,
        '"frontier"',
        '"frontier"',
        "E212",
        '"frontier"',
    ),
    m("unknown model", TEXT, "ByteLM(", "ByteLm(", "W210", "ByteLm"),
    m(
        "model input missing",
        TEXT,
        "{context = Txt[0..t-1]}\n  emit proposal Txt[t] := ByteLM(context",
        "{ctx = Txt[0..t-1]}\n  emit proposal Txt[t] := ByteLM(ctx",
        "E213",
        "ByteLM",
    ),
    m("model keyword typo", TEXT, "temperature=", "temprature=", "E213", "temprature"),
    m("model k below 1", TEXT, "k=2", "k=0", "E213", "0, "),
    m("model temperature a string", TEXT, "0.7", '"hot"', "E213", '"hot"'),
    m("model temperature zero", TEXT, "0.7", "0.0", "E213", "0.0"),
    m(
        "model vocabulary",
        TEXT,
        "Token[Byte] shape Seq(N)",
        "Token[16] shape Seq(N)",
        "E213",
        "ByteLM",
    ),
    m("unknown score", TEXT, "TextScore(", "TextScor(", "W210", "TextScor"),
    m(
        "score input missing",
        TEXT,
        "score TextScore(...)",
        "score TextScore()",
        "E213",
        "TextScore",
    ),
    m(
        "video model input missing",
        VIDEO,
        "read {Txt[*]}\n  emit proposal Vid[t,x,y] := Model(txt)",
        "read {caption = Txt[*]}\n  emit proposal Vid[t,x,y] := Model(caption)",
        "E213",
        "Model",
    ),
    m("sudoku model inputs missing", SUDOKU, "Digits(row", "Digits(row", "E213", "Digits"),
    m("unknown set", VIDEO, 'Palette("blue-ish")', 'Palete("blue-ish")', "W210", "Palete"),
    m("shape not exact", VIDEO, "param W = 16", "param W = 20", "E203", "W/8"),
    m("decimal as an index", TEXT, "Txt[0..t-1] when", "Txt[0..t-0.5] when", "E108", "0.5"),
    m("decimal as a priority", TEXT, "priority 10", "priority 0.5", "E108", "0.5"),
    m("read not visible", TEXT, "context = Txt[0..t-1]", "context = Txt[0..t]", "E201", "context"),
    m("unknown read argument", TEXT, "ByteLM(context,", "ByteLM(contxt,", "E112", "contxt"),
    m(
        "read_future refuted",
        TEXT,
        "when t > 0\n",
        "when t > 0\nvisible Txt[t] <- Txt[t+1] when t < N-1\nconstraint C: forbid read_future(Txt[t]) priority 1\n",
        "E204",
        "visible",
    ),
    m("unknown value", TEXT, "read {context = Txt", "read {context = Tx", "E101", "Tx["),
    m("predicate bound a string", LATENT, "Z[x, y], R)", 'Z[x, y], "big")', "E215", '"big"'),
    m("predicate bound a quoted number", LATENT, "Z[x, y], R)", 'Z[x, y], "2.5")', "E215", '"2'),
    m("predicate bound an unknown name", LATENT, "Z[x, y], R)", "Z[x, y], big)", "E215", "big"),
    m("predicate keyword typo", LATENT, "Z[x, y], R)", "Z[x, y], bond=2)", "E215", "bond"),
    m("predicate one argument too many", LATENT, "Z[x, y], R)", "Z[x, y], R, 2)", "E215", "2)"),
    m("set name not a string", VIDEO, 'Palette("blue-ish")', "Palette(7)", "E215", "7"),
]
# `sudoku model inputs missing` changes nothing textually on purpose: the base itself omits reads.


def _diags(mk: Mistake, **kw: object) -> list[tuple[str, int, int]]:
    try:
        front = compile_source(
            mk.source(),
            "mistake.lmpm",
            overrides=dict(mk.sets),
            raise_errors=False,
            **kw,  # type: ignore[arg-type]
        )
        diags = list(front.diagnostics)
    except LmpmError as e:  # a syntax error
        diags = e.diagnostics
    return [(d.code, d.span.line, d.span.col) for d in diags if d.span is not None]


def _where(mk: Mistake) -> tuple[int, int]:
    return mk.where()


@pytest.mark.parametrize("mk", MISTAKES, ids=[mk.name for mk in MISTAKES])
def test_mistake_is_located_by_check(mk: Mistake) -> None:
    line, col = _where(mk)
    assert (mk.code, line, col) in _diags(mk), _diags(mk)


@pytest.mark.parametrize("mk", [mk for mk in MISTAKES if mk.code == "W210"], ids=lambda mk: mk.name)
def test_unknown_names_are_errors_when_the_bindings_are_known(mk: Mistake) -> None:
    """What `lmpm run` and `check --strict` see: the run's bound names are known."""
    from lmpm.bindings import known_names

    line, col = _where(mk)
    assert ("E207", line, col) in _diags(mk, strict=True, known_names=known_names())


def test_the_bases_are_clean() -> None:
    for base in (TEXT, VIDEO, LATENT):
        front = compile_source(base, "base.lmpm", raise_errors=False)
        assert not front.errors, [d.render() for d in front.errors]


def test_epoch_guards_are_not_never_firing() -> None:
    text = TEXT.replace("  on Txt[t]\n", "  on Txt[t] when e >= 3\n")
    codes = [d.code for d in compile_source(text, raise_errors=False).diagnostics]
    assert "W205" not in codes
    never = TEXT.replace("  on Txt[t]\n", "  on Txt[t] when e < 0\n")
    found = [d for d in compile_source(never, "g.lmpm", raise_errors=False).diagnostics]
    w205 = [d for d in found if d.code == "W205"]
    assert w205 and w205[0].span is not None and w205[0].span.col == len("  on Txt[t] when ") + 1


def located(strict: bool) -> int:
    """How many mistakes a diagnostic points at exactly (any code): the figure in the report."""
    n = 0
    for mk in MISTAKES:
        kw: dict[str, object] = {}
        if strict:
            from lmpm.bindings import BUILTINS

            kw = {"strict": True, "known_names": set(BUILTINS)}
        got = _diags(mk, **kw)
        if any((ln, col) == _where(mk) for _, ln, col in got):
            n += 1
    return n


if __name__ == "__main__":
    sys.stdout.write(
        f"{len(MISTAKES)} mistakes; located by check: {located(False)}, "
        f"by check --strict / run: {located(True)}\n"
    )


@pytest.mark.parametrize(
    ("visible", "read"),
    [
        ("visible G[x,y] <- G[x+dx, y+dy] when (dx,dy) in N4", "nb in N8"),  # a neighbourhood
        ("visible G[x,y] <- G[x+1, y]", "left = G[x-1, y]"),  # one cell
        ("visible G[x,y] <- G[x+d, y] when d in -1..1 and d != 0", "w = G[x-2..x+2, y]"),
    ],
)
def test_the_visibility_hint_is_a_clause_that_can_be_pasted(visible: str, read: str) -> None:
    text = (
        "value G : Token[8] shape Grid2D(8, 8)\n"
        f"{visible}\n"
        "rule R:\n"
        "  on G[x, y]\n"
        f"  read {{{read}}}\n"
        f"  emit proposal G[x, y] := M({read.split()[0]})\n"
    )
    front = compile_source(text, "<hint>", raise_errors=False)
    (miss,) = [d for d in front.diagnostics if d.code == "E201"]
    assert miss.hint is not None and miss.hint.startswith("add a clause: `")
    clause = miss.hint.removeprefix("add a clause: `").removesuffix("`")
    fixed = compile_source(text + clause + "\n", "<hint>", raise_errors=False)
    assert not [d for d in fixed.diagnostics if d.severity == "error"], fixed.diagnostics
