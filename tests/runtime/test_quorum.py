"""Redundancy: `quorum(k of n, policy)`. The syntax in both parsers, the formatter and the checker;
n replicas per rule, on n different workers when the run has them; a worker whose proposals are
corrupt is outvoted (the commits are a clean run's) and named in the epoch record, the commit log
and `lmpm trace`."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lmpm.cli import main
from lmpm.errors import CheckError, UsageError
from lmpm.ir import compile_source
from lmpm.ir.printer import call_str
from lmpm.ir.serialize import from_json, to_json
from lmpm.lang.format import format_source
from lmpm.lang.parser import parse, parse_lark
from lmpm.resolve.topology import partition
from lmpm.runtime.data.group import WorkerGroup
from lmpm.runtime.data.raygroup import parse_fault
from lmpm.runtime.records import CHECKSUM_POLICIES, Dissent
from lmpm.runtime.session import Run

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


# ---- runtime: k of n in one process, on n in-process workers ------------------------------------

PROMPT = b"he"


def _prompt(tmp: Path) -> Path:
    path = tmp / "prompt.txt"
    path.write_bytes(PROMPT)
    return path


def _states(
    workers: int,
    tmp: Path,
    *,
    policy: str = "quorum(2 of 3, satisfy)",
    corrupt: int | None = None,
    epochs: int = 8,
) -> tuple[list[tuple[Tensor, ...]], list[tuple[Dissent, ...]]]:
    """Per epoch Txt's (payload, committed, clock, rule, epoch, score); each epoch's dissent."""
    driver = "process" if workers > 1 else None
    run = Run.from_source(
        _src(policy), workers=workers, driver=driver, seed=5, inputs={"Txt": _prompt(tmp)}
    )
    if corrupt is not None:
        run.dataplane.inject(corrupt, "propose", 2, "corrupt")
    states, dissent = [], []
    for _ in range(epochs):
        rec = run.engine.step()
        st = run.engine.state["Txt"]
        states.append(
            tuple(t.clone() for t in (st.committed, st.clock, st.rule, st.epoch, st.score))
        )
        states[-1] = (run.payload("Txt"), *states[-1])
        dissent.append(rec.dissent)
    return states, dissent


def _same(a: list[tuple[Tensor, ...]], b: list[tuple[Tensor, ...]]) -> None:
    for e, (x, y) in enumerate(zip(a, b, strict=True)):
        for field, u, v in zip(("payload", "committed", "clock", "rule", "epoch"), x, y):
            assert torch.equal(u, v), f"epoch {e} {field}"
        # ByteLM's scores are batched float math: a worker scoring one replica rounds differently
        assert torch.allclose(x[5], y[5], rtol=1e-5, atol=1e-6), f"epoch {e} score"


def test_k_of_n_on_one_worker_and_on_n_workers_commit_the_same(tmp_path: Path) -> None:
    one, quiet = _states(1, tmp_path)
    assert int(one[-1][1].sum()) == 10, "the run fills Txt (N = 10)"
    assert all(d == () for d in quiet), "a deterministic model's replicas agree"
    for workers in (3, 4):
        many, d = _states(workers, tmp_path)
        _same(one, many)
        assert all(x == () for x in d)


def test_quorum_k_keeps_its_replicas_on_the_owner(tmp_path: Path) -> None:
    """quorum(k) runs k replicas where the cell lives, any worker count (2 < 3 is fine)."""
    one, _ = _states(1, tmp_path, policy="quorum(3, satisfy)")
    two, _ = _states(2, tmp_path, policy="quorum(3, satisfy)")
    _same(one, two)
    plan = Run.from_source(_src("quorum(3, satisfy)")).plan
    assert partition(plan, 2).spread == {} and plan.rules[0].replicas == 3


def test_a_corrupt_worker_is_outvoted_and_named(tmp_path: Path) -> None:
    clean, _ = _states(1, tmp_path)
    for worker in (0, 1):
        bad, dissent = _states(3, tmp_path, corrupt=worker)
        _same(clean, bad)
        assert all(d == () for d in dissent[:2]), "clean before epoch 2"
        for e, d in enumerate(dissent[2:], start=2):
            committed = int(clean[e][1].sum() - clean[e - 1][1].sum())
            assert d == ((Dissent("Txt", worker, f"w{worker}", committed),) if committed else ())


def test_fewer_workers_than_replicas_is_refused() -> None:
    plan = Run.from_source(_src("quorum(2 of 3, satisfy)")).plan
    with pytest.raises(UsageError) as e:
        partition(plan, 2)
    assert e.value.code == "U086" and "--workers 3" in (e.value.hint or "")
    topo = partition(plan, 4)
    assert topo.spread == {"Txt": 3} and topo.replicated["Txt"]
    assert {k for k in topo.routes if k[0] == "Txt"} == {
        ("Txt", q, r) for q in range(3) for r in range(4) if q != r
    }
    assert partition(plan, 1).spread == {}
    with pytest.raises(UsageError) as e:
        Run.from_source(_src("quorum(2 of 3, satisfy)"), workers=2, driver="process")
    assert e.value.code == "U086"


def test_in_process_injection_refuses_what_needs_processes() -> None:
    run = Run.from_source(_src("quorum(2 of 3, satisfy)"), workers=3, driver="process")
    for args, code in [((1, "propose", 0, "kill"), "U088"), ((1, "apply", 0, "corrupt"), "U084")]:
        with pytest.raises(UsageError) as e:
            run.dataplane.inject(*args)
        assert e.value.code == code
    assert parse_fault("w1:propose:2:corrupt", 3) == (1, "propose", 2, "corrupt")
    with pytest.raises(UsageError):
        parse_fault("w1:apply:2:corrupt", 3)


def test_resume_a_spread_quorum_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker's store keeps the spread value whole (each writes only the cells its replica
    won; with w0 corrupt, w1 writes them): a run resumed from the shards ends as the uninterrupted
    run and as the clean run. A log without the dissent table (written before it existed) still
    reads and resumes."""
    prog = tmp_path / "q.lmpm"
    prog.write_text(_src("quorum(2 of 3, satisfy)"))
    common = ["run", str(prog), "--input", f"Txt={_prompt(tmp_path)}", "--seed", "4", "--quiet"]
    assert main([*common, "--epochs", "8", "--out", str(tmp_path / "clean")]) == 0
    common += ["--workers", "3", "--driver", "process", "--checkpoint-every", "3"]
    monkeypatch.setenv("LMPM_INJECT_FAULT", "w0:propose:1:corrupt")
    assert main([*common, "--epochs", "8", "--out", str(tmp_path / "ref")]) == 0
    assert main([*common, "--epochs", "5", "--out", str(tmp_path / "r")]) == 0
    conn = sqlite3.connect(tmp_path / "r" / "lmpm.db")  # as a log written before dissent was
    conn.execute("DROP TABLE quorum_dissent")
    conn.commit()
    conn.close()
    assert main(["trace", str(tmp_path / "r")]) == 0
    resume = ["run", "--resume", str(tmp_path / "r"), "--epochs", "8", "--quiet"]
    assert main([*resume, "--workers", "3", "--driver", "process"]) == 0
    assert _commits(tmp_path / "r") == _commits(tmp_path / "ref") == _commits(tmp_path / "clean")
    txt = [(tmp_path / d / "Txt.npy").read_bytes() for d in ("r", "ref", "clean")]
    assert txt[0] == txt[1] == txt[2]
    conn = sqlite3.connect(tmp_path / "r" / "lmpm.db")
    try:  # the resume made the table again, for the epochs it ran
        rows = conn.execute("SELECT epoch, worker FROM quorum_dissent").fetchall()
    finally:
        conn.close()
    assert rows == [(e, "w0") for e in range(5, 8)]
    for store in ("w0", "w1", "w2"):  # each store holds every committed cell of Txt
        conn = sqlite3.connect(tmp_path / "ref" / "payload" / f"{store}.db")
        try:
            got = conn.execute("SELECT sum(count) FROM rows WHERE value = 'Txt'").fetchone()
        finally:
            conn.close()
        assert got == (8,), store


COMMITS = (
    "SELECT epoch, value, first, last, step, count, rule, clock_min, clock_max, crc, sums "
    "FROM commits ORDER BY epoch, value, first"
)


def _commits(run_dir: Path) -> list[tuple[object, ...]]:
    """The log's commit rows, with those the owners wrote into the workers' stores."""
    from lmpm.runtime.rundir import connect

    conn = connect(run_dir)
    try:
        return conn.execute(COMMITS).fetchall()
    finally:
        conn.close()


# ---- Ray: 3 worker processes, one corrupt, one killed -------------------------------------------


def test_ray_corrupt_worker_is_outvoted_logged_and_traced(
    local_ray: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """quorum(2 of 3) on 3 Ray workers, w1 corrupt from epoch 2 and w2 killed while applying
    epoch 4: the commits are the clean one-worker run's; the log and `lmpm trace` name w1."""
    prog = tmp_path / "q.lmpm"
    prog.write_text(_src("quorum(2 of 3, satisfy)"))
    common = ["run", str(prog), "--input", f"Txt={_prompt(tmp_path)}", "--seed", "4"]
    common += ["--epochs", "8", "--checkpoint-every", "3", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    monkeypatch.setenv("LMPM_INJECT_FAULT", "w1:propose:2:corrupt,w2:apply:4")
    assert main([*common, "--workers", "3", "--out", str(tmp_path / "three")]) == 0
    monkeypatch.delenv("LMPM_INJECT_FAULT")
    assert _commits(tmp_path / "three") == _commits(tmp_path / "one")
    one, three = (tmp_path / d / "Txt.npy" for d in ("one", "three"))
    assert three.read_bytes() == one.read_bytes()
    conn = sqlite3.connect(tmp_path / "three" / "lmpm.db")
    try:
        dissent = conn.execute("SELECT epoch, value, replica, worker, cells FROM quorum_dissent")
        rows = dissent.fetchall()
        faults = conn.execute("SELECT epoch, worker, cause FROM worker_faults").fetchall()
    finally:
        conn.close()
    assert rows == [(e, "Txt", 1, "w1", 1) for e in range(2, 8)]
    assert (4, "w2", "died") in faults
    conn = sqlite3.connect(tmp_path / "one" / "lmpm.db")
    try:
        assert conn.execute("SELECT count(*) FROM quorum_dissent").fetchone() == (0,)
    finally:
        conn.close()
    capsys.readouterr()
    assert main(["trace", str(tmp_path / "three")]) == 0
    out = capsys.readouterr().out
    assert "quorum replicas outvoted" in out
    assert "Txt replica 1 on worker w1: 6 cells in 6 epochs (epochs 2..7)" in out


CHAIN = """\
param N = 12
value Txt : Token[Byte] shape Seq(N) clock Lamport
value Up : Token[Byte] shape Seq(N) clock Lamport
value Low : Token[Byte] shape Seq(N) clock Lamport
visible Txt[t] <- Txt[0..t-1] when t > 0
visible Up[t] <- Txt[t-2..t]
visible Low[t] <- Up[t-1..t]

rule NextByte:
  on Txt[t]
  read {context = Txt[0..t-1]}
  emit proposal Txt[t] := ByteLM(context, k=2, pick="top")

rule Echo:
  on Up[t]
  read {context = Txt[t-2..t]}
  emit proposal Up[t] := ByteLM(context, k=1, pick="top")

rule Echo2:
  on Low[t]
  read {context = Up[t-1..t]}
  emit proposal Low[t] := ByteLM(context, k=1, pick="top")

commit Txt[*] using satisfy
commit Up[*] using quorum(2 of 3, satisfy)
commit Low[*] using satisfy
"""


def _chain(workers: int, corrupt: int | None = None) -> tuple[list[list[Tensor]], list[Any]]:
    run = Run.from_source(CHAIN, seed=2)
    if workers:
        topo = partition(run.plan, workers, replicate_bytes=0)
        group = WorkerGroup(
            run.plan, workers, topology=topo, seed=2, checksum_policies=CHECKSUM_POLICIES
        )
        run.engine.dataplane = run.dataplane = group
        if corrupt is not None:
            group.inject(corrupt, "propose", 0)
    run.set_input("Txt", torch.tensor([104, 101] + [0] * 10), torch.arange(12) < 2)
    payloads, dissent = [], []
    for _ in range(4):
        dissent.append(run.engine.step().dissent)
        payloads.append([run.payload(v).clone() for v in ("Txt", "Up", "Low")])
    return payloads, dissent


def test_a_spread_value_reads_replicated_sources_and_only_it_is_protected() -> None:
    """The values a spread quorum value reads are replicated (any worker computes any replica);
    values read by it stay partitioned. A corrupt worker spoils what it alone proposes (its cells
    of a partitioned value) and is outvoted in the quorum value."""
    plan = Run.from_source(CHAIN).plan
    topo = partition(plan, 4, replicate_bytes=0)
    assert topo.replicated["Txt"] and topo.replicated["Up"] and not topo.replicated["Low"]
    assert topo.spread == {"Up": 3}
    one, _ = _chain(0)
    four, quiet = _chain(4)
    assert all(torch.equal(x, y) for a, b in zip(one, four) for x, y in zip(a, b))
    assert quiet == [(), (), (), ()]
    bad, dissent = _chain(4, corrupt=2)
    for a, b in zip(one, bad, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # Txt (w0) and Up (quorum)
    assert not torch.equal(one[-1][2], bad[-1][2]), "w2's cells of Low are corrupt"
    assert dissent[0] == (Dissent("Up", 2, "w2", 12),)


TWO_RULES = _src("quorum(2 of 3, satisfy)").replace(
    """rule NextByte:
  on Txt[t]
""",
    """rule Even:
  on Txt[t] when t % 2 == 0
  read {context = Txt[0..t-1]}
  emit proposal Txt[t] := ByteLM(context, k=2, pick="top")

rule NextByte:
  on Txt[t]
""",
)


def test_trace_cells_of_a_spread_value_show_every_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each replica worker records its candidates under the merged columns: `lmpm trace --cell`
    of a 3-worker run shows what the one-worker run shows (two rules, 3 replicas of 2 proposals each)."""
    prog = tmp_path / "q.lmpm"
    prog.write_text(TWO_RULES)
    common = ["run", str(prog), "--input", f"Txt={_prompt(tmp_path)}", "--seed", "4", "--quiet"]
    common += ["--epochs", "5", "--trace", "cells"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert (
        main([*common, "--workers", "3", "--driver", "process", "--out", str(tmp_path / "3")]) == 0
    )
    assert _commits(tmp_path / "3") == _commits(tmp_path / "one")
    shown = []
    for d in ("one", "3"):
        capsys.readouterr()
        assert main(["trace", str(tmp_path / d), "--cell", "Txt[4]"]) == 0
        shown.append(capsys.readouterr().out)
    assert shown[0] == shown[1]
    candidates = shown[1].split("candidate")[-1]
    assert candidates.count(" Even ") == 6 and candidates.count(" NextByte ") == 6
    assert candidates.count(" unset ") == 1, "only keep current (the cell was unset)"


DISAGREE = """\
value Seq1 : Token[4] shape Seq(2)
rule R:
  on Seq1[t]
  emit proposal Seq1[t] := Flip()
constraint NotThree: forbid Seq1[t] in Set(3) priority 10
commit Seq1[*] using quorum(2 of 2, satisfy)
"""

FLIP = """\
import torch
import lmpm

CALLS = [0]

@lmpm.bind("Flip")
def flip(inputs, **_):
    # the two replicas (two workers of this process) are called one after the other: 3, then 1
    CALLS[0] += 1
    n = inputs["cells"].shape[0]
    token = 3 if CALLS[0] % 2 else 1
    return {"proposal": torch.full((n, 1), token, dtype=torch.long),
            "score": torch.zeros(n, 1, dtype=torch.float64)}
"""


def test_a_quorum_that_disagrees_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 47: replicas proposing 3 and 1 under quorum(2 of 2) left the cells unset with the
    warning "every candidate violates `NotThree`" and a cell story of a constraint's decision;
    the reason is the quorum's disagreement, in the warning, the trace summary and the story."""
    prog, mod, out = tmp_path / "q.lmpm", tmp_path / "flip.py", tmp_path / "run"
    prog.write_text(DISAGREE)
    mod.write_text(FLIP)
    argv = ["run", str(prog), "--bind", str(mod), "--epochs", "2", "--out", str(out)]
    argv += ["--workers", "2", "--driver", "process", "--trace", "cells", "--quiet"]
    assert main(argv) == 0
    err = " ".join(capsys.readouterr().err.split())
    said = "Seq1: 2 the quorum's replicas disagreed (no payload had the votes quorum(2 of 2, "
    assert said in err and "violates" not in err, err
    assert main(["trace", str(out)]) == 0
    summary = " ".join(capsys.readouterr().out.split())
    assert said in summary and "0 decisions were decided by a constraint" in summary, summary
    assert main(["trace", str(out), "--cell", "Seq1[0]"]) == 0
    story = " ".join(capsys.readouterr().out.split())
    assert "epoch 0: the quorum's replicas disagreed (3, 1): no payload was proposed by 2" in story
    assert "violates NotThree" not in story, story
