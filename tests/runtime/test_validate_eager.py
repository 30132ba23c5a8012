"""``LMPM_VALIDATE=eager`` (lmpm.runtime.data.validate): a ``--compile`` run decides every compiled
epoch eagerly too, on a copy of its state, and stops at the first cell where the two differ.

A corrupted compiled result is made by wrapping the real compiled step (it still runs) and
changing what it produced for one committing cell; the run must stop at that cell, in that
epoch, naming both results. Passing runs are in tests/runtime/test_compile_coverage.py (every
example, random programs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmpm.errors import UsageError
from lmpm.runtime.data.compiled import CompiledEpoch
from lmpm.runtime.data.validate import ValidationError
from lmpm.runtime.session import Run
from lmpm.workers.simcuda import simulated_cuda

SRC = """
value A : Token[6] shape Grid2D(4, 3)
value MaskPlan : Event shape Set()
visible A[x, y] <- A[x+dx, y+dy] when (dx, dy) in N4
rule R:
  on A[x, y]
  read {nb in N4}
  emit proposal A[x, y] := Uniform(nb, k=2)
constraint Low: forbid A[x, y] in Set(5) priority 5
commit A[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""


@pytest.fixture
def validate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMPM_VALIDATE", "eager")


def _corrupt(monkeypatch: pytest.MonkeyPatch, epoch: int, what: str) -> dict[str, Any]:
    """Wrap the compiled step: at ``epoch``, change the ``what`` (payload or clock) it produced
    for its first committing cell. Returns what was hit: value, cell."""
    real = CompiledEpoch.step
    hit: dict[str, Any] = {}

    def step(self: CompiledEpoch, value: str, e: int, part: Any, dataplane: Any, meta: Any) -> Any:
        out = real(self, value, e, part, dataplane, meta)
        changed = out[1]
        if e == epoch and not hit and bool(changed.any()):
            row = int(changed.nonzero()[0, 0])
            hit.update(value=value, cell=int(part.cells[row]))
            if what == "payload":  # the payload the step wrote in place
                payload = dataplane.payload[value]
                payload[hit["cell"]] = (payload[hit["cell"]] + 1) % 6
            else:  # the new clocks it returned (on the device, the host state is set from them)
                out = (*out[:6], out[6] + 7, *out[7:])
        return out

    monkeypatch.setattr(CompiledEpoch, "step", step)
    return hit


def test_a_validated_run_passes_and_compares_every_epoch(validate: None) -> None:
    with simulated_cuda():
        run = Run.from_source(SRC, seed=2, compile=True, backend="simcuda")
        res = run.run(4)
        validator = run.engine.dataplane.validator
    eager = Run.from_source(SRC, seed=2).run(4)
    assert res.commits == eager.commits and validator is not None and validator.epochs == 4


@pytest.mark.parametrize(("what", "field"), [("payload", "payload"), ("clock", "clock")])
def test_a_corrupted_compiled_result_stops_at_its_cell(
    validate: None, monkeypatch: pytest.MonkeyPatch, what: str, field: str
) -> None:
    hit = _corrupt(monkeypatch, 1, what)
    with simulated_cuda():
        run = Run.from_source(SRC, seed=2, compile=True, backend="simcuda")
        run.engine.step()  # epoch 0: untouched, equal
        with pytest.raises(ValidationError) as info:
            run.engine.step()
    err = info.value
    assert err.code == "R085"
    assert err.where == {"value": "A", "cell": hit["cell"], "epoch": 1}
    x, y = divmod(hit["cell"], 3)  # Grid2D(4, 3): row-major, x outer
    text = str(err)
    assert "epoch 1:" in text and f"A[{x}, {y}] ({field};" in text
    assert "compiled: committed=True" in text and "eager:    committed=True" in text


def test_the_corrupted_cell_on_the_cpu(validate: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the CPU, where the inductor-compiled step writes the owner's state itself."""
    hit = _corrupt(monkeypatch, 1, "payload")
    run = Run.from_source(SRC, seed=2, compile=True)
    with pytest.raises(ValidationError) as info:
        run.run(4)
    assert info.value.where == {"value": "A", "cell": hit["cell"], "epoch": 1}


def test_an_unknown_mode_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMPM_VALIDATE", "cpu")
    with pytest.raises(UsageError) as info:
        Run.from_source(SRC, compile=True)
    assert info.value.code == "U120" and "LMPM_VALIDATE=eager" in str(info.value)


def test_without_compile_nothing_is_validated(validate: None) -> None:
    run = Run.from_source(SRC, seed=2)
    assert run.engine.compiled is None
    assert run.run(2).epochs == 2


def test_run_help_names_the_switch() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lmpm.cli", "run", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "LMPM_VALIDATE=eager" in " ".join(proc.stdout.split())


def test_the_cli_says_what_it_validated(tmp_path: Path) -> None:
    """`LMPM_VALIDATE=eager lmpm run --compile` ends with how many epochs it decided both ways."""
    prog = tmp_path / "p.lmpm"
    prog.write_text(SRC)
    argv = ["run", str(prog), "--compile", "--epochs", "3", "--seed", "2", "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-m", "lmpm.cli", *argv, "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LMPM_VALIDATE": "eager"},
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "LMPM_VALIDATE=eager: 3 epochs of the compiled run decided eagerly too, every cell the same"
        in (" ".join(proc.stderr.split()))
    )
