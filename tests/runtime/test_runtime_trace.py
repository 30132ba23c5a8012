"""The constraint trace: counts against the reference interpreter, regions, `lmpm trace`."""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from lmpm.cli import main
from lmpm.errors import UsageError
from lmpm.ir import compile_source
from lmpm.runtime.control.commitlog import CommitLog, RunInfo, program_hash
from lmpm.runtime.control.trace import Tracer, cell_story, epoch_ranges, parse_region, report
from lmpm.runtime.rundir import connect
from lmpm.runtime.session import Run

sys.path.insert(0, str(Path(__file__).parent))
from reference import Reference
from test_runtime_differential import BINDINGS, programs, used


def _info(src: str, front: Any, level: str, seed: int = 0) -> RunInfo:
    return RunInfo(
        program_hash(front.ir), "<input>", src, {}, (), seed, "cpu", None, None, level, None, 1000
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_summary_counts_equal_the_reference_interpreter(case: tuple[str, dict[str, Any]]) -> None:
    src, info = case
    front = compile_source(src, raise_errors=False)
    run = Run(front, bindings=used(front, BINDINGS), seed=info["seed"])
    ref = Reference(front.ir, bindings=BINDINGS, seed=info["seed"])
    with tempfile.TemporaryDirectory() as d:
        log = CommitLog(
            d, _info(src, front, "summary", info["seed"]), tracer=Tracer(run.plan, "summary")
        )
        run.engine.observers.append(log)
        run.run(info["epochs"])
        for _ in range(info["epochs"]):
            ref.step()
        log.close()
        conn = connect(d)
        got = {
            (e, name, rule): [checked, viol, won, lost]
            for e, name, rule, checked, viol, won, lost in conn.execute(
                "SELECT s.epoch, c.name, s.rule, s.checked, s.violations, s.won, s.lost "
                "FROM trace_summary s JOIN constraint_defs c ON c.id = s.constraint_id"
            )
        }
        decided = {e: n for e, n in conn.execute("SELECT epoch, decided FROM epochs")}
        conn.close()
    assert got == ref.trace, src
    for e, n in decided.items():
        # a decision counts once in the epoch total, once per responsible constraint in `lost`
        assert n <= sum(v[3] for k, v in got.items() if k[0] == e)


CELLS = """
param W = 4
param H = 4
value G : Token[5] shape Grid2D(W, H)
value MaskPlan : Event shape Set()
visible G[x, y] <- G[x, *]
rule R:
  on G[x, y]
  read {row = G[x, *]}
  emit proposal G[x, y] := Uniform(row, k=3)
constraint Lock: forbid change(G[0, 0..3]) priority 100
constraint Low: require G[x, y] in Set(0..2) priority 10
constraint Diff: forbid clash(G[x, y], G[x, *]) priority 10
commit G[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""


def _run(tmp_path: Path, name: str, *extra: str) -> Path:
    prog = tmp_path / "grid.lmpm"
    prog.write_text(CELLS)
    out = tmp_path / name
    args = ["run", str(prog), "--seed", "2", "--epochs", "6", "--out", str(out), "--quiet"]
    assert main([*args, *extra]) == 0
    return out


@pytest.fixture
def traced_run(tmp_path: Path) -> Path:
    return _run(tmp_path, "run", "--trace", "cells", "--trace-region", "G[0..2, *]")


def test_cells_level_agrees_with_the_summary(tmp_path: Path) -> None:
    conn = sqlite3.connect(_run(tmp_path, "all", "--trace", "cells") / "lmpm.db")
    # Every candidate row's violation bits, counted per constraint, give the summary's counts.
    per_cand = {
        (e, k, r): n
        for e, k, r, n in conn.execute(
            "SELECT c.epoch, d.id, c.rule, count(*) FROM trace_candidates c JOIN constraint_defs d "
            "ON (c.violated >> d.id) & 1 GROUP BY c.epoch, d.id, c.rule"
        )
    }
    summary = {
        (e, k, r): n
        for e, k, r, n in conn.execute(
            "SELECT epoch, constraint_id, rule, violations FROM trace_summary WHERE violations > 0"
        )
    }
    assert per_cand == summary
    # decided_by lists exactly the constraints the summary counts as lost
    lost = dict(
        conn.execute(
            "SELECT epoch, sum(lost) FROM trace_summary GROUP BY epoch HAVING sum(lost) > 0"
        ).fetchall()
    )
    by = {}
    for e, dec in conn.execute(
        "SELECT epoch, decided_by FROM trace_cells WHERE decided_by IS NOT NULL"
    ):
        by[e] = by.get(e, 0) + len(json.loads(dec))
    assert by == lost
    # a committed attempt's winner candidate holds the committed payload
    for e, cell, w, payload in conn.execute(
        "SELECT epoch, cell, winner, payload FROM trace_cells WHERE committed"
    ):
        win = conn.execute(
            "SELECT payload FROM trace_candidates WHERE epoch=? AND cell=? AND col=?", (e, cell, w)
        ).fetchone()
        assert win[0] == payload
    conn.close()


def test_trace_report_cell_story_json_and_plot(
    traced_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", str(traced_run), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    names = {c["name"]: c for c in rep["constraints"]}
    assert set(names) == {"Lock", "Low", "Diff"}
    assert rep["run"]["epochs"] == 6 and rep["run"]["trace"] == "cells"
    assert names["Low"]["violations"] > 0
    for b in rep["blocked"]:
        assert b["where"].startswith("G[") and b["decisions"] > 0
    assert main(["trace", str(traced_run)]) == 0
    out = capsys.readouterr().out
    assert "constraints" in out and "Lock" in out
    assert main(["trace", str(traced_run), "--cell", "G[1, 2]", "--json"]) == 0
    story = json.loads(capsys.readouterr().out)
    assert story["traced"] and story["attempts"]
    conn = sqlite3.connect(traced_run / "lmpm.db")
    traced = {r[0] for r in conn.execute("SELECT DISTINCT cell FROM trace_cells")}
    conn.close()
    assert traced == {x * 4 + y for x in range(3) for y in range(4)}
    for a in story["attempts"]:
        assert sum(c["winner"] for c in a["candidates"]) == 1 and a["why"]
        assert set(a["candidates"][0]["verdicts"]) == {"Lock", "Low", "Diff"}
    assert main(["trace", str(traced_run), "--cell", "G[3, 1]"]) == 0  # outside the region
    assert "not traced" in capsys.readouterr().out
    png = tmp_path / "v.png"
    assert main(["trace", str(traced_run), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cell_story_without_cell_trace_shows_commits(tmp_path: Path) -> None:
    prog = tmp_path / "grid.lmpm"
    prog.write_text(CELLS)
    out = tmp_path / "run"
    assert (
        main(["run", str(prog), "--epochs", "4", "--out", str(out), "--quiet", "--trace", "off"])
        == 0
    )
    conn = connect(out)
    story = cell_story(conn, out, "G[2, 3]")
    rep = report(conn, out)
    conn.close()
    assert not story["traced"]
    final = json.loads((out / "G.json").read_text())[2][3]
    if story["commits"]:
        assert story["commits"][-1]["payload"] == final
    assert rep["run"]["decided"] is None and rep["never_fired"] == []


def test_parse_region() -> None:
    dims = {"Vid": (4, 32, 32), "Txt": (77,)}
    r = parse_region("Vid[0, 0..15, 0..15]", dims)
    assert r.value == "Vid" and r.box == ((0, 0), (0, 15), (0, 15))
    assert int(r.mask(dims["Vid"]).sum()) == 256
    assert str(parse_region("Vid[*]", dims)) == "Vid[0..3, 0..31, 0..31]"
    assert str(parse_region(" Txt ", dims)) == "Txt[0..76]"
    assert parse_region("Vid[3,10,12]", dims).flat(dims["Vid"]) == 3 * 1024 + 10 * 32 + 12
    for bad, msg in [
        ("Vid[0, 0..40, 0]", "outside"),
        ("Vid[0, 1]", "3 axes"),
        ("Nope[1]", "no value"),
        ("Vid[0, a, 1]", "axis 1"),
        ("[1]", "cannot"),
    ]:
        with pytest.raises(UsageError, match=msg):
            parse_region(bad, dims)


def test_epoch_ranges() -> None:
    assert epoch_ranges([0, 1, 2, 5, 7, 8]) == "0..2, 5, 7..8"
    assert epoch_ranges([]) == ""


def test_trace_flags_are_checked(tmp_path: Path) -> None:
    prog = tmp_path / "grid.lmpm"
    prog.write_text(CELLS)
    assert main(["run", str(prog), "--out", str(tmp_path / "a"), "--trace-region", "G[0, 0]"]) == 2
    assert (
        main(
            [
                "run",
                str(prog),
                "--out",
                str(tmp_path / "b"),
                "--trace",
                "cells",
                "--trace-region",
                "G[9, 0]",
            ]
        )
        == 2
    )


def test_report_of_a_program_without_constraints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = tmp_path / "free.lmpm"
    prog.write_text("\n".join(line for line in CELLS.splitlines() if "constraint" not in line))
    out = tmp_path / "run"
    assert main(["run", str(prog), "--epochs", "3", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["trace", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the program declares no constraint" in text
    assert "constraints" not in [line.strip() for line in text.splitlines()]  # no empty table


# ---- `hard` constraints in the attribution (docs/trace.md, "Decided by a constraint") -----------
HARD = """
value A : Token[5] shape Seq(2)
rule R:
  on A[t]
  emit proposal A[t] := Fixed()
constraint NoThree: forbid A[t] in Set(3, 4) priority 5 hard
constraint Want: require A[t] in Set(3, 4) priority 20
commit A[*] using satisfy(max_constraints_then_score)
"""

FIXED = """
import torch
import lmpm

@lmpm.bind("Fixed")
def fixed(inputs, **_):
    # every cell: 3 (score 1.0, the favourite), then 1 (score 0.0)
    n = inputs["cells"].shape[0]
    return {"proposal": torch.tensor([[3, 1]] * n),
            "score": torch.tensor([[1.0, 0.0]] * n, dtype=torch.float64)}
"""


@pytest.mark.parametrize("extra", [(), ("--compile",), ("--workers", "2")])
def test_a_favourite_a_hard_constraint_excludes_is_decided_by_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]
) -> None:
    """The favourite 3 breaks the hard NoThree and so is never eligible; it satisfies the higher
    soft Want, which the level-by-level narrowing alone would let it survive. A[0] (unset) commits
    1; A[1], given 4 (input is not checked), keeps 4, which breaks NoThree too. Both decisions are
    NoThree's: in the trace rows, the summary, `decided` and `lmpm trace --cell`."""
    prog, mod, given, out = (tmp_path / n for n in ("h.lmpm", "fixed.py", "a.json", "run"))
    prog.write_text(HARD)
    mod.write_text(FIXED)
    given.write_text("[-1, 4]")
    argv = ["run", str(prog), "--bind", str(mod), "--input", f"A={given}", "--epochs", "1"]
    assert main([*argv, "--out", str(out), "--trace", "cells", "--quiet", *extra]) == 0
    capsys.readouterr()
    conn = connect(out)
    ids = dict(conn.execute("SELECT name, id FROM constraint_defs"))
    cells = conn.execute(
        "SELECT cell, favourite, winner, committed, decided_by FROM trace_cells ORDER BY cell"
    ).fetchall()
    won_lost = conn.execute(
        "SELECT c.name, s.rule, s.won, s.lost FROM trace_summary s "
        "JOIN constraint_defs c ON c.id = s.constraint_id WHERE s.won + s.lost > 0 "
        "ORDER BY c.name, s.rule"
    ).fetchall()
    decided = conn.execute("SELECT decided FROM epochs").fetchall()
    conn.close()
    by = json.dumps([ids["NoThree"]])
    assert cells == [(0, 1, 2, 1, by), (1, 1, 0, 0, by)], cells
    # rule R (id 0) lost both decisions and won the first; keep-current (-1) won the second
    assert won_lost == [("NoThree", -1, 1, 0), ("NoThree", 0, 1, 2)], won_lost
    assert decided == [(2,)]
    assert main(["trace", str(out), "--cell", "A[0]"]) == 0
    story = " ".join(capsys.readouterr().out.split())
    assert (
        "epoch 0: the score favourite, R proposing 3 (score 1), violates the hard constraint "
        "NoThree (priority 5), so it was not eligible; R proposing 1 (score 0) won; committed"
    ) in story, story
    assert main(["trace", str(out), "--cell", "A[1]"]) == 0
    story = " ".join(capsys.readouterr().out.split())
    assert "violates the hard constraint NoThree (priority 5), so it was not eligible; keep " in (
        story
    ), story
    assert main(["trace", str(out)]) == 0
    assert "2 decisions were decided by a constraint" in " ".join(capsys.readouterr().out.split())


LOWERED = """
value T : Token[6] shape Seq(4)
value MaskPlan : Event shape Set()
visible T[t] <- T[0..t-1] when t > 0
rule R:
  on T[t]
  read {{ctx = T[0..t-1]}}
  emit proposal T[t] := Gen(ctx, k={k}, pick="top")
constraint No5: require T[t] in Set(0..4) priority 10 hard
constraint Low: require T[t] in Set(0..3) priority 20
commit T[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="raster")
"""


def _gen(inputs: dict[str, Any], k: int = 1, pick: str = "top", **_: Any) -> Any:
    import torch

    from lmpm import Logits

    logits = torch.zeros(inputs["cells"].shape[0], 6)
    logits[:, 5] = 3.0  # the favourite, which the hard No5 forbids
    logits[:, 4] = 2.0  # allowed by No5, forbidden by Low
    logits[:, 2] = 1.0  # the policy's choice out of all six
    return Logits(logits, k=int(k), pick=pick)


@pytest.mark.parametrize("k", [1, 6])
def test_a_favourite_the_vocabulary_mask_drops_is_decided_by_the_hard_constraint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """Issue 43 item 4: with k=1 the lowered constraints mask the logits before the choice, and
    the model's own favourite (5) is still checked (lmpm.workers.choose.alone_column): the hard
    No5 that excluded it decides every cell, as with all six tokens as candidates."""
    import lmpm.resolve.plan as plan_module

    if k > 1:  # the general semantics: all six tokens are candidates, checked after the model
        monkeypatch.setattr(plan_module, "lower", lambda plan: {})
    src = LOWERED.format(k=k)
    front = compile_source(src, raise_errors=False)
    run = Run(front, bindings={"Gen": _gen}, seed=0)
    assert bool(run.plan.masks) == (k == 1)
    log = CommitLog(str(tmp_path), _info(src, front, "cells"), tracer=Tracer(run.plan, "cells"))
    run.engine.observers.append(log)
    run.run(6)
    log.close()
    assert run.outputs()["T"].tolist() == [2, 2, 2, 2]
    conn = connect(tmp_path)
    no5 = conn.execute("SELECT id FROM constraint_defs WHERE name = 'No5'").fetchone()[0]
    rows = conn.execute(
        "SELECT cell, decided_by FROM trace_cells WHERE committed = 1 ORDER BY cell"
    ).fetchall()
    conn.close()
    assert [(cell, json.loads(by or "[]")) for cell, by in rows] == [(c, [no5]) for c in range(4)]
