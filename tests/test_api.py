"""The Python API does what `lmpm run` does: checks before epoch 0, a run directory, resume."""

from __future__ import annotations

from pathlib import Path

import pytest

import lmpm
from lmpm.errors import BindError, CheckError, UsageError

PROG = """param N = 6
value Txt : Token[Byte] shape Seq(N)
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Gen:
  on Txt[t]
  read {ctx = Txt[0..t-1]}
  emit proposal Txt[t] := Uniform(ctx, k=2)
constraint Lower: require Txt[t] in Set(97..122) priority 10
"""


def test_compile_takes_a_path_or_text_never_guesses(tmp_path: Path) -> None:
    assert lmpm.compile(text=PROG).ir.values[0].name == "Txt"
    f = tmp_path / "p.txt"  # any suffix: a path is a path
    f.write_text(PROG)
    assert lmpm.compile(f).ir.values[0].name == "Txt"
    with pytest.raises(UsageError, match="is not a file"):
        lmpm.compile(str(tmp_path / "missing.lmpm"))
    with pytest.raises(UsageError, match="looks like program text"):
        lmpm.compile(PROG)
    with pytest.raises(UsageError):
        lmpm.compile()


def test_unknown_binding_keys_list_the_program_names() -> None:
    with pytest.raises(BindError) as e:
        lmpm.compile(text=PROG).runner(bindings={"Unifrom": object()})
    assert e.value.code == "B021" and "Uniform" in (e.value.hint or "")


def test_runner_makes_the_run_checks_before_epoch_0() -> None:
    bad = PROG.replace("Uniform(ctx, k=2)", "Uniform(ctx, k=0)")
    with pytest.raises(CheckError) as e:
        lmpm.compile(text=bad).runner()
    assert [d.code for d in e.value.diagnostics if d.severity == "error"] == ["E213"]
    unbound = PROG.replace("Uniform(", "Unifrom(")
    with pytest.raises(CheckError) as e:
        lmpm.compile(text=unbound).runner()
    (err,) = [d for d in e.value.diagnostics if d.severity == "error"]
    assert err.code == "E207" and err.hint is not None
    assert err.hint.startswith("did you mean `Uniform`?")  # the typo's nearest bound name


def test_run_dir_trace_records_and_resume(tmp_path: Path) -> None:
    from lmpm.runtime.rundir import connect, read_meta

    run = lmpm.compile(text=PROG).runner(run_dir=tmp_path / "r", seed=3, epochs=3)
    res = run.run(3)
    run.finish()
    assert len(res.records) == 3
    conn = connect(tmp_path / "r")
    try:
        assert read_meta(conn)["seed"] == 3
        assert conn.execute("SELECT count(*) FROM epochs").fetchone()[0] == 3
    finally:
        conn.close()
    again = lmpm.resume(tmp_path / "r", epochs=6)
    assert again.restored is not None and again.restored.epoch == 3
    again.run(again.epochs)  # to epoch 6, as `lmpm run --resume --epochs 6`
    again.finish()
    whole = lmpm.compile(text=PROG).runner(seed=3)
    whole.run(6)
    assert (again.outputs()["Txt"] == whole.outputs()["Txt"]).all()


def test_resume_keeps_a_durable_run_durable(tmp_path: Path) -> None:
    """A run started with `lmpm run --durable` stays durable (synchronous=FULL, and so stored)
    when the Python API resumes it, as when the CLI does."""
    import subprocess
    import sys

    from lmpm.runtime.rundir import connect, read_meta

    prog = tmp_path / "p.lmpm"
    prog.write_text(PROG)
    out = tmp_path / "r"
    cli = [sys.executable, "-m", "lmpm", "run", str(prog), "--epochs", "2", "--out", str(out)]
    done = subprocess.run([*cli, "--durable"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    again = lmpm.resume(out, epochs=4)
    try:
        assert again.log is not None and again.log.info.durable
        assert again.log.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        again.run(again.epochs)
    finally:
        again.finish()
    conn = connect(out)
    try:
        assert read_meta(conn)["durable"] is True
    finally:
        conn.close()


def test_a_binding_that_overrides_a_builtin_is_not_held_to_its_signature() -> None:
    """`Uniform` with k=0 breaks the built-in's signature; the run's own `Uniform` decides."""
    import torch

    bad = PROG.replace("Uniform(ctx, k=2)", "Uniform(ctx, k=0)")

    def mine(inputs: dict[str, torch.Tensor], **_: object) -> dict[str, torch.Tensor]:
        n = inputs["cells"].shape[0]
        return {"proposal": torch.full((n, 1), 97), "score": torch.zeros(n, 1)}

    from lmpm.ir import compile_source
    from lmpm.runtime.session import Run

    front = compile_source(bad, bound_names={"Uniform"})  # the front end is told, then the run
    run = Run(front, bindings={"Uniform": mine})
    run.run(6)
    assert bytes(run.outputs()["Txt"].tolist()) == b"aaaaaa"
    with pytest.raises(CheckError):  # unbound, the built-in's signature applies
        Run(front)


def test_the_version_is_the_packages() -> None:
    import tomllib
    from pathlib import Path

    import lmpm
    from lmpm.version import __version__

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert lmpm.__version__ == __version__ == meta["project"]["version"]
