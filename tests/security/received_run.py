"""A real run directory to tamper with: a 5-epoch run of a small grid program (built-in models
only, ``--trace cells``, checkpoints every 2 epochs), made once per process by `lmpm run`."""

from __future__ import annotations

import contextlib
import io
import shutil
import sqlite3
import tempfile
from pathlib import Path

from lmpm.cli import main

ROOT = Path(__file__).resolve().parents[2]

PROG = """\
param W = 6
param H = 4
value G : Token[7] shape Grid2D(W, H)
value MaskPlan : Event shape Set()
visible G[x, y] <- G[x+dx, y+dy] when (dx, dy) in N8
rule R:
  on G[x, y]
  read {nb in N8}
  emit proposal G[x, y] := RandomTokens(nb, k=2)
constraint Low: require G[x, y] in Set(0..4) priority 10
commit G[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""

_made: list[Path] = []
_trained: list[Path] = []


def pristine() -> Path:
    """The run directory as `lmpm run` wrote it (shared: copy it with :func:`copy_run`)."""
    if not _made:
        root = Path(tempfile.mkdtemp(prefix="lmpm-received-"))
        prog = root / "prog.lmpm"
        prog.write_text(PROG)
        out = root / "run"
        args = ["run", str(prog), "--out", str(out), "--epochs", "5", "--trace", "cells"]
        rc, _, err = run_cli([*args, "--checkpoint-every", "2", "--quiet"])
        assert rc == 0, err
        _made.append(out)
    return _made[0]


def pristine_training() -> Path:
    """A training run directory as `lmpm run` wrote it: examples/train_bytelm.lmpm, 2 epochs of
    2 inner steps on one worker (``train.db``, ``checkpoints/inner-w0-*.pt``, ``params-*``)."""
    if not _trained:
        data = ROOT / "examples" / "train"
        out = Path(tempfile.mkdtemp(prefix="lmpm-received-train-")) / "run"
        inputs = [
            "--input",
            f"Corpus={data / 'corpus.npy'}",
            "--input",
            f"Held={data / 'held.npy'}",
        ]
        small = ["--set", "H=2", "--set", "B=2", "--epochs", "2", "--quiet"]
        prog = ROOT / "examples" / "train_bytelm.lmpm"
        rc, _, err = run_cli(["run", str(prog), "--out", str(out), *inputs, *small])
        assert rc == 0, err
        _trained.append(out)
    return _trained[0]


def copy_run(dest: Path, source: Path | None = None) -> Path:
    """A fresh copy of ``source`` (default :func:`pristine`) at ``dest`` (its lock file left
    behind)."""
    src = pristine() if source is None else source
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("lmpm.lock"))
    return dest


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`lmpm ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def sql(db: Path, *statements: str) -> None:
    """Run SQL on a database as an attacker would (no LMPM in the way)."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        for s in statements:
            conn.execute(s)
    finally:
        conn.close()
