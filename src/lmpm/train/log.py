"""The training log: one SQLite database per training run (``RUN_DIR/train.db``), metadata only.

A training run commits one outer step per epoch. The control plane appends, in one transaction per
epoch, what was committed (the parameters' checksum and Lamport clock), what it cost (tokens, time,
bytes the workers exchanged) and what the constraints did; the parameters themselves are written by
worker 0 as a safetensors checkpoint (``RUN_DIR/checkpoints/params-<epoch>.safetensors``, renamed
into place) *before* the transaction that names it. ``lmpm top`` and ``lmpm render`` read the log
while the run is alive (WAL) or after it ended. The module imports no torch.

Schema (version :data:`SCHEMA`)::

    meta(key, value)                 JSON values: kind="train", program, module, cells, workers,
                                     policy, steps (H), batch, epochs (planned), status, error, ...
    train_epochs(epoch, loss, eval_loss, tokens, seconds, inner_seconds, bytes, changed, frozen,
                 projected, rejected, clock, checksum, at)
    train_workers(epoch, worker, steps, loss, last_loss, tokens, seconds, eval_loss)
    train_steps(step, epoch, loss)   the workers' mean loss at each inner step (the loss curve)
    constraint_events(epoch, name, kind, checked, violations, action)
    workers(worker, backend, host, pid, state, restarts, updated)   the live worker table
    worker_faults(seq, epoch, worker, phase, cause, seconds, pid, at)
    checkpoints(epoch, file, bytes, sha256, created)

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> log = TrainLog.create(d, {"program": "t.lmpm", "workers": 1})
>>> log.worker("w0", backend="cpu", host="localhost", pid=1, state="ready", restarts=0)
>>> log.epoch(EpochRow(1, loss=2.0, eval_loss=None, tokens=64, seconds=0.5, inner_seconds=0.4,
...           bytes=0, changed=3, frozen=0, projected=0, rejected=0, clock=1, checksum="ab"),
...           workers=[WorkerRow(1, "w0", 2, 2.1, 1.9, 64, 0.4, None)], steps=[2.1, 1.9])
>>> log.close()
>>> h = read(d)
>>> (h.meta["kind"], h.epochs[0]["loss"], h.steps)
('train', 2.0, [(1, 1, 2.1), (2, 1, 1.9)])
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sqlite3
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

from lmpm.errors import RunDirError
from lmpm.runtime.lock import sqlite_error
from lmpm.runtime.received import Schema, open_reader

DB_NAME = "train.db"
SCHEMA = "train-1"

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS train_epochs (
  epoch INTEGER PRIMARY KEY, loss REAL NOT NULL, eval_loss REAL, tokens INTEGER NOT NULL,
  seconds REAL NOT NULL, inner_seconds REAL NOT NULL, bytes INTEGER NOT NULL,
  changed INTEGER NOT NULL, frozen INTEGER NOT NULL, projected INTEGER NOT NULL,
  rejected INTEGER NOT NULL, clock INTEGER NOT NULL, checksum TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS train_workers (
  epoch INTEGER NOT NULL, worker TEXT NOT NULL, steps INTEGER NOT NULL, loss REAL NOT NULL,
  last_loss REAL NOT NULL, tokens INTEGER NOT NULL, seconds REAL NOT NULL, eval_loss REAL,
  PRIMARY KEY (epoch, worker));
CREATE TABLE IF NOT EXISTS train_steps (
  step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, loss REAL NOT NULL);
CREATE TABLE IF NOT EXISTS constraint_events (
  epoch INTEGER NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL, checked INTEGER NOT NULL,
  violations INTEGER NOT NULL, action TEXT NOT NULL, PRIMARY KEY (epoch, name));
CREATE TABLE IF NOT EXISTS workers (
  worker TEXT PRIMARY KEY, backend TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL,
  state TEXT NOT NULL, restarts INTEGER NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS worker_faults (
  seq INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, worker TEXT NOT NULL, phase TEXT NOT NULL,
  cause TEXT NOT NULL, seconds REAL NOT NULL, pid INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
  epoch INTEGER PRIMARY KEY, file TEXT NOT NULL, bytes INTEGER NOT NULL, sha256 TEXT NOT NULL,
  created REAL NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class EpochRow:
    """One committed outer step. ``loss``: the workers' mean inner loss over the epoch;
    ``eval_loss``: the score (held-out loss) of the committed parameters; ``bytes``: what the
    workers sent each other (all-reduce payload); ``changed`` / ``frozen`` / ``projected`` /
    ``rejected``: parameter cells committed with a new value / kept by a freeze / pulled back
    onto a norm bound / kept because every candidate violated a constraint."""

    epoch: int
    loss: float
    eval_loss: float | None
    tokens: int
    seconds: float
    inner_seconds: float
    bytes: int
    changed: int
    frozen: int
    projected: int
    rejected: int
    clock: int
    checksum: str
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class WorkerRow:
    epoch: int
    worker: str
    steps: int
    loss: float  # mean over the worker's inner steps
    last_loss: float
    tokens: int
    seconds: float
    eval_loss: float | None


@dataclass(frozen=True, slots=True)
class ConstraintRow:
    epoch: int
    name: str
    kind: str  # freeze | norm
    checked: int  # cells × candidates checked
    violations: int
    action: str  # none | frozen | projected | rejected


def db_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / DB_NAME


def holds_training(run_dir: str | Path) -> bool:
    return db_path(run_dir).is_file()


def _connect(path: Path, *, readonly: bool) -> sqlite3.Connection:
    from lmpm.runtime.runfiles import check_database

    check_database(path)  # the log and its -wal, -shm: regular files (SQLite follows links)
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}" + ("?mode=ro" if readonly else "")
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
        if not readonly:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
    except sqlite3.Error as e:
        raise sqlite_error(e, "open", path) from None
    return conn


class TrainLog:
    """The writing side (the control plane's), one connection, one transaction per epoch."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn = conn
        self.path = path

    @classmethod
    def create(cls, run_dir: str | Path, meta: Mapping[str, Any]) -> TrainLog:
        d = Path(run_dir)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            from lmpm.runtime.lock import os_error

            raise os_error(e, "create the run directory", d) from None
        path = db_path(d)
        if path.exists():
            raise RunDirError(
                f"{d} already holds a training run",
                code="D003",
                hint="use another --out, or --force",
            )
        conn = _connect(path, readonly=False)
        log = cls(conn, path)
        try:
            conn.executescript("BEGIN;" + _DDL + "COMMIT;")
        except sqlite3.Error as e:
            conn.close()
            raise sqlite_error(e, "create", path) from None
        log.set_meta(
            {"kind": "train", "schema": SCHEMA, "status": "running", "created": time.time(), **meta}
        )
        log.claim()
        return log

    @classmethod
    def open(cls, run_dir: str | Path) -> TrainLog:
        path = db_path(run_dir)
        _require(path, run_dir)
        return cls(_connect(path, readonly=False), path)

    def _write(self, what: str, sql: str, rows: Sequence[tuple[Any, ...]]) -> None:
        try:
            self.conn.executemany(sql, rows)
        except sqlite3.Error as e:
            raise sqlite_error(e, f"write {what} to", self.path) from None

    def set_meta(self, items: Mapping[str, Any]) -> None:
        rows = [(k, json.dumps(v, sort_keys=True)) for k, v in items.items()]
        self._write("metadata", "INSERT OR REPLACE INTO meta VALUES (?, ?)", rows)

    def worker(
        self, worker: str, *, backend: str, host: str, pid: int, state: str, restarts: int
    ) -> None:
        """Insert or update one row of the live worker table."""
        row = (worker, backend, host, pid, state, restarts, time.time())
        self._write(
            "a worker", "INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?, ?, ?, ?)", [row]
        )

    def fault(
        self, epoch: int, worker: str, phase: str, cause: str, seconds: float, pid: int
    ) -> None:
        row = (epoch, worker, phase, cause, seconds, pid, time.time())
        self._write(
            "a fault",
            "INSERT INTO worker_faults (epoch, worker, phase, cause, seconds, pid, at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [row],
        )

    def epoch(
        self,
        row: EpochRow,
        *,
        workers: Sequence[WorkerRow] = (),
        steps: Sequence[float] = (),
        constraints: Sequence[ConstraintRow] = (),
        checkpoint: tuple[str, int, str] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Append one epoch, all or nothing. ``steps``: the mean loss of each inner step of the
        epoch (numbered on from the log's last step); ``checkpoint``: (file, bytes, sha256) of the
        parameters file already renamed into place; ``meta``: metadata that changes with the epoch
        (the cells' clocks), in the same transaction."""
        c = self.conn
        try:
            c.execute("BEGIN IMMEDIATE")
            first = c.execute("SELECT COALESCE(MAX(step), 0) FROM train_steps").fetchone()[0] + 1
            c.execute(f"INSERT INTO train_epochs VALUES ({', '.join('?' * 14)})", astuple(row))
            c.executemany(
                "INSERT INTO train_workers VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [astuple(w) for w in workers],
            )
            c.executemany(
                "INSERT INTO train_steps VALUES (?, ?, ?)",
                [(first + i, row.epoch, float(x)) for i, x in enumerate(steps)],
            )
            c.executemany(
                "INSERT INTO constraint_events VALUES (?, ?, ?, ?, ?, ?)",
                [astuple(k) for k in constraints],
            )
            if checkpoint is not None:
                c.execute(
                    "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?)",
                    (row.epoch, *checkpoint, time.time()),
                )
            c.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [(k, json.dumps(v, sort_keys=True)) for k, v in (meta or {}).items()],
            )
            c.execute("COMMIT")
        except sqlite3.Error as e:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise sqlite_error(e, f"log epoch {row.epoch} in", self.path) from None

    def claim(self) -> None:
        """Record this process as the one running the training (what ``lmpm top`` checks)."""
        self.set_meta({"pid": os.getpid(), "host": socket.gethostname()})

    def mark(self, status: str, error: str | None = None) -> None:
        """``status``: running | finished | failed | interrupted."""
        items: dict[str, Any] = {"status": status, "updated": time.time()}
        if error is not None:
            items["error"] = error
        if status != "running":
            items["finished"] = time.time()
        self.set_meta(items)

    def close(self) -> None:
        self.conn.close()


def status(meta: Mapping[str, Any]) -> str:
    """The run's status, checked: a log that says ``running`` whose process (on this host) is
    gone says ``stopped`` (killed: ``lmpm run --resume`` continues it)."""
    st = str(meta.get("status", "?"))
    if st != "running" or meta.get("host") != socket.gethostname() or not meta.get("pid"):
        return st
    try:
        os.kill(int(meta["pid"]), 0)
    except ProcessLookupError:
        return "stopped"
    except (PermissionError, OverflowError, ValueError):
        pass
    return st


@dataclass(slots=True)
class TrainHistory:
    """Everything ``lmpm top`` / ``lmpm render`` show of a training run."""

    meta: dict[str, Any]
    epochs: list[dict[str, Any]]
    workers: list[dict[str, Any]]  # the live table (one row per worker)
    worker_epochs: list[dict[str, Any]]
    steps: list[tuple[int, int, float]]  # (step, epoch, loss)
    constraints: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]


def _require(path: Path, run_dir: str | Path) -> None:
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} holds no LMPM training run (no {DB_NAME})",
            code="D001",
            hint="give the --out directory of an `lmpm run` of a training program",
        )


def _rows(conn: sqlite3.Connection, sql: str) -> list[dict[str, Any]]:
    cur = conn.execute(sql)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def read(run_dir: str | Path) -> TrainHistory:
    """The whole log of a training run (read-only; safe while the run is alive)."""
    path = db_path(run_dir)
    _require(path, run_dir)
    conn = open_reader(path, _schema())  # a received log: schema checked, a time budget
    try:
        meta = {str(k): json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}
        if meta.get("kind") != "train":
            raise RunDirError(f"{path} is not a training log", code="D002")
        return TrainHistory(
            meta=meta,
            epochs=_rows(conn, "SELECT * FROM train_epochs ORDER BY epoch"),
            workers=_rows(conn, "SELECT * FROM workers ORDER BY worker"),
            worker_epochs=_rows(conn, "SELECT * FROM train_workers ORDER BY epoch, worker"),
            steps=[
                tuple(r)
                for r in conn.execute("SELECT step, epoch, loss FROM train_steps ORDER BY step")
            ],  # type: ignore[misc]
            constraints=_rows(conn, "SELECT * FROM constraint_events ORDER BY epoch, name"),
            faults=_rows(conn, "SELECT * FROM worker_faults ORDER BY seq"),
            checkpoints=_rows(conn, "SELECT * FROM checkpoints ORDER BY epoch"),
        )
    except sqlite3.DatabaseError as e:
        raise sqlite_error(e, "read", path) from None
    except (TypeError, ValueError) as e:
        raise RunDirError(f"{path} holds a value LMPM never writes ({e})", code="D006") from None
    finally:
        conn.close()


@functools.cache
def _schema() -> Schema:
    """The tables :func:`read` reads, with their columns."""
    return Schema.of(_DDL)
