"""A multi-worker run's per-cell log rows in its workers' stores (``payload/w<i>.db``) read as if
they were in ``lmpm.db``: `lmpm trace`, ``rundir.connect`` and resume see the same rows.

The runs here have one worker; their rows are moved into synthetic stores, which is what a
multi-worker run's workers write."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
from test_runtime_resume import _cells_log

from lmpm.cli import main
from lmpm.runtime.rundir import SHARDED, STORE_SCHEMA, attach_shards, connect

RUN = ["examples/latent.lmpm", "--input", "Z=examples/latent/z0.npy", "--trace", "cells"]
CELL = "Z[3, 4]"


def _run(d: Path, epochs: int = 3) -> None:
    assert main(["run", *RUN, "--epochs", str(epochs), "--out", str(d), "--quiet"]) == 0


def _rows(d: Path) -> dict[str, set[tuple[object, ...]]]:
    conn = connect(d)
    try:
        return {t: set(conn.execute(f"SELECT * FROM {t}")) for t in SHARDED}
    finally:
        conn.close()


def _store(path: Path, schema: str = STORE_SCHEMA) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    conn.executescript(schema)
    return conn


def _shard(d: Path) -> None:
    """Move the log's per-cell rows into two workers' stores: commits by epoch parity, the trace
    rows by cell parity; w1 also gets rows of an epoch the log never logged (99): every commit
    row again, and the trace rows of the cell whose story is told."""
    log = sqlite3.connect(d / "lmpm.db")
    (cell,) = log.execute(
        "SELECT cell FROM trace_cells WHERE value = 'Z' AND coord = '3,4'"
    ).fetchone()
    stores = [_store(d / "payload" / f"w{i}.db") for i in range(2)]
    for t in SHARDED:
        key = "epoch" if t == "commits" else "cell"
        rows = log.execute(f"SELECT {key} % 2, * FROM {t}").fetchall()
        assert rows, t
        marks = ",".join("?" * (len(rows[0]) - 1))
        for k, conn in enumerate(stores):
            conn.executemany(
                f"INSERT INTO {t} VALUES ({marks})", [r[1:] for r in rows if r[0] == k]
            )
        ghost = [(99, *r[2:]) for r in rows if t == "commits" or r[3] == cell]
        assert ghost, t
        stores[1].executemany(f"INSERT INTO {t} VALUES ({marks})", ghost)
        log.execute(f"DELETE FROM {t}")
    for conn in (*stores, log):
        conn.commit()
        conn.close()


def _trace(capsys: pytest.CaptureFixture[str], d: Path, *args: str) -> str:
    capsys.readouterr()
    assert main(["trace", str(d), *args]) == 0
    return capsys.readouterr().out


def test_trace_reads_the_workers_stores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    _run(d)
    asks = [(), ("--json",), ("--cell", CELL), ("--cell", CELL, "--json")]
    before = [_trace(capsys, d, *a) for a in asks]
    rows, cells = _rows(d), _cells_log(d)
    assert all(rows.values()) and cells
    _shard(d)
    log = sqlite3.connect(d / "lmpm.db")
    assert all(log.execute(f"SELECT count(*) FROM {t}").fetchone()[0] == 0 for t in SHARDED)
    log.close()
    assert [_trace(capsys, d, *a) for a in asks] == before
    assert _rows(d) == rows  # the unlogged epoch 99 is left out
    assert _cells_log(d) == cells
    # a store of an older schema (no per-cell tables) is read past
    _store(d / "payload" / "w2.db", STORE_SCHEMA.split("CREATE TABLE IF NOT EXISTS commits")[0])
    assert [_trace(capsys, d, *a) for a in asks] == before
    assert _rows(d) == rows


def test_past_the_attach_limit_rows_are_copied(tmp_path: Path) -> None:
    d = tmp_path / "run"
    _run(d)
    rows = _rows(d)
    _shard(d)
    conn = sqlite3.connect(f"file:{d / 'lmpm.db'}?mode=ro", uri=True)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 1)  # two stores, room for one
    try:
        assert attach_shards(conn, d) == 2
        assert {t: set(conn.execute(f"SELECT * FROM {t}")) for t in SHARDED} == rows
        assert not [r for r in conn.execute("PRAGMA database_list") if r[1].startswith("shard")]
    finally:
        conn.close()


def test_resume_replays_the_commits_in_the_stores(tmp_path: Path) -> None:
    # Both runs resume from checkpoint 0 (the final one is dropped), so resume replays epochs
    # 0..2 from the commits: the log's in `ref`, the workers' stores' in `run`.
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d in (ref, run):
        _run(d)
        log = sqlite3.connect(d / "lmpm.db")
        for (f,) in log.execute("SELECT file FROM checkpoints WHERE epoch > 0").fetchall():
            for p in (d / "checkpoints").glob(Path(f).name.split(".")[0] + ".*"):
                p.unlink()
        log.execute("DELETE FROM checkpoints WHERE epoch > 0")
        log.commit()
        log.close()
    _shard(run)
    # rows a worker wrote for an epoch the log never got are dropped from its store on resume
    own = sqlite3.connect(run / "payload" / "cpu-0.db")
    own.executescript(STORE_SCHEMA)
    own.execute(
        "INSERT INTO trace_cells VALUES (3, 'Z', 0, 'Z[0,0]', 0, 0, 0, 0, 0, NULL, 0, 0, NULL)"
    )
    own.commit()
    own.close()
    for d in (ref, run):
        assert main(["run", "--resume", str(d), "--epochs", "5", "--quiet"]) == 0
    for name in ("Z.npy", "M.npy"):
        assert np.array_equal(np.load(run / name), np.load(ref / name)), name
    assert _cells_log(run) == _cells_log(ref)
    own = sqlite3.connect(run / "payload" / "cpu-0.db")
    assert own.execute("SELECT count(*) FROM trace_cells WHERE epoch >= 3").fetchone()[0] == 0
    own.close()
    # the resumed epochs went into the log's own table (the stores were detached after replay)
    log = sqlite3.connect(run / "lmpm.db")
    assert {e for (e,) in log.execute("SELECT DISTINCT epoch FROM commits")} == {3, 4}
    log.close()


def test_cells_log_is_the_same_for_any_worker_count(tmp_path: Path) -> None:
    # a 2-worker run's stores are attached (their per-cell tables are empty or full, depending on
    # the writer); each cell's story is the one-worker run's
    one, two = tmp_path / "one", tmp_path / "two"
    _run(one)
    args = ["--workers", "2", "--driver", "process", "--out", str(two), "--quiet"]
    assert main(["run", *RUN, "--epochs", "3", *args]) == 0
    assert sorted(p.name for p in (two / "payload").glob("w*.db")) == ["w0.db", "w1.db"]
    assert _cells_log(two) == _cells_log(one)
