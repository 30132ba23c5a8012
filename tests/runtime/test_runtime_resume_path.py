"""One resume path: `lmpm run --resume` and ``lmpm.resume`` take the lock first, check the stored
metadata (D006), the program (D010) and the settings (D011), and import bound modules only when
named as the run was started (or trusted); the Python API can resume a run with bound modules."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest

import lmpm
from lmpm.cli import main
from lmpm.errors import RunDirError, UsageError
from lmpm.runtime import session

sys.path.insert(0, str(Path(__file__).parent))
from test_runtime_commitlog import BIND, PROG, _files

MARKER = """
import os, pathlib
pathlib.Path(os.environ["LMPM_TEST_MARKER"]).write_text("imported")
"""


@pytest.fixture
def started(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory (3 epochs) started with a bound module; returns (run dir, module)."""
    prog, mod = tmp_path / "grid.lmpm", tmp_path / "noise.py"
    prog.write_text(PROG)
    mod.write_text(BIND)
    out = tmp_path / "run"
    args = ["run", str(prog), "--bind", str(mod), "--out", str(out), "--epochs", "3", "--quiet"]
    assert main(args) == 0
    return out, mod


def test_the_python_api_resumes_a_run_with_bound_modules(started: tuple[Path, Path]) -> None:
    out, mod = started
    with pytest.raises(UsageError) as info:
        lmpm.resume(out, epochs=5)
    assert info.value.code == "U040" and "bind=" in (info.value.hint or "")
    again = lmpm.resume(out, epochs=5, bind=[str(mod)])
    assert again.restored is not None and again.restored.epoch == 3
    again.run(again.epochs)
    again.finish()
    trusted = lmpm.resume(out, epochs=6, trust_bind=True)
    trusted.run(trusted.epochs)
    trusted.finish()


def test_naming_another_module_is_refused_and_never_imported(
    started: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = started
    other = tmp_path / "other.py"
    other.write_text(MARKER)
    marker = tmp_path / "marker"
    monkeypatch.setenv("LMPM_TEST_MARKER", str(marker))
    before = _files(out)
    with pytest.raises(RunDirError) as info:
        session.resume(out, bind=[str(other)])
    assert info.value.code == "D011" and str(other) in str(info.value)
    assert not marker.exists() and _files(out) == before


def test_a_damaged_meta_table_is_d006_through_the_api(started: tuple[Path, Path]) -> None:
    out, mod = started
    db = sqlite3.connect(out / "lmpm.db")
    db.execute("DELETE FROM meta WHERE key = 'checkpoint_every'")
    db.commit()
    db.close()
    with pytest.raises(RunDirError) as info:
        lmpm.resume(out, bind=[str(mod)])
    assert info.value.code == "D006" and "checkpoint_every" in str(info.value)


def test_the_lock_is_taken_before_anything_is_read(
    started: tuple[Path, Path], tmp_path: Path
) -> None:
    """A foreign program against a run another process holds: the lock answers first."""
    from lmpm.runtime.lock import RunLock

    out, mod = started
    foreign = tmp_path / "foreign.lmpm"
    foreign.write_text(PROG.replace("Set(0..3)", "Set(0..2)"))
    held = RunLock(out, what="run", create_dir=False).acquire()
    try:
        with pytest.raises(RunDirError) as info:
            session.resume(out, file=foreign, bind=[str(mod)])
        assert info.value.code != "D010", info.value
    finally:
        held.release()
    with pytest.raises(RunDirError) as again:
        session.resume(out, file=foreign, bind=[str(mod)])
    assert again.value.code == "D010"


def test_the_cli_and_the_api_share_one_path(
    started: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, mod = started
    calls: list[Path] = []
    real = session.resume

    def spy(run_dir: Path, **kw: object) -> session.Run:
        calls.append(Path(run_dir))
        return real(run_dir, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(session, "resume", spy)
    args = ["run", "--resume", str(out), "--bind", str(mod), "--epochs", "4", "--quiet"]
    assert main(args) == 0
    again = lmpm.resume(out, epochs=5, bind=[str(mod)])
    again.run(again.epochs)
    again.finish()
    assert calls == [out, out]
