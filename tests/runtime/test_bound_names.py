"""One rule for the names a run binds itself (issue 47): `lmpm check`, `lmpm run`, its
`--resume`, ``lmpm.compile``/``runner()`` and ``lmpm.resume`` check the program against the run's
own bindings (a bound `Copy` is not the built-in `Copy`), and a run directory records the names it
binds with their signatures, which a resume must bind again, by a module or a ``bindings=``
mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lmpm
from lmpm.cli import main
from lmpm.errors import CheckError, RunDirError, UsageError

# `Copy` is a built-in (a float/tensor model reading `own`); this program binds its own.
PROG = """
param N = 6
value S : Token[Byte] shape Seq(N)
visible S[t] <- S[0..t-1] when t > 0
rule Gen:
  on S[t]
  read {ctx = S[0..t-1]}
  emit proposal S[t] := Copy(ctx, src=3)
commit S[*] using satisfy(max_constraints_then_score)
"""

MODULE = """
import torch
import lmpm

@lmpm.bind("Copy")
def copy(inputs, *, src, **_):
    n = inputs["cells"].shape[0]
    return {"proposal": torch.full((n, 1), 97 + src, dtype=torch.long),
            "score": torch.zeros(n, 1, dtype=torch.float64)}
"""


def copy(inputs: dict[str, Any], *, src: int, **_: Any) -> dict[str, torch.Tensor]:
    n = inputs["cells"].shape[0]
    return {
        "proposal": torch.full((n, 1), 97 + src, dtype=torch.long),
        "score": torch.zeros(n, 1, dtype=torch.float64),
    }


def other_copy(inputs: dict[str, Any], *, source: int = 0, **_: Any) -> dict[str, Any]:
    return copy(inputs, src=3)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    prog, mod = tmp_path / "prog.lmpm", tmp_path / "mine.py"
    prog.write_text(PROG)
    mod.write_text(MODULE)
    return prog, mod


def test_lmpm_run_checks_a_bound_builtin_name_against_the_binding(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, mod = files
    out = tmp_path / "run"
    assert main(["check", str(prog), "--bind", str(mod)]) == 0
    args = ["run", str(prog), "--bind", str(mod), "--out", str(out), "--epochs", "3", "--quiet"]
    assert main(args) == 0, capsys.readouterr().err
    assert bytes(np.load(out / "S.npy").tolist()) == b"dddddd"
    # resuming checks it against the binding too
    again = ["run", "--resume", str(out), "--bind", str(mod), "--epochs", "4", "--quiet"]
    assert main(again) == 0, capsys.readouterr().err


def test_without_the_binding_the_builtin_signature_holds(files: tuple[Path, Path]) -> None:
    prog, _ = files
    with pytest.raises(CheckError) as info:
        lmpm.compile(prog)
    assert {d.code for d in info.value.diagnostics} == {"E213"}
    hints = [d.hint or "" for d in info.value.diagnostics]
    assert any('lmpm.compile(path, bindings={"Copy": ...})' in h for h in hints), hints


def test_lmpm_compile_takes_the_bindings_it_is_checked_against(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    prog, mod = files
    compiled = lmpm.compile(prog, bindings={"Copy": copy})
    run = compiled.runner(epochs=3)
    run.run(3)
    assert bytes(run.outputs()["S"].tolist()) == b"dddddd"
    by_module = lmpm.compile(prog, bind=[str(mod)]).runner()
    by_module.run(2)
    assert bytes(by_module.outputs()["S"].tolist()) == b"dddddd"


def test_an_api_run_with_bindings_resumes_with_them(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog, mod = files
    out = tmp_path / "api"
    run = lmpm.compile(prog, bindings={"Copy": copy}).runner(run_dir=out, epochs=2)
    run.run(2)
    run.finish()
    with pytest.raises(UsageError) as missing:
        lmpm.resume(out, epochs=3)
    assert missing.value.code == "U040"
    assert "bindings=" in str(missing.value) and '"Copy"' in (missing.value.hint or "")
    with pytest.raises(RunDirError) as other:
        lmpm.resume(out, epochs=3, bindings={"Copy": other_copy})
    assert other.value.code == "D011" and "(inputs, *, source=..., **_)" in str(other.value)
    assert "--out" not in (other.value.hint or "")
    again = lmpm.resume(out, epochs=3, bindings={"Copy": copy})
    assert again.restored is not None and again.restored.epoch == 2
    again.run(again.epochs)
    again.finish()
    # a module binding the same name with the same signature stands in for the mapping
    cli = ["run", "--resume", str(out), "--bind", str(mod), "--epochs", "4", "--quiet"]
    assert main(cli) == 0, capsys.readouterr().err
    api = lmpm.resume(out, epochs=5, bind=[str(mod)])
    api.run(api.epochs)
    api.finish()
    assert bytes(np.load(out / "S.npy").tolist()) == b"dddddd"


def test_an_unbound_name_in_python_is_told_of_bindings(tmp_path: Path) -> None:
    """E207's hint names the Python API's ways to bind, not only --bind."""
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROG.replace("Copy(ctx, src=3)", "Mine(ctx)"))
    compiled = lmpm.compile(prog)
    with pytest.raises(CheckError) as info:
        compiled.runner()
    assert info.value.code == "E207" and "bindings=" in (info.value.hint or "")
    run = compiled.runner(bindings={"Mine": copy_three})
    run.run(1)
    assert bytes(run.outputs()["S"].tolist()) == b"dddddd"


def copy_three(inputs: dict[str, Any], **_: Any) -> dict[str, torch.Tensor]:
    return copy(inputs, src=3)
