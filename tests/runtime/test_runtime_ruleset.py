"""RuleSet: constraints enabled/disabled between epochs by committed events (API, CLI on resume),
logged per epoch, shown by `lmpm trace`, restored exactly by resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lmpm
from lmpm.cli import main
from lmpm.errors import UsageError
from lmpm.runtime.protocol import ProposeRequest
from lmpm.runtime.session import Run

PROG = """param N = 6
value Txt : Token[Byte] shape Seq(N)
value RuleSet : Rule shape Set()
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Gen:
  on Txt[t]
  read {ctx = Txt[0..t-1]}
  emit proposal Txt[t] := Uniform(ctx, k=2)
constraint Lower: require Txt[t] in Set(97..122) priority 10
constraint Never: forbid Txt[t] in Set(0..255) priority 50
"""


def _commits(run: Run, epochs: int) -> list[int]:
    return [r.commits for r in run.run(epochs).records]


def test_disabling_a_forbid_lets_cells_commit() -> None:
    run = lmpm.compile(text=PROG).runner(seed=3, keep_records=True)
    assert _commits(run, 3) == [0, 0, 0]  # Never forbids every payload
    assert run.active_constraints == ["Lower", "Never"]
    run.disable("Never")
    assert run.active_constraints == ["Lower"]
    assert sum(_commits(run, 6)) > 0
    run.enable("Never")
    assert run.active_constraints == ["Lower", "Never"]


def test_unchanged_ruleset_sends_no_active_set() -> None:
    run = lmpm.compile(text=PROG).runner(seed=3)
    seen: list[frozenset[int] | None] = []
    propose = run.dataplane.propose

    def spy(req: ProposeRequest):  # type: ignore[no-untyped-def]
        seen.append(req.active)
        return propose(req)

    run.dataplane.propose = spy  # type: ignore[method-assign]
    run.run(2)
    run.disable("Lower")
    run.run(3)
    run.enable("Lower")
    run.run(4)
    never = next(cp.id for cp in run.plan.constraints if cp.name == "Never")
    assert seen == [None, None, frozenset({never}), None]


def test_unknown_constraint_names_list_the_declared_ones() -> None:
    run = lmpm.compile(text=PROG).runner(seed=3)
    with pytest.raises(UsageError) as e:
        run.disable("Nevr")
    assert e.value.code == "U075" and "Lower, Never" in e.value.message
    assert run.active_constraints == ["Lower", "Never"]


def test_log_trace_and_resume_keep_the_ruleset(tmp_path: Path) -> None:
    from lmpm.runtime.control.trace import report
    from lmpm.runtime.rundir import connect

    d = tmp_path / "r"
    run = lmpm.compile(text=PROG).runner(run_dir=d, seed=3)
    run.run(3)
    run.disable("Never")
    run.run(5)
    run.finish()
    conn = connect(d)
    try:
        changes = report(conn, d)["ruleset"]
    finally:
        conn.close()
    assert [(c["epoch"], c["change"], c["constraint"], c["by"], c["active"]) for c in changes] == [
        (3, "removed", "Never", "api", ["Lower"])
    ]
    again = lmpm.resume(d, epochs=8)
    assert again.active_constraints == ["Lower"]
    again.run(again.epochs)
    again.finish()
    whole = lmpm.compile(text=PROG).runner(seed=3)
    whole.run(3)
    whole.disable("Never")
    whole.run(8)
    assert (again.outputs()["Txt"] == whole.outputs()["Txt"]).all()


def test_cli_resume_disables_and_trace_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROG)
    d = tmp_path / "r"
    assert main(["run", str(prog), "--out", str(d), "--epochs", "2", "--seed", "3", "--quiet"]) == 0
    assert main(["run", "--resume", str(d), "--disable", "Nevr", "--epochs", "4"]) == 2
    assert "Lower, Never" in capsys.readouterr().err
    assert main(["run", "--resume", str(d), "--disable", "Never", "--epochs", "4", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["trace", str(d)]) == 0
    assert "epoch 2: removed Never by cli" in capsys.readouterr().out
    assert main(["trace", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ruleset"][0]["active"] == ["Lower"]
    assert rep["run"]["commits"] > 0
    assert main(["run", str(prog), "--out", str(tmp_path / "x"), "--disable", "Never"]) == 2
