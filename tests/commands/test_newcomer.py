"""What a newcomer tripped on (issue 35): silent wrong runs, misleading summaries, stop reasons.

Each test runs what a user runs — the `lmpm` command in a subprocess, or the Python API — and
checks what they are told.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmpm.errors import UsageError
from lmpm.runtime.session import Run

ROOT = Path(__file__).resolve().parents[2]


def lmpm(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmpm", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


WORKFLOW = """
param B = 2
param N = 8
value Txt : Token[Byte] shape Grid2D(B, N)
visible Txt[b, t] <- Txt[b, 0..t-1] when t > 0
rule Write:
  on Txt[b, t]
  read {context = Txt[b, 0..t-1]}
  emit proposal Txt[b, t] := RandomTokens(context)
workflow Hello on Txt:
  zone greet:
    feed "hi "
    generate max 4
"""


def test_run_refuses_a_workflow_at_its_line_and_names_the_command(tmp_path: Path) -> None:
    prog = tmp_path / "wf.lmpm"
    prog.write_text(WORKFLOW)
    res = lmpm("run", str(prog), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert f"{prog}:10:1: error[U105]" in res.stderr  # file:line:col of `workflow Hello`
    assert "workflow Hello on Txt:" in res.stderr and "^^^" in res.stderr  # the line, a caret
    assert f"lmpm vm run {prog}" in res.stderr
    assert not (tmp_path / "out").exists()  # nothing run, nothing written


def test_the_python_api_refuses_a_workflow_too() -> None:
    with pytest.raises(UsageError) as info:
        Run.from_source(WORKFLOW, "wf.lmpm")
    assert info.value.code == "U105" and info.value.span is not None
    assert info.value.span.line == 10


RULESET = """
param N = 4
value A : Token[8] shape Seq(N)
value {set} : {kind} shape Set()
rule R:
  on A[t]
  emit proposal A[t] := Uniform()
commit A[*] using satisfy(max_constraints_then_score)
rule Rules:
  on {set}
  emit proposal {set} := Uniform()
"""


def test_a_rule_on_the_ruleset_is_a_check_error(tmp_path: Path) -> None:
    prog = tmp_path / "rs.lmpm"
    prog.write_text(RULESET.format(set="RuleSet", kind="Rule"))
    res = lmpm("check", str(prog), cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"{prog}:9:1: error[E214]" in res.stderr and "--disable" in res.stderr


def test_a_model_as_a_schedule_is_a_check_error_not_a_python_message(tmp_path: Path) -> None:
    prog = tmp_path / "mp.lmpm"
    prog.write_text(RULESET.format(set="MaskPlan", kind="Event"))
    res = lmpm("check", str(prog), cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    assert f"{prog}:11:29: error[E212]: `Uniform` is a model, not a schedule" in res.stderr
    assert "missing 1 required positional argument" not in res.stderr


MASKGIT = """
param N = 16
value A : Token[8] shape Seq(N)
value MaskPlan : Event shape Set()
visible A[t] <- A[*]
rule R:
  on A[t]
  read {ctx = A[*]}
  emit proposal A[t] := RandomTokens(ctx)
commit A[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="confidence"STEPS)
"""


def test_a_default_confidence_run_sets_every_cell(tmp_path: Path) -> None:
    prog = tmp_path / "maskgit.lmpm"
    prog.write_text(MASKGIT.replace("STEPS", ""))
    res = lmpm("run", str(prog), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "(stable, every cell set), 16 commits" in res.stderr


def test_cells_the_quota_holds_back_say_so() -> None:
    run = Run.from_source(MASKGIT.replace("STEPS", ", steps=16"), epochs=4)
    res = run.run(4)
    assert res.stop is not None and res.stop.kind == "epochs"
    assert res.stop.unset == {
        "A": {"held back by the schedule's quota (steps=16: every cell within 16 epochs)": 12}
    }
    assert res.commits == 4  # one a step while the cosine rounds below one cell


def test_a_value_no_rule_proposes_is_not_every_cell_set(tmp_path: Path) -> None:
    prog = tmp_path / "norule.lmpm"
    prog.write_text(
        "param N = 4\nvalue A : Token[8] shape Seq(N)\nvalue B : Token[8] shape Seq(N)\n"
        "rule R:\n  on A[t]\n  emit proposal A[t] := Uniform()\n"
        "commit A[*] using satisfy(max_constraints_then_score)\n"
    )
    res = lmpm("run", str(prog), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "every cell set" not in res.stderr
    assert "(stable with 4 unset cells)" in res.stderr
    assert "B: 4 no rule proposes it and no input gave it" in res.stderr


def test_vm_run_binds_its_tool_without_w210_and_trace_counts_forced_tokens(
    tmp_path: Path,
) -> None:
    out = tmp_path / "vm"
    res = lmpm(
        "vm", "run", "examples/vm.lmpm", "--set", "B=4", "--bind", "examples/vm/tools.py",
        "--out", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "W210" not in res.stderr  # `Count` is bound by the --bind module it names
    trace = lmpm("trace", str(out))
    assert trace.returncode == 0, trace.stderr
    head = " ".join(trace.stdout.split("\n")[:2])
    assert "1 worker " in head and "forced or tool tokens, no model asked" in head
    run = json.loads(lmpm("trace", str(out), "--json").stdout)["run"]
    assert run["workers"] == 1
    assert run["commits"] - run["unattempted"] <= run["attempts"]  # the rest came from attempts


def test_trace_says_how_many_workers_ran(tmp_path: Path) -> None:
    out = tmp_path / "g"
    res = lmpm(
        "run", "examples/latent.lmpm", "--input", "Z=examples/latent/z0.npy", "--epochs", "2",
        "--workers", "2", "--driver", "process", "--out", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    trace = lmpm("trace", str(out))
    assert "2 workers" in trace.stdout.split("\n")[0]


def test_compile_cost_splits_compiling_from_running() -> None:
    from lmpm.commands.run import MSG_COMPILE_COST, compile_cost

    # a short run: the first epoch compiled for 6 s, the 39 others took 10 ms each
    cost = compile_cost([6.01] + [0.01] * 39)
    assert round(cost.compile_seconds, 6) == 6.0 and round(cost.run_seconds, 6) == 0.4
    assert cost.not_worth_it
    text = cost.note()
    assert "took 6.0 s beyond the steady epoch time" in text
    assert "more than the 40 epochs it served (0.4 s after compiling)" in text
    assert "quicker without --compile" in text and "a second run loads" in text
    assert "{" not in MSG_COMPILE_COST.format(**cost._asdict(), cached="", again="")
    # a long run: the same compile is a small part of 4,000 epochs of 10 ms
    assert not compile_cost([6.01] + [0.01] * 3999).not_worth_it


def test_the_compile_note_agrees_with_the_summary_on_a_cached_run() -> None:
    """Issue 47: a run whose one graph came from the cache was told "compiling took 5.7 s" after
    a summary of 0.5 s, and to do what it had just done (reuse the cache)."""
    from lmpm.commands.run import compile_cost

    cost = compile_cost([5.71] + [0.01] * 9, graph_seconds=0.5, graphs=1, cache_hits=1)
    text = cost.note()
    assert (
        "5.7 s beyond the steady epoch time (0.5 s of it building the step's graphs, every "
        "graph from the cache;" in text
    ), text
    assert "second run" not in text
    # the excess is never below the graphs' own time (the summary's figure is part of it)
    assert compile_cost([0.2, 0.2, 0.2], graph_seconds=0.5).compile_seconds == 0.5


@pytest.mark.slow
def test_a_short_compiled_run_says_compiling_did_not_pay(tmp_path: Path) -> None:
    res = lmpm(
        "run", "examples/text.lmpm", "--input", "Txt=examples/text/prompt.txt", "--compile",
        "--out", str(tmp_path / "t"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "attempts/s after compiling" in res.stderr
    assert "this run is quicker without --compile" in res.stderr


def _norms(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    z = np.load(run_dir / "Z.npy")
    z0 = np.load(ROOT / "examples" / "latent" / "z0.npy")
    return np.linalg.norm(z, axis=-1), np.abs(z - z0).sum(axis=-1) > 0


def test_a_hard_norm_bound_is_never_broken_by_a_commit(tmp_path: Path) -> None:
    src = (ROOT / "examples" / "latent.lmpm").read_text()
    soft_line = "  require NormAtMost(Z[x, y], R) priority 10\n"
    assert soft_line in src
    hard = tmp_path / "hard.lmpm"
    hard.write_text(src.replace(soft_line, soft_line.rstrip("\n") + " hard\n"))
    soft = tmp_path / "soft.lmpm"
    soft.write_text(src)
    for prog in (soft, hard):
        res = lmpm(
            "run", str(prog), "--input", "Z=examples/latent/z0.npy", "--epochs", "2",
            "--set", "R=1", "--out", str(tmp_path / prog.stem), "--quiet",
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
    norm, changed = _norms(tmp_path / "soft")
    assert (changed & (norm > 1.0)).any()  # soft: a violating candidate wins on score
    norm, changed = _norms(tmp_path / "hard")
    assert changed.any() and not (changed & (norm > 1.0 + 1e-6)).any()  # hard: never


def test_hard_on_a_proved_constraint_is_a_located_error(tmp_path: Path) -> None:
    prog = tmp_path / "h.lmpm"
    prog.write_text(
        "param N = 4\nvalue A : Token[8] shape Seq(N)\nvisible A[t] <- A[0..t-1] when t > 0\n"
        "constraint C: forbid read_future(A[t]) priority 10 hard\n"
    )
    res = lmpm("check", str(prog), cwd=tmp_path)
    assert res.returncode == 1 and f"{prog}:4:1: error[E118]" in res.stderr


def _readme_quick_start() -> list[str]:
    """The README's first `lmpm run` of the quick start, as words."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    line = next(ln for ln in block.replace("\\\n", " ").splitlines() if ln.startswith("lmpm run"))
    return line.split("#", 1)[0].split()


def test_the_readme_quick_start_shows_constraints_deciding_cells(tmp_path: Path) -> None:
    words = _readme_quick_start()
    assert words[:3] == ["lmpm", "run", "examples/video.lmpm"]
    out = words.index("--out")
    words[out + 1] = str(tmp_path / "video")
    res = lmpm(*words[1:])
    assert res.returncode == 0, res.stderr
    rep = json.loads(lmpm("trace", str(tmp_path / "video"), "--json").stdout)
    won = {c["name"]: c["won"] for c in rep["constraints"]}
    assert won["HardLock"] > 0 and won["TextPaint"] > 0  # both visibly decide cells
    # ... and the numbers the README tells a newcomer to look for are this run's
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"`{rep['run']['decided']} decisions were decided" in readme
    assert (
        f"`HardLock` {won['HardLock']} (" in readme
        and f"`TextPaint` {won['TextPaint']} (" in readme
    )
