"""SIGKILL a real `lmpm run` at random points, resume it, and get byte-identical outputs."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmpm.cli import main

PROG = """
param W = 8
param H = 6
value G : Token[7] shape Grid2D(W, H)
value MaskPlan : Event shape Set()
visible G[x, y] <- G[x+dx, y+dy] when (dx, dy) in N8
rule R:
  on G[x, y]
  read {nb in N8}
  emit proposal G[x, y] := Slow(nb, k=2)
  score Noise(...)
constraint Lock: forbid change(G[0..1, 0..1]) priority 100
constraint Low: require G[x, y] in Set(0..4) priority 10
constraint Diff: forbid clash(G[x, y], G[x, *]) priority 5
commit G[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""

BIND = """
import os
import time

import torch

import lmpm
from lmpm.models.null import random_tokens
from lmpm.workers import rng

SLEEP = float(os.environ.get("LMPM_TEST_SLEEP", "0"))


@lmpm.bind("Slow")
def slow(inputs, **kw):
    time.sleep(SLEEP)  # slow enough per epoch to be killed in the middle of one
    return random_tokens(inputs, **kw)


@lmpm.bind("Noise")
def noise(inputs, *, epoch, **_):
    # later epochs score higher, so cells keep changing and clocks keep moving all run long
    u = rng.uniform(0, "G", inputs["cells"], epoch, "noise", draws=inputs["proposal"].shape[1])
    return u.to(torch.float64) + epoch
"""

EPOCHS = 24
OUTPUTS = ("G.npy", "G.json")
LOG = (
    "SELECT epoch, value, first, last, step, count, rule, clock_min, clock_max, score_min, "
    "score_max, crc, sums, clocks, scores FROM commits ORDER BY epoch, value, first",
    "SELECT * FROM trace_summary ORDER BY epoch, constraint_id, rule",
    "SELECT epoch, open_cells, attempts, candidates, commits, violations, decided, maskplan "
    "FROM epochs ORDER BY epoch",
)


def _epochs_done(db: Path) -> int:
    if not db.exists():
        return -1
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.1)
        try:
            return int(conn.execute("SELECT count(*) FROM epochs").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        return -1


def _spawn(args: list[str], sleep: float) -> subprocess.Popen[bytes]:
    env = dict(os.environ, LMPM_TEST_SLEEP=str(sleep))
    return subprocess.Popen(
        [sys.executable, "-m", "lmpm.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _kill_at(proc: subprocess.Popen[bytes], db: Path, target: int, delay: float) -> bool:
    """SIGKILL once ``target`` epochs are in the log, ``delay`` s later (mid-epoch). False when
    the process finished first."""
    deadline = time.monotonic() + 60
    while _epochs_done(db) < target:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    time.sleep(delay)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    return True


def _log(db: Path) -> list[list[tuple[object, ...]]]:
    conn = sqlite3.connect(db)
    try:
        return [conn.execute(q).fetchall() for q in LOG]
    finally:
        conn.close()


def _cells_log(run_dir: Path) -> dict[tuple[str, int], list[tuple[object, ...]]]:
    """Per (value, cell), its commits in epoch order: (epoch, rule, clock, score, payload sum),
    expanded from the ``commits`` rows (a row covers cells first, first + step, ... ``count`` of
    them) and read through :func:`rundir.connect`, so a multi-worker run's rows in its workers'
    stores count too. Comparable across worker counts, unlike :func:`_log`: how cells group into
    rows, and so the rows' crc, depends on which worker committed them."""
    from lmpm.runtime.rundir import connect, decode

    conn = connect(run_dir)
    try:
        rows = conn.execute(
            "SELECT epoch, value, first, step, count, rule, clock_min, clocks, score_min, scores, "
            "sums FROM commits"
        ).fetchall()
    finally:
        conn.close()
    out: dict[tuple[str, int], list[tuple[object, ...]]] = {}
    for epoch, value, first, step, count, rule, cmin, clocks, smin, scores, sums in rows:
        clock = [cmin] * count if clocks is None else [cmin + c for c in decode(clocks).tolist()]
        score = [smin] * count if scores is None else decode(scores).tolist()
        for j, s in enumerate(decode(sums).tolist()):
            out.setdefault((value, first + step * j), []).append(
                (epoch, rule, clock[j], score[j], s)
            )
    return {k: sorted(v) for k, v in sorted(out.items())}


def _query(db: Path, q: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(q).fetchall()
    finally:
        conn.close()


def _store(run_dir: Path) -> list[tuple[object, ...]]:
    return _query(
        run_dir / "payload" / "cpu-0.db",
        "SELECT epoch, value, first, step, count, crc, payload FROM rows "
        "ORDER BY epoch, value, first",
    )


def _kill_and_resume(prog: Path, common: list[str], out: Path, seed: int, kills: int) -> str:
    """Start a run, SIGKILL it ``kills`` times at random points (resuming in between), then
    resume it to the end. Returns the last resume's stderr."""
    db = out / "lmpm.db"
    pick = random.Random(seed)
    killed = 0
    proc = _spawn(["run", str(prog), *common, "--out", str(out)], sleep=0.03)
    for k in range(kills):
        target = pick.randint(0, EPOCHS - 6)
        if _kill_at(proc, db, max(target, _epochs_done(db) + 1), pick.uniform(0, 0.04)):
            killed += 1
        else:
            proc.communicate()
        assert not (out / "G.npy").exists()  # outputs appear only once the run is complete
        last = k == kills - 1
        # the --bind module is named again: resume imports nothing the command does not name
        bind = common[common.index("--bind") + 1]
        proc = _spawn(
            ["run", "--resume", str(out), "--bind", bind, "--quiet"], sleep=0.0 if last else 0.03
        )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert killed >= 1
    return err.decode()


def test_sigkill_then_resume_is_byte_identical(tmp_path: Path) -> None:
    prog = tmp_path / "grid.lmpm"
    prog.write_text(PROG)
    bind = tmp_path / "slow.py"
    bind.write_text(BIND)
    cases = [(1, 1), (2, 1), (3, 2)]  # (seed, kills); seed 3 is killed again while resuming
    common = {
        seed: [
            "--bind",
            str(bind),
            "--seed",
            str(seed),
            "--epochs",
            str(EPOCHS),
            "--checkpoint-every",
            "5",
            "--quiet",
        ]
        for seed, _ in cases
    }
    for seed, _ in cases:  # the uninterrupted runs, in process (same code path, no sleep)
        assert main(["run", str(prog), *common[seed], "--out", str(tmp_path / f"ref{seed}")]) == 0
    # The killed runs are real processes, run side by side (each waits on its own process).
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {
            seed: pool.submit(
                _kill_and_resume, prog, common[seed], tmp_path / f"run{seed}", seed, kills
            )
            for seed, kills in cases
        }
        errs = {seed: f.result() for seed, f in futures.items()}
    for seed, _ in cases:
        out, ref = tmp_path / f"run{seed}", tmp_path / f"ref{seed}"
        assert "resumed at epoch" in errs[seed]
        for name in OUTPUTS:
            assert (out / name).read_bytes() == (ref / name).read_bytes(), (seed, name)
        # the log itself is the uninterrupted run's, and so is the worker's payload store
        assert _log(out / "lmpm.db") == _log(ref / "lmpm.db"), seed
        assert _store(out) == _store(ref), seed
        # and so are the checkpoints, byte for byte (their sha256 is in both logs)
        q = "SELECT epoch, sha256 FROM checkpoints ORDER BY epoch"
        assert _query(out / "lmpm.db", q) == _query(ref / "lmpm.db", q), seed


def test_a_run_killed_while_starting_leaves_no_log(tmp_path: Path) -> None:
    prog = tmp_path / "grid.lmpm"
    prog.write_text(PROG)
    bind = tmp_path / "slow.py"
    bind.write_text(BIND)
    out = tmp_path / "run"
    proc = _spawn(
        ["run", str(prog), "--bind", str(bind), "--epochs", "3", "--out", str(out), "--quiet"],
        sleep=0.0,
    )
    time.sleep(0.3)  # still importing torch: killed before the log exists
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not (out / "lmpm.db").exists()
    assert (
        main(["run", str(prog), "--bind", str(bind), "--epochs", "3", "--out", str(out), "--quiet"])
        == 0
    )


def test_a_ruleset_change_survives_sigkill(tmp_path: Path) -> None:
    # `--resume D --disable Low` is killed mid-run; a plain resume continues with Low still
    # disabled (the event is in the log with the epoch it governs) and commits what an
    # uninterrupted run with the same change commits.
    prog = tmp_path / "grid.lmpm"
    prog.write_text(
        PROG.replace("value MaskPlan", "value RuleSet : Rule shape Set()\nvalue MaskPlan")
    )
    bind = tmp_path / "slow.py"
    bind.write_text(BIND)
    common = ["--bind", str(bind), "--seed", "5", "--quiet"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    for d in (ref, out):
        assert main(["run", str(prog), *common, "--epochs", "4", "--out", str(d)]) == 0
    change = ["run", "--resume", "--disable", "Low", "--epochs", str(EPOCHS), *common]
    assert main([*change[:2], str(ref), *change[2:]]) == 0
    proc = _spawn([*change[:2], str(out), *change[2:]], sleep=0.03)
    assert _kill_at(proc, out / "lmpm.db", 8, 0.02), "the resumed run finished before the kill"
    proc = _spawn(["run", "--resume", str(out), "--bind", str(bind), "--quiet"], sleep=0.0)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    for name in OUTPUTS:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert _log(out / "lmpm.db") == _log(ref / "lmpm.db")
    q = "SELECT seq, epoch, op, name, clock, by FROM ruleset_events ORDER BY seq"  # not `at`
    events = _query(out / "lmpm.db", q)
    assert events == _query(ref / "lmpm.db", q) and len(events) == 1
