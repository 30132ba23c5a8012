"""The edges of a run directory: a lock per directory, full / read-only filesystems, resume that
imports nothing unnamed, recovery fallbacks, damaged logs, and the run's status after a fault.

Real processes, real files, and (where the machine lets us mount) real small filesystems.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmpm.cli import main

PROG = """
param W = 6
param H = 6
value G : Token[5] shape Grid2D(W, H)
value MaskPlan : Event shape Set()
visible G[x, y] <- G[x+dx, y+dy] when (dx, dy) in N8
rule R:
  on G[x, y]
  read {nb in N8}
  emit proposal G[x, y] := Slow(nb, k=2)
  score Noise(...)
constraint Low: require G[x, y] in Set(0..3) priority 10
commit G[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""

BIND = """
import os
import sys
import time
from pathlib import Path

import torch

import lmpm
from lmpm.models.null import random_tokens
from lmpm.workers import rng

if os.environ.get("LMPM_TEST_IMPORTED"):
    Path(os.environ["LMPM_TEST_IMPORTED"]).write_text("imported")  # proof the module ran
SLEEP = float(os.environ.get("LMPM_TEST_SLEEP", "0"))
FAULT = os.environ.get("LMPM_TEST_FAULT", "")
GATE = os.environ.get("LMPM_TEST_GATE")


@lmpm.bind("Slow")
def slow(inputs, **kw):
    time.sleep(SLEEP)
    while GATE and Path(GATE).exists():  # held open until the test removes the gate
        time.sleep(0.02)
    if FAULT == "exit" and kw.get("epoch", 0) >= 2:
        sys.exit(0)
    if FAULT == "rank":
        return torch.zeros(inputs["cells"].shape[0], 2, 3, dtype=torch.int64)
    return random_tokens(inputs, **kw)


@lmpm.bind("Noise")
def noise(inputs, *, epoch, **_):
    u = rng.uniform(0, "G", inputs["cells"], epoch, "noise", draws=inputs["proposal"].shape[1])
    return u.to(torch.float64) + epoch
"""


@pytest.fixture
def prog(tmp_path: Path) -> tuple[Path, Path]:
    p = tmp_path / "grid.lmpm"
    p.write_text(PROG)
    b = tmp_path / "slow.py"
    b.write_text(BIND)
    return p, b


def _cli(
    args: list[str], *, env: dict[str, str] | None = None, preexec: object = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "lmpm.cli", *args],
        env=dict(os.environ, **(env or {})),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=preexec,  # type: ignore[arg-type]
    )


def _done(p: subprocess.Popen[bytes]) -> tuple[int, str]:
    _, err = p.communicate(timeout=300)
    return p.returncode, err.decode()


def _meta(db: Path, key: str) -> object:
    conn = sqlite3.connect(db)
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])
    finally:
        conn.close()


def _tmp_leftovers(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name.endswith(".tmp"))


# ---- the lock -------------------------------------------------------------------------------------
def test_a_live_run_locks_its_directory(prog: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    base = ["run", str(prog[0]), "--bind", str(prog[1]), "--epochs", "12", "--quiet"]
    gate = tmp_path / "gate"
    gate.write_text("")
    live = _cli([*base, "--out", str(out)], env={"LMPM_TEST_GATE": str(gate)})
    deadline = time.monotonic() + 120
    while not (out / "lmpm.db").exists():  # the log exists: the run is past its start
        assert live.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    second = _cli([*base, "--out", str(out)])
    forced = _cli([*base, "--out", str(out), "--force"])
    resumed = _cli(["run", "--resume", str(out), "--bind", str(prog[1]), "--quiet"])
    for proc, verb in ((second, "write"), (forced, "delete (--force)"), (resumed, "resume")):
        rc, err = _done(proc)
        assert rc == 1, err
        assert "[D020]" in err and f"pid {live.pid}" in err and f"refusing to {verb}" in err, err
    assert live.poll() is None  # the live run was not disturbed...
    gate.unlink()
    rc, err = _done(live)
    assert rc == 0, err
    assert _meta(out / "lmpm.db", "status") == "finished"  # ...and its log is whole
    conn = sqlite3.connect(out / "lmpm.db")
    assert conn.execute("SELECT count(*) FROM epochs").fetchone()[0] == 12
    conn.close()


@pytest.mark.slow
def test_a_killed_run_leaves_no_stale_lock(prog: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    base = ["run", str(prog[0]), "--bind", str(prog[1]), "--epochs", "40", "--quiet"]
    live = _cli([*base, "--out", str(out)], env={"LMPM_TEST_SLEEP": "0.2"})
    deadline = time.monotonic() + 120
    while not (out / "lmpm.db").exists():
        assert live.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    live.send_signal(signal.SIGKILL)
    live.communicate()
    assert (out / "lmpm.lock").exists()
    assert main(["run", "--resume", str(out), "--bind", str(prog[1]), "--quiet"]) == 0


# ---- I/O failures ---------------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 768 KiB tmpfs (needs root and mount; skipped where the machine does not allow it)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=768k", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_is_a_run_dir_error(
    prog: tuple[Path, Path], small_fs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = small_fs / "run"
    args = ["run", str(prog[0]), "--bind", str(prog[1]), "--out", str(out), "--quiet"]
    rc = main([*args, "--epochs", "400", "--trace", "cells", "--checkpoint-every", "1"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "No space left on device" in err or "filesystem is full" in err, err
    assert "[D030]" in err or "[D031]" in err, err
    assert str(out) in err and "internal error" not in err
    assert _tmp_leftovers(small_fs) == []
    assert (out / "lmpm.db").exists()  # the log was made; what it committed is kept...
    r = subprocess.run(["mount", "-o", "remount,size=16m", str(small_fs)], capture_output=True)
    assert r.returncode == 0, r.stderr
    rc = main(["run", "--resume", str(out), "--bind", str(prog[1]), "--epochs", "20", "--quiet"])
    assert rc == 0, capsys.readouterr().err  # ...and the run goes on once there is space
    conn = sqlite3.connect(out / "lmpm.db")
    assert conn.execute("SELECT count(*) FROM epochs").fetchone()[0] == 20
    conn.close()


def test_file_too_large_is_a_run_dir_error(prog: tuple[Path, Path], tmp_path: Path) -> None:
    """RLIMIT_FSIZE: the kernel refuses to grow any file past 64 KiB (EFBIG)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = tmp_path / "run"
    args = ["run", str(prog[0]), "--bind", str(prog[1]), "--out", str(out), "--quiet"]
    rc, err = _done(_cli([*args, "--epochs", "300", "--trace", "cells"], preexec=limit))
    assert rc == 1, err
    assert "File too large" in err or "SQLITE_FULL" in err or "SQLITE_IOERR" in err, err
    assert "[D030]" in err or "[D031]" in err, err
    assert "internal error" not in err and "Traceback" not in err
    assert _tmp_leftovers(tmp_path) == []


def test_read_only_filesystem(
    prog: tuple[Path, Path], small_fs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.decode().strip()}")
    out = small_fs / "run"
    rc = main(["run", str(prog[0]), "--bind", str(prog[1]), "--out", str(out), "--epochs", "2"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "[D030]" in err and "Read-only file system" in err and str(out) in err, err


@pytest.mark.parametrize("how", ["a file", "under a file"])
def test_out_that_is_not_a_directory(
    how: str, prog: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "plain.txt"
    f.write_text("x")
    out = f if how == "a file" else f / "run"
    rc = main(["run", str(prog[0]), "--bind", str(prog[1]), "--out", str(out), "--epochs", "2"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "[D030]" in err and ("not a directory" in err or "Not a directory" in err), err
    assert f.read_text() == "x"


# ---- resume imports only what the command names ---------------------------------------------------
def test_resume_does_not_import_the_recorded_modules(
    prog: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _run(prog, out, "--epochs", "3") == 0
    marker = tmp_path / "imported"
    rc, err = _done(
        _cli(
            ["run", "--resume", str(out), "--epochs", "30"], env={"LMPM_TEST_IMPORTED": str(marker)}
        )
    )
    assert rc == 2, err
    assert "[U040]" not in err  # usage errors print plainly
    assert "--bind" in err and "--trust-bind" in err and str(prog[1]) in err, err
    assert not marker.exists()  # the module named in the database never ran
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--trust-bind", "--epochs", "30", "--quiet"]) == 0


# ---- recovery -------------------------------------------------------------------------------------
def _run(prog: tuple[Path, Path], out: Path, *extra: str) -> int:
    return main(["run", str(prog[0]), "--bind", str(prog[1]), "--out", str(out), "--quiet", *extra])


def test_zero_byte_db_keeps_the_wal(
    prog: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _run(prog, out, "--epochs", "6") == 0
    (out / "lmpm.db-wal").write_bytes(b"\x37\x7f\x06\x82" + b"w" * 5000)  # stands for commits
    (out / "lmpm.db").write_bytes(b"")
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--bind", str(prog[1])]) == 1
    err = capsys.readouterr().err
    assert "[D003]" in err and "empty (0 bytes)" in err and "lmpm.db-wal" in err, err
    assert (out / "lmpm.db-wal").stat().st_size == 5004  # untouched
    assert main(["trace", str(out)]) == 1
    assert (out / "lmpm.db-wal").stat().st_size == 5004


@pytest.mark.parametrize("damage", ["missing", "altered"])
def test_resume_falls_back_to_an_older_checkpoint(
    damage: str, prog: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert _run(prog, ref, "--epochs", "14", "--checkpoint-every", "4") == 0
    assert _run(prog, out, "--epochs", "10", "--checkpoint-every", "4") == 0
    newest = sorted((out / "checkpoints").iterdir())[-1]
    assert newest.name == "epoch-00000010.safetensors"
    if damage == "missing":
        newest.unlink()
    else:
        data = bytearray(newest.read_bytes())
        data[-5] ^= 0xFF
        newest.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--bind", str(prog[1]), "--epochs", "14"]) == 0
    err = capsys.readouterr().err
    assert "resumed at epoch 10 (checkpoint 8 + " in err and "1 damaged newer" in err, err
    for name in ("G.npy", "G.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()


def test_a_gap_in_the_epoch_rows_is_detected(
    prog: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _run(prog, out, "--epochs", "6") == 0
    conn = sqlite3.connect(out / "lmpm.db")
    conn.execute("DELETE FROM epochs WHERE epoch = 3")
    conn.commit()
    conn.close()
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--bind", str(prog[1]), "--epochs", "8"]) == 1
    err = capsys.readouterr().err
    assert "[D012]" in err and "epoch(s) 3 of 0..5" in err, err


NO_CKPT = "DELETE FROM checkpoints WHERE epoch > 0"


@pytest.mark.parametrize(
    ("sql", "what"),
    [
        ("UPDATE meta SET value = '\"x\"' WHERE key = 'params'", "`params`"),
        ("DELETE FROM meta WHERE key = 'seed'", "`seed`"),
        ("UPDATE meta SET value = 'not json' WHERE key = 'bind'", "metadata is unreadable"),
        # (the checkpoints after epoch 0 dropped, so resume replays the damaged row)
        ("UPDATE commits SET count = 99999 WHERE rowid = 5; " + NO_CKPT, "fit"),
        ("UPDATE commits SET sums = 5 WHERE rowid = 5; " + NO_CKPT, "corrupt"),
        ("UPDATE epochs SET maskplan = '{' WHERE epoch = 1", "damaged row"),
        ("UPDATE checkpoints SET file = 7", "no checkpoint is usable"),
    ],
)
def test_hand_damaged_rows_are_run_dir_errors(
    sql: str, what: str, prog: tuple[Path, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = tmp_path / "run"
    assert _run(prog, out, "--epochs", "6", "--checkpoint-every", "100") == 0
    conn = sqlite3.connect(out / "lmpm.db")
    conn.executescript(sql)
    conn.commit()
    conn.close()
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--bind", str(prog[1]), "--epochs", "8"]) == 1
    err = capsys.readouterr().err
    assert "error[D0" in err and what in err and "internal error" not in err, err


# ---- faults end the run as failed ------------------------------------------------------------------
@pytest.mark.parametrize(("fault", "code"), [("exit", "R051"), ("rank", "R054")])
def test_model_fault_marks_the_run_failed(
    fault: str, code: str, prog: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = ["run", str(prog[0]), "--bind", str(prog[1]), "--out", str(out), "--epochs", "5"]
    rc, err = _done(_cli([*args, "--quiet"], env={"LMPM_TEST_FAULT": fault}))
    assert rc == 1, err
    assert f"error[{code}]" in err and "rule=R" in err and "worker=" in err, err
    assert "backend=cpu" in err and "cells=" in err and "Traceback" not in err
    assert _meta(out / "lmpm.db", "status") == "failed"
    assert code in str(_meta(out / "lmpm.db", "error"))
    assert not (out / "G.npy").exists()


# ---- byte-reproducible checkpoints ------------------------------------------------------------------
@pytest.mark.slow  # also covered: test_runtime_resume compares checkpoint sha256s
def test_identical_runs_write_identical_checkpoints(
    prog: tuple[Path, Path], tmp_path: Path
) -> None:
    def shas(d: Path) -> dict[str, str]:
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((d / "checkpoints").iterdir())
        }

    a, b = tmp_path / "a", tmp_path / "b"
    procs = [
        _cli(["run", str(prog[0]), "--bind", str(prog[1]), "--out", str(d), "--epochs", "9",
              "--checkpoint-every", "4", "--quiet"])
        for d in (a, b)
    ]  # fmt: skip
    for p in procs:
        rc, err = _done(p)
        assert rc == 0, err
    # four checkpoints (epochs 0, 4, 8 and the end), each the control plane's file and the
    # worker's payload shard
    labels = {name.split(".")[0] for name in shas(a)}
    assert len(labels) == 4 and len(shas(a)) == 8 and shas(a) == shas(b)
    from safetensors.numpy import load_file

    ck = load_file(str(a / "checkpoints" / "epoch-00000009.safetensors"))  # metadata only
    assert ck["G.clock"].shape == (36,) and "G.payload" not in ck
    shard = load_file(str(a / "checkpoints" / "epoch-00000009.cpu-0.safetensors"))
    assert shard["G.payload"].shape == (36,)
