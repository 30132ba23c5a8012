"""What a newcomer tripped on (issue 47, the smaller items): the cell story of a value no rule
proposes, a model's fault that says the run can be resumed, a resume that would run no epoch, and
`lmpm run --resume` on a workflow run's directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmpm.cli import main

PROG = """
param N = 4
value Given : Token[8] shape Seq(N)
value A : Token[8] shape Seq(N)
rule R:
  on A[t]
  emit proposal A[t] := Boom()
constraint Low: require A[t] in Set(0..3) priority 10
commit A[*] using satisfy(max_constraints_then_score)
"""

# A model that raises from epoch FAIL_AT on (the environment variable), else proposes a token.
MODULE = """
import os
import torch
import lmpm

@lmpm.bind("Boom")
def boom(inputs, *, epoch, **_):
    if epoch >= int(os.environ.get("FAIL_AT", "1000")):
        raise ValueError("the weights are missing")
    n = inputs["cells"].shape[0]
    return {"proposal": torch.full((n, 1), 1 + epoch % 2, dtype=torch.long),
            "score": torch.full((n, 1), float(epoch), dtype=torch.float64)}
"""


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, Path]:
    prog, mod, given = tmp_path / "p.lmpm", tmp_path / "boom.py", tmp_path / "given.npy"
    prog.write_text(PROG)
    mod.write_text(MODULE)
    np.save(given, np.array([1, 2, 3, 4]))
    return prog, mod, given


def _run(prog: Path, mod: Path, out: Path, *extra: str) -> int:
    return main(["run", str(prog), "--bind", str(mod), "--out", str(out), "--quiet", *extra])


def test_the_story_of_a_cell_no_rule_proposes_says_so(
    files: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, mod, given = files
    out = tmp_path / "run"
    assert _run(prog, mod, out, "--epochs", "2", "--input", f"Given={given}") == 0
    capsys.readouterr()
    assert main(["trace", str(out), "--cell", "Given[1]"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "no rule proposes `Given`" in text and "--trace cells" not in text, text
    assert main(["trace", str(out), "--cell", "Given[1]", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["proposed"] is False
    # a proposed cell of the same run still points at --trace cells
    assert main(["trace", str(out), "--cell", "A[1]"]) == 0
    assert "--trace cells" in capsys.readouterr().out


def test_a_model_fault_says_the_run_resumes_after_a_fix(
    files: tuple[Path, Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prog, mod, _ = files
    out = tmp_path / "run"
    monkeypatch.setenv("FAIL_AT", "2")
    assert _run(prog, mod, out, "--epochs", "4") == 1
    err = capsys.readouterr().err
    assert "error[R050]" in err and f"hint: epochs 0..1 are in {out}" in err, err
    assert f"`lmpm run --resume {out}` goes on from epoch 2" in err
    monkeypatch.setenv("FAIL_AT", "1000")  # fixed
    assert main(["run", "--resume", str(out), "--bind", str(mod), "--quiet"]) == 0
    monkeypatch.setenv("FAIL_AT", "0")
    assert _run(prog, mod, tmp_path / "again", "--epochs", "4") == 1
    assert "run the same command again (no epoch was committed)" in capsys.readouterr().err


def test_a_resume_at_the_epoch_limit_says_so_and_suggests_epochs(
    files: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, mod, _ = files
    out = tmp_path / "run"
    assert _run(prog, mod, out, "--epochs", "3") == 0
    resume = ["run", "--resume", str(out), "--bind", str(mod), "--quiet"]
    capsys.readouterr()
    assert main([*resume, "--disable", "Low"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "had reached its limit of 3 epochs: --disable Low would change" in err, err
    assert "nothing was changed" in err and "--epochs N with N > 3" in err
    assert main(resume) == 0
    assert "had reached its limit of 3 epochs: give --epochs N" in capsys.readouterr().err
    assert main([*resume, "--disable", "Low", "--epochs", "5"]) == 0


def test_resuming_a_workflow_run_points_at_the_vm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_newcomer import WORKFLOW

    prog, out = tmp_path / "wf.lmpm", tmp_path / "vm"
    # (the VM runs the byte model; RandomTokens gives it no logits)
    prog.write_text(WORKFLOW.replace("RandomTokens(context)", "ByteLM(context)"))
    assert main(["vm", "run", str(prog), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--epochs", "3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out} holds a workflow run (`lmpm vm run`, workflow `Hello`)" in err, err
    assert f"lmpm vm status {out}" in err and "D006" not in err
