"""Reading a run's commit log (RUN_DIR/lmpm.db) with SQLite alone: no torch, no engine.

`lmpm trace` and `lmpm render` start in a fraction of a second because they read the log through
this module; :mod:`lmpm.runtime.control.commitlog` (the writing side, which needs the engine) re-uses the
same schema. Every fault is a :class:`~lmpm.errors.RunDirError` saying what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from lmpm.errors import RunDirError
from lmpm.runtime.lock import is_io_error, sqlite_error

# The log schema this version reads and lmpm.runtime.control.commitlog writes. 2: the payload moved to the
# workers' stores and commits carry checksums.
SCHEMA_VERSION = 2
STORE_DIR = "payload"  # the workers' payload stores (lmpm.runtime.data.store writes them)
DB_NAME = "lmpm.db"

# A blob is one tag byte (a numpy type character) followed by the little-endian array.
TAGS = {"B": "<u1", "H": "<u2", "I": "<u4", "q": "<i8", "f": "<f4", "d": "<f8"}


def db_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / DB_NAME


SQLITE_HEADER = b"SQLite format 3\x00"


def _check_header(path: Path) -> None:
    """Refuse a file that is not an SQLite database *before* SQLite opens it: SQLite treats an
    empty or foreign file as a new database and may then discard the ``-wal`` beside it, which
    holds the run's commits."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError as e:
        raise RunDirError(f"cannot read {path}: {e.strerror}", code="D002") from None
    if head == SQLITE_HEADER:
        return
    wal = Path(f"{path}-wal")
    kept = ""
    if wal.is_file() and wal.stat().st_size > 0:
        kept = f"; its write-ahead log {wal.name} ({wal.stat().st_size:,} bytes) was left as it is"
    what = "empty (0 bytes)" if not head else "not an SQLite database"
    raise RunDirError(
        f"{path} is {what}{kept}; nothing was changed",
        code="D003",
        hint="restore lmpm.db from a copy (the -wal file alone cannot be read without it), "
        "or start a new run in another directory",
    )


def connect(run_dir: str | Path, *, check: bool = False) -> sqlite3.Connection:
    """Open RUN_DIR's log read-only and validate it (``check`` also runs ``quick_check``)."""
    path = db_path(run_dir)
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} holds no LMPM run (no {DB_NAME})",
            code="D001",
            hint="give the --out directory of an `lmpm run`",
        )
    _check_header(path)  # before SQLite opens it (it would discard the -wal of an empty file)
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    except sqlite3.Error as e:
        raise RunDirError(f"cannot open {path}: {e}", code="D002") from None
    try:
        validate(conn, path, check=check)
    except sqlite3.Error as e:
        conn.close()
        raise sqlite_error(e, "read", path) from None
    except BaseException:
        conn.close()
        raise
    return conn


def validate(conn: sqlite3.Connection, path: Path, *, check: bool = False) -> None:
    """Raise RunDirError unless ``conn`` is an LMPM log of the schema this version reads."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            raise RunDirError(
                f"{path} is not an LMPM run database (no schema version)", code="D003"
            )
        version = int(json.loads(row[0]))
        if version > SCHEMA_VERSION:
            raise RunDirError(
                f"{path} was written by a newer LMPM (log schema {version}; this version reads "
                f"{SCHEMA_VERSION}); nothing was changed",
                code="D004",
                hint="upgrade lmpm to resume or read this run",
            )
        if version < SCHEMA_VERSION:
            raise RunDirError(
                f"{path} has log schema {version}; this version reads {SCHEMA_VERSION} only "
                "(schema 2 moved the payload out of the log into the workers' stores); "
                "nothing was changed",
                code="D005",
                hint="rerun the program with this version of lmpm to get a run it can read and resume",
            )
        if check:
            bad = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall() if r[0] != "ok"]
            if bad:
                raise RunDirError(f"{path} is corrupt: {bad[0]}; nothing was changed", code="D006")
    except RunDirError:
        raise
    except (sqlite3.Error, ValueError) as e:
        if isinstance(e, sqlite3.Error) and is_io_error(e):
            raise  # the disk failed, the database is not damaged: the caller names the cause
        raise RunDirError(
            f"{path} is corrupt or truncated ({e}); nothing was changed",
            code="D006",
            hint="start a new run with --force, or restore the directory from a copy",
        ) from None


def read_meta(conn: sqlite3.Connection) -> dict[str, Any]:
    try:
        return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    except (sqlite3.Error, ValueError) as e:
        raise RunDirError(f"the run's metadata is unreadable ({e})", code="D006") from None


def completed_epochs(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT max(epoch) FROM epochs").fetchone()
    return 0 if row[0] is None else int(row[0]) + 1


def decode(blob: bytes) -> np.ndarray:
    tag = chr(blob[0])
    if tag not in TAGS:
        raise RunDirError(f"a commit-log blob has an unknown type tag {tag!r}", code="D006")
    return np.frombuffer(blob, dtype=TAGS[tag], offset=1)


def read_checkpoint(run_dir: Path, rel: str, sha: str, what: str = "checkpoint") -> bytes:
    """A checkpoint file's bytes, checked against the sha256 the log (or a control checkpoint)
    recorded for it; RunDirError D007 when it is missing, truncated or altered."""
    path = run_dir / rel
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RunDirError(
            f"{what} {path} is missing ({e.strerror}); nothing was changed", code="D007"
        ) from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise RunDirError(
            f"{what} {path} is corrupt or truncated (checksum mismatch); nothing was changed",
            code="D007",
        )
    return data


def load_checkpoint(run_dir: Path, rel: str, sha: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    data = read_checkpoint(run_dir, rel, sha)
    try:
        return load(data)
    except Exception as e:
        raise RunDirError(f"checkpoint {run_dir / rel} is unreadable ({e})", code="D007") from None


# ---- the workers' payload (lmpm.runtime.data.store writes it; the log holds metadata only) -------------
def checkpoint_shards(run_dir: Path, rel: str) -> dict[str, dict[str, Any]]:
    """The worker shards a control checkpoint names: worker -> {file, bytes, sha256}."""
    from safetensors import safe_open

    try:
        with safe_open(str(run_dir / rel), framework="numpy") as f:
            meta = f.metadata() or {}
        return dict(json.loads(meta.get("shards", "{}")))
    except Exception as e:
        raise RunDirError(f"checkpoint {run_dir / rel} is unreadable ({e})", code="D007") from None


def worker_file(worker: str) -> str:
    """A worker's name as a file name ("cpu:0" -> "cpu-0")."""
    import re

    return re.sub(r"[^A-Za-z0-9_.-]", "-", worker)


def store_path(run_dir: str | Path, worker: str) -> Path:
    return Path(run_dir) / STORE_DIR / f"{worker_file(worker)}.db"


def _store_rows(run_dir: str | Path, worker: str, query: str, args: tuple[Any, ...]) -> list[Any]:
    path = store_path(run_dir, worker)
    if not path.is_file():
        return []
    try:
        conn = sqlite3.connect(f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro", uri=True)
        try:
            return conn.execute(query, args).fetchall()
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise RunDirError(f"the payload store {path} is unreadable ({e})", code="D006") from None


def read_cell_payload(
    run_dir: str | Path, worker: str, value: str, cell: int
) -> dict[int, np.ndarray]:
    """epoch -> the payload ``cell`` of ``value`` committed in that epoch (``lmpm trace --cell``)."""
    out: dict[int, np.ndarray] = {}
    rows = _store_rows(
        run_dir,
        worker,
        "SELECT epoch, first, step, count, payload FROM rows WHERE value = ? AND first <= ? "
        "ORDER BY epoch",
        (value, cell),
    )
    for e, first, step, count, payload in rows:
        j, r = divmod(cell - first, step)
        if r == 0 and j < count:
            out[int(e)] = decode(payload).reshape(count, -1)[j]
    return out


def read_candidates(
    run_dir: str | Path, worker: str, value: str, cell: int
) -> dict[tuple[int, int], np.ndarray]:
    """(epoch, column) -> the recorded candidate payload of ``cell`` (``--trace cells``)."""
    rows = _store_rows(
        run_dir,
        worker,
        "SELECT epoch, col, payload FROM candidates WHERE value = ? AND cell = ?",
        (value, cell),
    )
    return {(int(e), int(col)): decode(payload) for e, col, payload in rows}


def ruleset_events(conn: sqlite3.Connection) -> list[tuple[int, str, str, int, str]]:
    """The RuleSet events (epoch, op, name, clock, by) in the order they were committed (none in
    a log written before RuleSet events existed)."""
    has = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'ruleset_events'"
    ).fetchone()
    if not has:
        return []
    rows = conn.execute("SELECT epoch, op, name, clock, by FROM ruleset_events ORDER BY seq")
    return [(int(e), str(op), str(n), int(c), str(b)) for e, op, n, c, b in rows]


def worker_faults(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The worker faults a multi-worker run survived, in order: the epoch redone, the worker, the
    phase, the cause (died, hung, blocked on a dead peer), the seconds lost, the failed process
    (none in a log written before faults were logged)."""
    has = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'worker_faults'"
    ).fetchone()
    if not has:
        return []
    rows = conn.execute(
        "SELECT epoch, worker, phase, cause, seconds, pid FROM worker_faults ORDER BY seq"
    )
    return [
        {
            "epoch": int(e),
            "worker": str(w),
            "phase": str(p),
            "cause": str(c),
            "seconds": float(s),
            "pid": int(pid),
        }
        for e, w, p, c, s, pid in rows
    ]


def quorum_dissent(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The quorum replicas outvoted, in order: the epoch, the value, the replica, the worker that
    ran it and the committed cells where its proposal differed from the committed payload (none
    in a log written before dissent was logged)."""
    has = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'quorum_dissent'"
    ).fetchone()
    if not has:
        return []
    rows = conn.execute(
        "SELECT epoch, value, replica, worker, cells FROM quorum_dissent ORDER BY seq"
    )
    return [
        {"epoch": int(e), "value": str(v), "replica": int(p), "worker": str(w), "cells": int(c)}
        for e, v, p, w, c in rows
    ]
