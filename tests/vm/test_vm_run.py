"""WorkflowRun: the VM as the commit engine of its value, with the program's model (ByteLM), its
constraints, the counter-based RNG, the commit log, `lmpm trace` and `lmpm vm`."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lmpm.errors import ModelError
from lmpm.ir import compile_source
from lmpm.vm import GENERATED, WorkflowRun

sys.path.insert(0, str(Path(__file__).parent))
from vm_helpers import program

ROOT = Path(__file__).resolve().parents[2]

ZONES = """  zone thing:
    feed "a "
    generate max 6
    until " "
    capture colour
  zone way:
    feed "moves "
    generate max 5 in Set("leftrighupdown ")
    until "left"
    until "right"
    until "up"
    until "down"
    until " " jump way limit 1
    capture way
  zone sky:
    feed " under a "
    generate max 4
    capture sky
    call Count(sky)
"""
PLAIN = "constraint Plain:\n  require Txt[b, t] in Set(32..126) priority 10\n"


def count(calls: list[list[Any]]) -> list[str]:
    return [f" ({len(a[0])})" for a in calls]


def make(size: int, **kw: Any) -> WorkflowRun:
    ir = compile_source(program(ZONES, size, 48, extra=PLAIN)).ir
    return WorkflowRun(ir, tools={"Count": count}, **kw)


def test_model_asked_only_for_generating_streams_and_constraints_hold() -> None:
    run = make(4, seed=3)
    vm = run.run()
    assert vm.done
    st = run.stats
    kinds = vm.status["kind"]
    assert st.asked == int((kinds == GENERATED).sum())
    assert st.forced + st.asked == st.committed == int((vm.raw_stream >= 0).sum())
    assert st.steps_all_forced > 0  # steps where every stream was forced: no forward at all
    gen = vm.raw_stream[kinds == GENERATED]
    assert bool(((gen >= 32) & (gen <= 126)).all())  # Plain masks the sampler
    way = vm.raw_stream[(kinds == GENERATED) & (vm.status["zone"] == 1)]
    assert set(bytes(way.tolist()).decode()) <= set("leftrighupdown ")
    for caps, text in zip(vm.extract(), vm.generative_sequence()):
        assert text.startswith("a " + caps["colour"] + "moves ")
        assert f" ({len(caps['sky'])})" in text


def test_a_proposer_without_logits_is_a_coded_error() -> None:
    """RandomTokens proposes tokens; the VM samples from logits: R157 naming the model (issue 44:
    it was KeyError 'logits', an internal error)."""
    src = program(ZONES, 2, 48).replace("ByteLM(context)", "RandomTokens(context, k=2)")
    run = WorkflowRun(compile_source(src).ir, tools={"Count": count})
    with pytest.raises(ModelError) as err:
        run.run()
    assert err.value.code == "R157" and "`RandomTokens` returned proposal, score" in str(err.value)


def test_identical_results_for_any_batch_split() -> None:
    whole = make(4, seed=11).run()
    parts = [make(2, seed=11, stream_offset=k).run() for k in (0, 2)]
    assert (
        whole.generative_sequence()
        == parts[0].generative_sequence() + parts[1].generative_sequence()
    )
    assert whole.extract() == parts[0].extract() + parts[1].extract()
    assert torch.equal(whole.raw_stream, torch.cat([p.raw_stream for p in parts]))


def test_commit_log_trace_and_vm_status(tmp_path: Path) -> None:
    run = make(3, seed=5, run_dir=tmp_path / "run", source=program(ZONES, 3, 48, extra=PLAIN))
    vm = run.run()
    db = sqlite3.connect(tmp_path / "run" / "lmpm.db")
    epochs = db.execute("SELECT count(*), sum(commits), sum(attempts) FROM epochs").fetchone()
    assert epochs == (run.stats.steps, run.stats.committed, run.stats.asked)
    rules = dict(db.execute("SELECT rule, sum(count) FROM commits GROUP BY rule").fetchall())
    assert rules[-3] + rules.get(-4, 0) == run.stats.forced and rules[0] == run.stats.asked
    checked = db.execute("SELECT sum(checked), sum(violations) FROM trace_summary").fetchone()
    assert checked == (run.stats.committed, 0)
    n = db.execute("SELECT count(*) FROM vm_tokens WHERE stream = 1").fetchone()[0]
    assert n == int((vm.raw_stream[1] >= 0).sum())
    db.close()
    lmpm = [sys.executable, "-m", "lmpm.cli"]
    out = subprocess.run(
        [*lmpm, "vm", "status", str(tmp_path / "run"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rep = json.loads(out)
    assert [s["decisions"] for s in rep["streams"]] == vm.decisions()
    out = subprocess.run(
        [*lmpm, "vm", "status", str(tmp_path / "run"), "--stream", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "generated" in out and "forced" in out and "tool" in out
    out = subprocess.run(
        [*lmpm, "trace", str(tmp_path / "run")], capture_output=True, text=True, check=True
    ).stdout
    assert "Plain" in out


def test_forced_tokens_violating_a_constraint_are_counted(tmp_path: Path) -> None:
    zones = '  zone a:\n    feed "AB"\n    generate max 2\n'
    extra = "constraint Lower:\n  require Txt[b, t] in Set(97..122) priority 1\n"
    ir = compile_source(program(zones, 2, 16, extra=extra)).ir
    run = WorkflowRun(ir, run_dir=tmp_path / "r")
    vm = run.run()
    assert all(t[2:].islower() for t in vm.generative_sequence())
    db = sqlite3.connect(tmp_path / "r" / "lmpm.db")
    assert db.execute("SELECT sum(violations) FROM trace_summary").fetchone()[0] == 4
    db.close()


def test_cli_run_example_small(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmpm.cli",
            "vm",
            "run",
            str(ROOT / "examples" / "vm.lmpm"),
            "--bind",
            str(ROOT / "examples" / "vm" / "tools.py"),
            "--set",
            "B=2",
            "--out",
            str(tmp_path / "vm"),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rep = json.loads(res.stdout)
    assert len(rep["streams"]) == 2 and all(s["status"] == "done" for s in rep["streams"])
    assert all(s["text"].startswith("a ") and "words)" in s["text"] for s in rep["streams"])
