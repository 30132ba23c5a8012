"""Honest termination: when a run may call itself stable, and why cells stay unset.

The four traps of issue 14 (an epoch-guarded rule, the confidence schedule with a given prefix, a
hard `forbid` under raster, a prefix-LM whose raster opens a cell no rule fires on), the stop reason
in the engine's result, the commit log, the CLI summary and `lmpm trace`, and the property that a
run reported stable commits nothing however many epochs follow.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmpm.ir import compile_source
from lmpm.ir.nodes import Expr, Op
from lmpm.resolve.plan import resolve
from lmpm.resolve.schedules import epoch_horizon
from lmpm.runtime.control.engine import why_text
from lmpm.runtime.records import (
    HELD,
    NEVER_OPENED,
    NO_QUORUM,
    NO_SOURCE,
    NO_WINNER,
    NOT_FIRED,
    UNKNOWN,
)
from lmpm.runtime.session import Run

sys.path.insert(0, str(Path(__file__).parent))
from reference import Reference
from test_runtime_differential import BINDINGS, _state, used

BASE = """
param N = 6
value A : Token[8] shape Seq(N)
value MaskPlan : Event shape Set()
visible A[t] <- A[0..t-1] when t > 0
rule R:
  on A[t]{guard}
  read {{ctx = A[0..t-1]}}
  emit proposal A[t] := RandomTokens(ctx)
{constraints}
commit A[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="{strategy}"{tiles})
"""


def program(strategy: str, guard: str = "", constraints: str = "", tiles: str = "") -> str:
    return BASE.format(
        guard=f" when {guard}" if guard else "",
        constraints=constraints,
        strategy=strategy,
        tiles=tiles,
    )


def prefix(run: Run, given: int = 2) -> None:
    run.set_input(
        "A",
        torch.tensor([1 + i if i < given else -1 for i in range(6)]),
        torch.arange(6) < given,
    )


# ---- the four traps -------------------------------------------------------------------------------
def test_epoch_guarded_rule_fires_before_the_run_is_stable() -> None:
    run = Run.from_source(program("all", guard="e >= 3"))
    res = run.run(until_stable=True, max_epochs=50)
    st_ = run.engine.state["A"]
    assert res.stable and bool(st_.committed.all())
    assert st_.epoch.tolist() == [3] * 6  # the guard opened at epoch 3, not before
    assert res.stop is not None and res.stop.kind == "stable" and res.stop.total_unset == 0


def test_committed_cells_breaking_a_soft_require_are_counted() -> None:
    # A soft `require` loses to no better candidate: the run sets every cell, and says which
    # committed cells break it (never "every cell set" alone).
    run = Run.from_source(
        program(
            "raster",
            constraints="constraint Low: require A[t] in Set(0..1) priority 10",
            tiles=", k=1",
        )
    )
    res = run.run(until_stable=True, max_epochs=50)
    out = run.outputs()["A"].tolist()
    bad = sum(1 for x in out if x not in (0, 1))
    assert res.stop is not None and res.stop.total_unset == 0 and bad > 0
    assert res.stop.broken == {"A": {"Low": bad}}
    cells = "cells break" if bad > 1 else "cell breaks"
    assert res.stop.message().endswith(f"every cell set; {bad} committed {cells} `Low` (A)")


def test_periodic_guard_gets_every_residue() -> None:
    # `e % 3 == 2` fires only every third epoch: a raster pass must try each cell at each residue.
    run = Run.from_source(program("raster", guard="e % 3 == 2", tiles=", k=1"))
    res = run.run(until_stable=True, max_epochs=200)
    assert res.stable and bool(run.engine.state["A"].committed.all())
    assert all(e % 3 == 2 for e in run.engine.state["A"].epoch.tolist())


def test_confidence_with_a_prefix_generates_the_rest() -> None:
    run = Run.from_source(program("confidence", tiles=", steps=4"))
    prefix(run)
    res = run.run(until_stable=True, max_epochs=50)
    st_ = run.engine.state["A"]
    assert res.stable and bool(st_.committed.all())
    # the cosine share applies to the 4 cells to generate: 1, 1, 1, 1 over the 4 steps
    assert sorted(st_.epoch.tolist()[2:]) == [0, 1, 2, 3]


def test_every_why_code_has_its_own_words() -> None:
    """Only a constraint id blames a constraint; a code without words says so (issue 44)."""
    src = program("raster", constraints="constraint Hard: forbid A[2] in Set(0..7) priority 100")
    plan = resolve(compile_source(src).ir)
    codes = (HELD, NEVER_OPENED, NO_QUORUM, NO_SOURCE, NO_WINNER, NOT_FIRED, UNKNOWN)
    texts = [why_text(c, plan, "A") for c in codes]
    assert len(set(texts)) == len(codes) and not any("violates" in t for t in texts)
    assert why_text(0, plan, "A") == "every candidate violates `Hard`"
    assert "code -99" in why_text(-99, plan, "A") and "violates" not in why_text(-99, plan, "A")
    assert "#7" in why_text(7, plan, "A")


def test_raster_passes_a_forbidden_cell_and_names_the_constraint() -> None:
    src = program(
        "raster",
        constraints="constraint Hard: forbid A[2] in Set(0..7) priority 100",
        tiles=", k=1",
    )
    run = Run.from_source(src)
    res = run.run(until_stable=True, max_epochs=50)
    committed = run.engine.state["A"].committed.tolist()
    assert committed == [True, True, False, True, True, True]  # the rest is still generated
    assert res.stable and res.stop is not None
    assert res.stop.unset == {"A": {"every candidate violates `Hard`": 1}}
    assert "stable with 1 unset cell" in res.stop.message()


def test_prefix_lm_moves_past_a_cell_no_rule_fires_on() -> None:
    run = Run.from_source(program("raster", guard="t != 2", tiles=", k=1"))
    prefix(run)
    res = run.run(until_stable=True, max_epochs=50)
    assert run.engine.state["A"].committed.tolist() == [True, True, False, True, True, True]
    assert res.stop is not None and res.stop.unset == {"A": {"no rule fires there": 1}}


def test_random_schedule_passes_forbidden_cells() -> None:
    src = program(
        "random",
        constraints="constraint Hard: forbid A[1..2] in Set(0..7) priority 100",
        tiles=", k=1",
    )
    run = Run.from_source(src, seed=3)
    res = run.run(until_stable=True, max_epochs=100)
    assert run.engine.state["A"].committed.tolist() == [True, False, False, True, True, True]
    assert res.stop is not None and res.stop.unset == {"A": {"every candidate violates `Hard`": 2}}


def test_epoch_limit_reports_cells_never_opened() -> None:
    run = Run.from_source(program("raster", tiles=", k=1"))
    res = run.run(2)
    assert not res.stable and res.stop is not None and res.stop.kind == "epochs"
    assert res.stop.unset == {"A": {"never opened by the schedule": 4}}
    assert res.stop.message().startswith("epoch limit reached with 4 unset cells")


def test_a_second_run_call_continues_the_pass() -> None:
    src = program(
        "raster",
        constraints="constraint Hard: forbid A[0] in Set(0..7) priority 100",
        tiles=", k=1",
    )
    whole = Run.from_source(src)
    whole.run(5)
    split = Run.from_source(src)
    split.run(2)
    split.run(5)
    assert torch.equal(whole.payload("A"), split.payload("A"))
    assert torch.equal(whole.engine.state["A"].committed, split.engine.state["A"].committed)


# ---- the reference interpreter agrees -----------------------------------------------------------
def test_confidence_with_a_prefix_equals_reference() -> None:
    src = program("confidence", tiles=", steps=3")
    front = compile_source(src, raise_errors=False)
    run = Run(front, bindings=used(front, BINDINGS), seed=2, epochs=5)
    ref = Reference(front.ir, bindings=BINDINGS, seed=2, epochs=5)
    prefix(run, 3)
    ref.set_input("A", [1, 2, 3, None, None, None])
    for e in range(5):
        assert run.engine.step().commits == ref.step(), e
        got, want = _state(run, ref, "A")
        assert got == want, e


# ---- epoch horizons -------------------------------------------------------------------------------
def _e(op: Op, a: Expr, b: Expr) -> Expr:
    return Expr(op, (a, b))


def test_epoch_horizon_of_guards() -> None:
    e, t, c = Expr.var("e"), Expr.var("t"), Expr.const
    cells = {"t": torch.arange(8)}
    assert epoch_horizon(_e(Op.LT, t, c(3)), cells, 8) == (0, 1)  # no `e`
    assert epoch_horizon(_e(Op.GE, e, c(3)), cells, 8) == (3, 1)
    assert epoch_horizon(_e(Op.LT, e, c(5)), cells, 8) == (5, 1)
    assert epoch_horizon(_e(Op.EQ, _e(Op.MOD, e, c(2)), c(1)), cells, 8) == (0, 2)
    assert epoch_horizon(_e(Op.GE, e, _e(Op.MUL, c(2), t)), cells, 8) == (14, 1)


# ---- the stop reason in the log, the CLI and `lmpm trace` ---------------------------------------
def lmpm(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmpm.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_stop_reason_in_cli_log_and_trace(tmp_path: Path) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(
        program(
            "raster",
            constraints="constraint Hard: forbid A[2] in Set(0..7) priority 100",
            tiles=", k=1",
        )
    )
    out = tmp_path / "r"
    res = lmpm("run", str(prog), "--out", str(out), "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr  # a stable stop is a success ...
    assert "(stable with 1 unset cell)" in res.stderr  # ... that says what is missing
    assert "1 cell left unset" in res.stderr and "every candidate violates `Hard`" in res.stderr

    conn = sqlite3.connect(out / "lmpm.db")
    (stop,) = conn.execute("SELECT value FROM meta WHERE key = 'stop'").fetchone()
    conn.close()
    assert json.loads(stop) == {
        "kind": "stable",
        "epoch": 9,
        "unset": {"A": {"every candidate violates `Hard`": 1}},
        "broken": {},
    }

    shown = lmpm("trace", str(out), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "stopped after 9 epochs: stable, 1 cell left unset" in shown.stdout
    assert "A: 1 every candidate violates `Hard`" in shown.stdout
    data = json.loads(lmpm("trace", str(out), "--json", cwd=tmp_path).stdout)
    assert data["run"]["stop"]["unset"] == {"A": {"every candidate violates `Hard`": 1}}

    # A run logged before stop reasons existed (no `stop` row) still reads.
    conn = sqlite3.connect(out / "lmpm.db")
    conn.execute("DELETE FROM meta WHERE key = 'stop'")
    conn.commit()
    conn.close()
    old = lmpm("trace", str(out), cwd=tmp_path)
    assert old.returncode == 0 and "Traceback" not in old.stderr
    assert "stopped after" not in old.stdout


def test_cli_full_run_says_every_cell_set(tmp_path: Path) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(program("all", guard="e >= 2"))
    res = lmpm("run", str(prog), "--out", str(tmp_path / "r"), "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "4 epochs (stable, every cell set)" in res.stderr and "unset" not in res.stderr


# ---- property: a run reported stable commits nothing afterwards ---------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strategy=st.sampled_from(["raster", "random", "confidence", "all"]),
    guard=st.sampled_from(["", "e >= 4", "e < 2", "e % 3 == 1", "t != 3", "e >= t", "e >= 2 * t"]),
    forbid=st.sampled_from(["", "constraint Hard: forbid A[1] in Set(0..7) priority 100"]),
    k=st.integers(1, 3),
    seed=st.integers(0, 3),
)
def test_stable_run_never_commits_again(
    strategy: str, guard: str, forbid: str, k: int, seed: int
) -> None:
    tiles = {"raster": f", k={k}", "random": f", k={k}", "confidence": f", steps={k + 1}"}.get(
        strategy, ""
    )
    run = Run.from_source(program(strategy, guard, forbid, tiles), seed=seed)
    res = run.run(until_stable=True, max_epochs=200)
    if strategy == "all" and not guard.startswith("e <"):
        assert res.stable  # every cell is proposed each epoch; RandomTokens keeps the same token
    if not res.stable:
        return
    before = run.engine.state["A"].committed.clone()
    for _ in range(30):
        assert run.engine.step().commits == 0, (strategy, guard, forbid)
    assert torch.equal(run.engine.state["A"].committed, before)
    assert res.stop is not None
    assert res.stop.total_unset == int((~before).sum())


def test_resume_mid_pass_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    import lmpm

    src = program(
        "raster",
        constraints="constraint Hard: forbid A[0..1] in Set(0..7) priority 100",
        tiles=", k=1",
    )
    whole = Run.from_source(src)
    whole.run(until_stable=True, max_epochs=50)
    # stop inside a pass (epoch 2 tried cell 1 after cell 0 failed), then resume to the end
    first = lmpm.compile(text=src).runner(run_dir=tmp_path / "r", epochs=2)
    first.run(2)
    first.finish()
    again = lmpm.resume(tmp_path / "r", epochs=50)
    res = again.run(again.epochs, until_stable=True)
    again.finish()
    assert res.stable and again.engine.epoch == whole.engine.epoch
    assert torch.equal(again.payload("A"), whole.payload("A"))
    assert torch.equal(again.engine.state["A"].committed, whole.engine.state["A"].committed)
