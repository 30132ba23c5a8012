"""A newcomer's own models, scores, predicates and bind modules: when they fail, the error points
at the program's call (file:line:col) and at the line of the user's module that raised; a bind file
may import its sibling modules; `lmpm trace` of a failed run says why it failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmpm.cli import main

PROG = """param N = 6
value G : Token[4] shape Seq(N)
visible G[t] <- G[t-1..t+1]
rule Grow:
  on G[t]
  read {nb = G[t-1..t+1]}
  emit proposal G[t] := Net(nb)
  score NetScore(...)
constraint Calm:
  forbid Jump(G[t], G[t-1..t+1]) priority 10
commit G[*] using satisfy(max_constraints_then_score)
"""

MODELS = """import torch
import lmpm
from helpers import offset  # a sibling module of this file


def _feats(inputs):
    return inputs[WHICH]  # the line the errors name


WHICH = "nb"


@lmpm.bind("Net")
def net(inputs, *, vocab, epoch, seed, **kw):
    x = _feats(inputs) if FAIL == "model" else inputs["nb"]
    n = x.shape[0]
    return {"proposal": (torch.arange(2).repeat(n, 1) + offset()) % vocab,
            "score": torch.zeros(n, 2)}


@lmpm.bind("NetScore")
def net_score(inputs, *, epoch):
    if FAIL == "score":
        _feats(inputs)
    return torch.zeros(inputs["proposal"].shape[:2])


@lmpm.bind("Jump")
def jump(ctx):
    near = ctx.accesses[0]  # named fields: payload, mask, cells
    if FAIL == "predicate":
        _feats({})
    far = (ctx.candidates[:, :, None] - near.payload[:, None, :]).abs() > 2
    return (far & near.mask[:, None, :]).any(dim=2)


FAIL = None
"""


def _write(tmp: Path, fail: str | None, which: str = "nb") -> tuple[Path, Path]:
    (tmp / "prog.lmpm").write_text(PROG)
    (tmp / "helpers.py").write_text("def offset():\n    return 1\n")
    text = MODELS.replace("FAIL = None", f"FAIL = {fail!r}").replace('"nb"', f'"{which}"', 1)
    (tmp / "models.py").write_text(text)
    return tmp / "prog.lmpm", tmp / "models.py"


def test_a_bind_file_imports_its_siblings_and_its_named_predicate_inputs(tmp_path: Path) -> None:
    prog, models = _write(tmp_path, None)
    out = tmp_path / "run"
    assert main(["run", str(prog), "--bind", str(models), "--out", str(out), "--quiet"]) == 0


@pytest.mark.parametrize(
    ("fail", "code", "line"),
    [("model", "R050", 7), ("score", "R030", 8), ("predicate", "R040", 10)],
)
def test_a_failing_user_function_names_the_program_call_and_its_own_line(
    fail: str, code: str, line: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, models = _write(tmp_path, fail, which="neighbours")
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["run", str(prog), "--bind", str(models), "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"error[{code}]" in err and "KeyError: 'neighbours'" in err, err
    assert f"{prog}:{line}:" in err, err  # the call in the program, with a caret
    assert f"(at {models}:7, in _feats)" in err, err  # the line of the module that raised
    assert "Traceback" not in err
    # ... and the run's trace says why it failed
    assert main(["trace", str(out)]) == 0
    report = capsys.readouterr().out
    assert "the run failed:" in report and f"error[{code}]" in report, report
    # fixed, the program runs into the same directory: nothing was committed there
    _write(tmp_path, None)
    assert main(["run", str(prog), "--bind", str(models), "--out", str(out)]) == 0
    assert "replacing" in capsys.readouterr().err
    assert main(["run", str(prog), "--bind", str(models), "--out", str(out)]) == 2  # a real run


def test_a_bind_file_that_raises_on_import_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, _ = _write(tmp_path, None)
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\nraise RuntimeError('boom at import')\n")
    capsys.readouterr()
    assert main(["check", str(prog), "--bind", str(bad)]) != 0
    err = capsys.readouterr().err
    assert "error[B010]" in err and f"(at {bad}:3, in <module>)" in err, err
    missing = tmp_path / "imports_missing.py"
    missing.write_text("import no_such_module_anywhere\n")
    assert main(["check", str(prog), "--bind", str(missing)]) != 0
    err = capsys.readouterr().err
    assert "error[B010]" in err and "No module named 'no_such_module_anywhere'" in err, err
    assert f"(at {missing}:1, in <module>)" in err, err


def test_show_and_check_count_a_bind_modules_names_as_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, models = _write(tmp_path, None)
    for command in ("show", "check"):
        capsys.readouterr()
        assert main([command, str(prog)]) == 0
        assert "W210" in capsys.readouterr().err
        assert main([command, str(prog), "--bind", str(models)]) == 0
        assert "W210" not in capsys.readouterr().err
