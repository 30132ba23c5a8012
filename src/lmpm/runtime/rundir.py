"""The run directory's format, in one module: what `lmpm run` writes and `lmpm trace` reads.

    RUN_DIR/lmpm.db                                          the control plane's commit log
    RUN_DIR/payload/<worker>.db                              a worker's committed payload
    RUN_DIR/checkpoints/epoch-NNNNNNNN.safetensors           the control plane's state
    RUN_DIR/checkpoints/epoch-NNNNNNNN.<worker>.safetensors  a worker's payload shard

This module owns the schemas (:data:`SCHEMA`, :data:`STORE_SCHEMA`) and their version, the blob
codec (:func:`encode`, :func:`decode`), commit rows as arithmetic runs of cells
(:func:`commit_rows`), the checkpoint files (:func:`checkpoint_file`, the deterministic
:func:`safetensors_bytes`, :func:`read_checkpoint`), opening and validating the log, and the reads
``lmpm trace`` makes (the log's tables, the workers' stores). The writers are
:mod:`lmpm.runtime.control.commitlog` (the log) and :mod:`lmpm.runtime.data.store` (a worker's payload);
the reader is :mod:`lmpm.runtime.control.trace`. It imports SQLite, numpy and safetensors only, no torch:
``lmpm trace`` starts in a fraction of a second. Every fault is a
:class:`~lmpm.errors.RunDirError` saying what is wrong. Tables and blobs: ``docs/trace.md``.

Schema versions: 2 moved the payload out of the log into the workers' stores; 3 added the epoch's
counted costs (``epochs.control_bytes``, ``halo_bytes``, ``driver_cpu_s``). A schema-2 log is read
as it is (those columns are None) and upgraded to 3 when a run resumes it (:func:`upgrade`).

>>> checkpoint_file(20, "cpu:0")
'checkpoints/epoch-00000020.cpu-0.safetensors'
>>> decode(encode(np.arange(3), "H")).tolist()
[0, 1, 2]
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sqlite3
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import load as load_safetensors

from lmpm.errors import RunDirError
from lmpm.printable import printable
from lmpm.runtime.lock import is_io_error, sqlite_error
from lmpm.runtime.received import (
    ReaderConnection,
    Schema,
    check_schema,
    harden,
    open_reader,
    quote,
    uri,
)
from lmpm.runtime.runfiles import (
    check_database,
    folder,
    is_plain_file,
    log_name,
    read_file,
    remove_files,
    write_file,
)

if TYPE_CHECKING:
    from lmpm.runtime.records import EpochRecord, ValueEpoch

SCHEMA_VERSION = 3  # the log schema this version writes
OLDEST_SCHEMA = 2  # the oldest it reads and resumes
DB_NAME = "lmpm.db"
STORE_DIR = "payload"  # the workers' payload stores
CHECKPOINT_DIR = "checkpoints"
SQLITE_HEADER = b"SQLite format 3\x00"
KEEP_RULE = -1  # rule id of the keep-current candidate (column 0) in rule_defs

# The epochs table's columns in insert order: schema 3 appended the last four (NULL in the rows an
# older run wrote), so a table upgraded with ALTER TABLE has the same order as a new one.
EPOCH_COLUMNS = (
    "epoch",
    "open_cells",
    "attempts",
    "candidates",
    "commits",
    "violations",
    "decided",
    "seconds",
    "model_seconds",
    "log_seconds",
    "maskplan",
    "at",
    "control_bytes",  # bytes into and out of the control plane, every message serialised
    "halo_bytes",  # payload bytes moved worker to worker
    "driver_cpu_s",  # the control plane's process CPU time
    "checksum",  # the sum (int64, wrapping) of the committed payloads' checksums
)
COUNTED = {
    "control_bytes": "INTEGER",
    "halo_bytes": "INTEGER",
    "driver_cpu_s": "REAL",
    "checksum": "INTEGER",
}
# The page size of a new log or payload store (an existing one keeps its own). A one-cell epoch
# changes a page of each table it appends to (and of the commits' epoch index), and each changed
# page is a frame of the write-ahead log: 2 KiB pages write and fsync (at the WAL's checkpoints and
# the close) half the bytes of SQLite's default 4 KiB, and wide epochs' rows (a video's tiles) are
# written as fast (1 KiB pages: slower there, little faster for a decode; docs/trace.md)
PAGE_SIZE = 2048
INSERT_COMMIT = "INSERT INTO commits VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
INSERT_EPOCH = f"INSERT INTO epochs ({', '.join(EPOCH_COLUMNS)}) VALUES ({', '.join('?' * len(EPOCH_COLUMNS))})"

# RuleSet events (enable/disable a constraint from an epoch on); logs written before it have none
RULESET_TABLE = (
    "CREATE TABLE IF NOT EXISTS ruleset_events (seq INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, "
    "op TEXT NOT NULL, name TEXT NOT NULL, clock INTEGER NOT NULL, by TEXT NOT NULL, "
    "at REAL NOT NULL)"
)

# Worker faults a multi-worker run survived (lmpm.runtime.data.raygroup.Fault); older logs have none
FAULTS_TABLE = (
    "CREATE TABLE IF NOT EXISTS worker_faults (seq INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, "
    "worker TEXT NOT NULL, phase TEXT NOT NULL, cause TEXT NOT NULL, seconds REAL NOT NULL, "
    "pid INTEGER NOT NULL, at REAL NOT NULL)"
)

# Quorum replicas outvoted (lmpm.runtime.records.Dissent): per epoch, value and replica, the worker
# that ran it and the committed cells where its proposal differed; older logs have none
DISSENT_TABLE = (
    "CREATE TABLE IF NOT EXISTS quorum_dissent (seq INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, "
    "value TEXT NOT NULL, replica INTEGER NOT NULL, worker TEXT NOT NULL, cells INTEGER NOT NULL)"
)

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE value_defs (
  id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, dims TEXT NOT NULL, ncells INTEGER NOT NULL,
  first_id INTEGER NOT NULL, vocab INTEGER, dtype TEXT NOT NULL, policy TEXT NOT NULL);
CREATE TABLE rule_defs (
  id INTEGER PRIMARY KEY, name TEXT NOT NULL, target TEXT, model TEXT, score TEXT, replicas INTEGER);
CREATE TABLE constraint_defs (
  id INTEGER PRIMARY KEY, name TEXT NOT NULL, value TEXT NOT NULL, kind TEXT NOT NULL,
  pred TEXT NOT NULL, priority INTEGER NOT NULL, status TEXT NOT NULL, source TEXT, text TEXT,
  cells INTEGER);
CREATE TABLE epochs (
  epoch INTEGER PRIMARY KEY, open_cells INTEGER NOT NULL, attempts INTEGER NOT NULL,
  candidates INTEGER NOT NULL, commits INTEGER NOT NULL, violations INTEGER NOT NULL,
  decided INTEGER, seconds REAL NOT NULL, model_seconds REAL NOT NULL, log_seconds REAL NOT NULL,
  maskplan TEXT NOT NULL, at REAL NOT NULL, control_bytes INTEGER, halo_bytes INTEGER,
  driver_cpu_s REAL, checksum INTEGER);
CREATE TABLE commits (
  epoch INTEGER NOT NULL, value TEXT NOT NULL, first INTEGER NOT NULL, last INTEGER NOT NULL,
  step INTEGER NOT NULL, count INTEGER NOT NULL, rule INTEGER NOT NULL,
  clock_min INTEGER NOT NULL, clock_max INTEGER NOT NULL, score_min REAL, score_max REAL,
  crc INTEGER NOT NULL, sums BLOB, clocks BLOB, scores BLOB);
CREATE INDEX commits_by_epoch ON commits (epoch);
CREATE TABLE checkpoints (
  epoch INTEGER PRIMARY KEY, file TEXT NOT NULL, bytes INTEGER NOT NULL, sha256 TEXT NOT NULL,
  created REAL NOT NULL);
CREATE TABLE resumes (id INTEGER PRIMARY KEY, at REAL NOT NULL, from_epoch INTEGER NOT NULL,
  argv TEXT);
-- trace_summary WITHOUT ROWID: an epoch's rows touch one b-tree (its key), not a table and an index
CREATE TABLE trace_summary (
  epoch INTEGER NOT NULL, constraint_id INTEGER NOT NULL, rule INTEGER NOT NULL,
  checked INTEGER NOT NULL, violations INTEGER NOT NULL, won INTEGER NOT NULL, lost INTEGER NOT NULL,
  blocked_where TEXT, PRIMARY KEY (epoch, constraint_id, rule)) WITHOUT ROWID;
CREATE TABLE trace_cells (
  epoch INTEGER NOT NULL, value TEXT NOT NULL, cell INTEGER NOT NULL, coord TEXT NOT NULL,
  candidates INTEGER NOT NULL, winner INTEGER NOT NULL, winner_rule INTEGER NOT NULL,
  favourite INTEGER NOT NULL, committed INTEGER NOT NULL, payload, clock INTEGER NOT NULL,
  covered INTEGER NOT NULL, decided_by TEXT, PRIMARY KEY (value, cell, epoch));
CREATE TABLE trace_candidates (
  epoch INTEGER NOT NULL, value TEXT NOT NULL, cell INTEGER NOT NULL, col INTEGER NOT NULL,
  rule INTEGER NOT NULL, payload, score REAL, violated INTEGER NOT NULL,
  PRIMARY KEY (value, cell, epoch, col));
CREATE TABLE ruleset_events (
  seq INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, op TEXT NOT NULL, name TEXT NOT NULL,
  clock INTEGER NOT NULL, by TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE worker_faults (
  seq INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, worker TEXT NOT NULL, phase TEXT NOT NULL,
  cause TEXT NOT NULL, seconds REAL NOT NULL, pid INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE quorum_dissent (
  seq INTEGER PRIMARY KEY, epoch INTEGER NOT NULL, value TEXT NOT NULL, replica INTEGER NOT NULL,
  worker TEXT NOT NULL, cells INTEGER NOT NULL);
CREATE VIEW trace_named AS
  SELECT s.epoch, c.name AS constraint_name, c.priority, r.name AS rule_name, s.checked,
         s.violations, s.won, s.lost, s.blocked_where
  FROM trace_summary s JOIN constraint_defs c ON c.id = s.constraint_id
  LEFT JOIN rule_defs r ON r.id = s.rule;
"""

# The tables a workflow run (`lmpm vm run`, lmpm.vm.log) adds to the log
VM_SCHEMA = """
CREATE TABLE vm_zones (id INTEGER PRIMARY KEY, workflow TEXT NOT NULL, name TEXT NOT NULL);
CREATE TABLE vm_tokens (
  epoch INTEGER NOT NULL, stream INTEGER NOT NULL, pos INTEGER NOT NULL, token INTEGER NOT NULL,
  zone INTEGER NOT NULL, token_num INTEGER NOT NULL, triggers INTEGER NOT NULL,
  kind INTEGER NOT NULL, tags INTEGER NOT NULL, PRIMARY KEY (stream, pos));
CREATE TABLE vm_streams (
  stream INTEGER PRIMARY KEY, status TEXT NOT NULL, decisions TEXT NOT NULL,
  captures TEXT NOT NULL, text TEXT NOT NULL);
"""

# A worker's store: committed payload, one row per arithmetic run of cells (crc: CRC-32 of the
# payload bytes after the type tag), the candidate payloads `--trace cells` asks for and, in a
# multi-worker run, the per-cell rows of the log's tables in :data:`SHARDED` for its cells
STORE_SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (
  epoch INTEGER NOT NULL, value TEXT NOT NULL, first INTEGER NOT NULL, step INTEGER NOT NULL,
  count INTEGER NOT NULL, crc INTEGER NOT NULL, payload BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS rows_by_epoch ON rows (epoch);
CREATE TABLE IF NOT EXISTS candidates (
  epoch INTEGER NOT NULL, value TEXT NOT NULL, cell INTEGER NOT NULL, col INTEGER NOT NULL,
  payload BLOB NOT NULL, PRIMARY KEY (value, cell, epoch, col));
CREATE TABLE IF NOT EXISTS commits (
  epoch INTEGER NOT NULL, value TEXT NOT NULL, first INTEGER NOT NULL, last INTEGER NOT NULL,
  step INTEGER NOT NULL, count INTEGER NOT NULL, rule INTEGER NOT NULL,
  clock_min INTEGER NOT NULL, clock_max INTEGER NOT NULL, score_min REAL, score_max REAL,
  crc INTEGER NOT NULL, sums BLOB, clocks BLOB, scores BLOB);
CREATE INDEX IF NOT EXISTS commits_by_epoch ON commits (epoch);
CREATE TABLE IF NOT EXISTS trace_cells (
  epoch INTEGER NOT NULL, value TEXT NOT NULL, cell INTEGER NOT NULL, coord TEXT NOT NULL,
  candidates INTEGER NOT NULL, winner INTEGER NOT NULL, winner_rule INTEGER NOT NULL,
  favourite INTEGER NOT NULL, committed INTEGER NOT NULL, payload, clock INTEGER NOT NULL,
  covered INTEGER NOT NULL, decided_by TEXT, PRIMARY KEY (value, cell, epoch));
CREATE TABLE IF NOT EXISTS trace_candidates (
  epoch INTEGER NOT NULL, value TEXT NOT NULL, cell INTEGER NOT NULL, col INTEGER NOT NULL,
  rule INTEGER NOT NULL, payload, score REAL, violated INTEGER NOT NULL,
  PRIMARY KEY (value, cell, epoch, col));
"""

# The per-cell tables a multi-worker run's workers write into their own stores (same names and
# columns as the log's); the log keeps the per-epoch rows. See :func:`attach_shards`.
SHARDED = ("commits", "trace_cells", "trace_candidates")
SHARD_FILE = re.compile(r"w(\d+)\.db")  # a group worker's store: payload/w<i>.db


# ---- paths ------------------------------------------------------------------------------------------
def db_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / DB_NAME


def worker_file(worker: str) -> str:
    """A worker's name as a file name ("cpu:0" -> "cpu-0")."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", worker)


def store_path(run_dir: str | Path, worker: str) -> Path:
    return Path(run_dir) / STORE_DIR / f"{worker_file(worker)}.db"


def checkpoint_file(label: int, worker: str | None = None) -> str:
    """The checkpoint of the state at the start of epoch ``label``, relative to the run directory:
    the control plane's, or ``worker``'s payload shard (same prefix, so they are pruned together)."""
    shard = "" if worker is None else f".{worker_file(worker)}"
    return f"{CHECKPOINT_DIR}/epoch-{label:08d}{shard}.safetensors"


def holds_run(run_dir: str | Path) -> bool:
    """True when RUN_DIR contains a run's commit log."""
    return db_path(run_dir).exists()


def unlink_db(path: Path) -> None:
    """Delete an SQLite database and its journal files."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


# The files LMPM writes in a run's folders, by name: deleting a run deletes these and nothing else
# (a user's checkpoints/best.pt stays). A checkpoint, a worker's payload shard, a temporary file of
# either; a worker's store (payload/cpu-0.db, payload/w1.db) and the files SQLite keeps beside it.
CHECKPOINT_NAME = re.compile(r"\.?epoch-\d{8}(\.[A-Za-z0-9_-]+)?\.safetensors(\.tmp)?")
STORE_NAME = re.compile(r"[a-z]+-?\d+\.db(-wal|-shm|-journal)?")


def remove_stores(run_dir: str | Path) -> None:
    """Delete the workers' payload stores LMPM writes (a half-started run's), nothing else."""
    remove_files(Path(run_dir), STORE_DIR, STORE_NAME, drop_empty=True)


def remove_run(run_dir: str | Path) -> None:
    """Delete a run's commit log, payload stores and checkpoints (``--force``): the files LMPM
    names only; a folder is removed when that leaves it empty. Outputs are overwritten later."""
    d = Path(run_dir)
    unlink_db(db_path(d))
    unlink_db(d / f".{DB_NAME}.tmp")
    remove_files(d, CHECKPOINT_DIR, CHECKPOINT_NAME, drop_empty=True)
    remove_stores(d)


# ---- opening the log --------------------------------------------------------------------------------
def _check_header(path: Path) -> None:
    """Refuse a file that is not an SQLite database *before* SQLite opens it: SQLite treats an
    empty or foreign file as a new database and may then discard the ``-wal`` beside it, which
    holds the run's commits. The database and the files beside it must be regular files: SQLite
    follows links (D032)."""
    check_database(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            head = os.read(fd, len(SQLITE_HEADER))
        finally:
            os.close(fd)
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


def connect(
    run_dir: str | Path, *, readonly: bool = True, check: bool = False, durable: bool = False
) -> sqlite3.Connection:
    """Open RUN_DIR's log and validate it: an LMPM database of a schema this version reads.

    ``readonly`` never modifies the database (SQLite may rebuild its ``-shm`` index) and reads a
    multi-worker run's per-cell rows in its workers' stores too (:func:`attach_shards`); ``check``
    also runs ``PRAGMA quick_check``; ``durable`` (writing) fsyncs every transaction. Raises
    :class:`RunDirError` with what is wrong."""
    path = db_path(run_dir)
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} holds no LMPM run (no {DB_NAME})",
            code="D001",
            hint="give the --out directory of an `lmpm run`",
        )
    _check_header(path)  # before SQLite opens it (it would discard the -wal of an empty file)
    if readonly:
        conn: sqlite3.Connection = open_reader(path, log_schema())
    else:
        conn = _open_writer(path)
    try:
        validate(conn, path, check=check)
    except BaseException as e:
        conn.close()
        if isinstance(e, sqlite3.Error):  # an I/O error while validating (validate types the rest)
            raise sqlite_error(e, "open", path) from None
        raise
    if not readonly:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        except sqlite3.Error as e:
            conn.close()
            raise sqlite_error(e, "open for writing", path) from None
        return conn
    try:
        attach_shards(conn, run_dir)
    except BaseException as e:
        conn.close()
        if isinstance(e, sqlite3.Error):
            raise sqlite_error(e, "read the workers' stores of", path) from None
        raise
    return conn


def _open_writer(path: Path) -> sqlite3.Connection:
    """The log opened for writing (a resume): the open-time checks of a reader
    (:func:`~lmpm.runtime.received.harden`, :func:`~lmpm.runtime.received.check_schema`: no trigger
    fires on LMPM's writes), no progress handler on the per-epoch writes."""
    try:
        conn = sqlite3.connect(uri(path, readonly=False), uri=True, isolation_level=None)
    except sqlite3.Error as e:
        raise RunDirError(f"cannot open {path}: {e}", code="D002") from None
    try:
        harden(conn)
        check_schema(conn, path, log_schema())
    except BaseException as e:
        conn.close()
        if isinstance(e, sqlite3.Error) and not is_io_error(e):
            raise RunDirError(
                f"{path} is corrupt or truncated ({e}); nothing was changed", code="D006"
            ) from None
        if isinstance(e, sqlite3.Error):
            raise sqlite_error(e, "open", path) from None
        raise
    return conn


@functools.cache
def log_schema() -> Schema:
    """The tables of a run's log LMPM reads, with their columns (schema 2's epochs lack
    :data:`COUNTED`; a workflow run's log adds :data:`VM_SCHEMA`'s)."""
    return Schema.of(SCHEMA + VM_SCHEMA, optional={"epochs": COUNTED})


@functools.cache
def store_schema() -> Schema:
    """The tables of a worker's payload store, with their columns."""
    return Schema.of(STORE_SCHEMA)


def open_store(path: Path) -> ReaderConnection:
    """A worker's payload store opened for reading (:func:`~lmpm.runtime.received.open_reader`)."""
    return open_reader(path, store_schema())


def shard_stores(run_dir: str | Path) -> list[Path]:
    """The stores of a multi-worker run's workers (``RUN_DIR/payload/w<i>.db``), by index."""
    stores = folder(Path(run_dir), STORE_DIR, action="read")
    if not stores.is_dir():
        return []
    found = []
    for p in stores.iterdir():
        m = SHARD_FILE.fullmatch(p.name)
        if m is not None and is_plain_file(p):
            check_database(p, "read")
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def attach_shards(conn: sqlite3.Connection, run_dir: str | Path) -> int:
    """Let ``conn`` read the log's per-cell tables (:data:`SHARDED`) across the workers' stores;
    the number of stores read.

    A multi-worker run's workers write those rows into their own stores, the log keeps none. Each
    ``RUN_DIR/payload/w<i>.db`` is attached read-only as ``shard0``, ``shard1``, ... and a TEMP view
    of each table's name unites ``main.<table>`` with the stores' rows of the epochs the log holds
    (a worker may have committed an epoch the log never got: a crash between the two steps). An
    unqualified name resolves to the temp schema first, so every query on those tables reads the
    merged rows as it is. A store without a table (an older schema) is left out of its view; no
    view is made for a table no store has, so the log's own rows are read (and written) as before.
    Views have no rowid: order by columns. Past SQLite's limit on attached databases (10 in most
    builds) the rows are copied into TEMP tables instead, one store at a time. Call it outside a
    transaction; undone by :func:`detach_shards`."""
    paths = shard_stores(run_dir)
    if not paths:
        return 0
    # the log's own columns of each table, from LMPM's schema: never names read from a store
    known = log_schema().tables
    tables = {t: known[t] for t in SHARDED if _has_table(conn, t, "main")}
    free = conn.getlimit(sqlite3.SQLITE_LIMIT_ATTACHED) - len(_attached(conn))
    logged = "epoch IN (SELECT epoch FROM main.epochs)"
    if len(paths) <= free:
        parts: dict[str, list[str]] = {
            t: [f"SELECT {_cols(cols)} FROM main.{quote(t)}"] for t, cols in tables.items()
        }
        for k, path in enumerate(paths):
            for t in _attach_store(conn, f"shard{k}", path, tables):
                parts[t].append(
                    f"SELECT {_cols(tables[t])} FROM shard{k}.{quote(t)} WHERE {logged}"
                )
        for t, selects in parts.items():
            if len(selects) > 1:
                conn.execute(f"CREATE TEMP VIEW {quote(t)} AS {' UNION ALL '.join(selects)}")
        return len(paths)
    copied: set[str] = set()
    for path in paths:
        for t in _attach_store(conn, "shard0", path, tables):
            cols = _cols(tables[t])
            if t not in copied:
                conn.execute(f"CREATE TEMP TABLE {quote(t)} AS SELECT {cols} FROM main.{quote(t)}")
                copied.add(t)
            conn.execute(
                f"INSERT INTO temp.{quote(t)} SELECT {cols} FROM shard0.{quote(t)} WHERE {logged}"
            )
        if conn.in_transaction:  # the one Python's sqlite3 opened for the INSERT
            conn.commit()
        conn.execute("DETACH DATABASE shard0")
    if "commits" in copied:
        conn.execute("CREATE INDEX temp.commits_by_epoch ON commits (epoch)")
    return len(paths)


def _cols(cols: tuple[str, ...]) -> str:
    return ", ".join(quote(c) for c in cols)


def _attach_store(
    conn: sqlite3.Connection, name: str, path: Path, tables: Mapping[str, tuple[str, ...]]
) -> list[str]:
    """Attach a worker's store read-only as schema ``name`` (its schema checked as a reader's
    is: :func:`~lmpm.runtime.received.check_schema`): those of ``tables`` it holds."""
    try:
        conn.execute("ATTACH DATABASE ? AS " + name, (uri(path, readonly=True),))
        check_schema(conn, path, store_schema(), name=name)
        return [t for t in tables if _has_table(conn, t, name)]
    except (sqlite3.Error, UnicodeDecodeError) as e:  # (SQLite's message quoting bad bytes)
        if isinstance(e, sqlite3.Error) and is_io_error(e):
            raise sqlite_error(e, "read", path) from None
        raise RunDirError(
            f"the payload store {printable(str(path))} is unreadable ({printable(str(e))})",
            code="D006",
        ) from None


def _attached(conn: sqlite3.Connection) -> list[str]:
    return [str(r[1]) for r in conn.execute("PRAGMA database_list") if r[1] not in ("main", "temp")]


def detach_shards(conn: sqlite3.Connection) -> None:
    """Undo :func:`attach_shards`: drop its TEMP views or tables and detach the stores, so the
    log's tables are written as before (the commit log's connection reads the shards to resume)."""
    for kind, name in conn.execute("SELECT type, name FROM temp.sqlite_master").fetchall():
        if name in SHARDED and kind in ("view", "table"):
            conn.execute(f"DROP {kind.upper()} temp.{name}")
    for name in _attached(conn):
        if re.fullmatch(r"shard\d+", name):
            conn.execute(f"DETACH DATABASE {name}")


def schema_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return -1 if row is None else int(json.loads(row[0]))


def validate(conn: sqlite3.Connection, path: Path, *, check: bool = False) -> None:
    """Raise RunDirError unless ``conn`` is an LMPM log of a schema this version reads."""
    try:
        version = schema_version(conn)
        if version < 0:
            raise RunDirError(
                f"{path} is not an LMPM run database (no schema version)", code="D003"
            )
        if version > SCHEMA_VERSION:
            raise RunDirError(
                f"{path} was written by a newer LMPM (log schema {version}; this version reads "
                f"{OLDEST_SCHEMA} to {SCHEMA_VERSION}); nothing was changed",
                code="D004",
                hint="upgrade lmpm to resume or read this run",
            )
        if version < OLDEST_SCHEMA:
            raise RunDirError(
                f"{path} has log schema {version}; this version reads {OLDEST_SCHEMA} to "
                f"{SCHEMA_VERSION} only (schema 2 moved the payload out of the log into the "
                "workers' stores); nothing was changed",
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


def upgrade(conn: sqlite3.Connection) -> None:
    """Bring a log this version reads to :data:`SCHEMA_VERSION` (a resume, in the caller's
    transaction): the tables later versions added, and schema 3's counted epoch columns (NULL in
    the epochs logged before)."""
    conn.execute(RULESET_TABLE)  # a log written before RuleSet events existed
    conn.execute(FAULTS_TABLE)  # ... or before worker faults were logged
    conn.execute(DISSENT_TABLE)  # ... or before quorum dissent was
    have = _columns(conn, "epochs")
    for name, kind in COUNTED.items():
        if name not in have:
            conn.execute(f"ALTER TABLE epochs ADD COLUMN {name} {kind}")
    conn.execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version'", (json.dumps(SCHEMA_VERSION),)
    )


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    """``table``'s columns in order (none when it has none); ``schema.table`` reads that schema's."""
    schema, _, name = table.rpartition(".")
    pragma = f"PRAGMA {schema}.table_info({name})" if schema else f"PRAGMA table_info({name})"
    return [str(r[1]) for r in conn.execute(pragma)]


def _has_table(conn: sqlite3.Connection, name: str, schema: str = "main") -> bool:
    """Whether ``schema`` (LMPM's name: main, temp, shardK) holds a table ``name``."""
    return bool(
        conn.execute(
            f"SELECT 1 FROM {schema}.sqlite_master WHERE type = 'table' AND name = ?", (name,)
        ).fetchone()
    )


# ---- reading the log --------------------------------------------------------------------------------
def read_meta(conn: sqlite3.Connection) -> dict[str, Any]:
    try:
        return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    except (sqlite3.Error, ValueError) as e:
        raise RunDirError(f"the run's metadata is unreadable ({e})", code="D006") from None


def completed_epochs(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT max(epoch) FROM epochs").fetchone()
    return 0 if row[0] is None else int(row[0]) + 1


def epoch_rows(conn: sqlite3.Connection, columns: tuple[str, ...]) -> list[dict[str, Any]]:
    """The ``epochs`` rows in order, each ``columns`` -> its value (None for a column the log's
    schema lacks: the counted costs of a schema-2 run)."""
    have = set(_columns(conn, "epochs"))
    picked = [c for c in columns if c in have]
    rows = conn.execute(f"SELECT {', '.join(picked)} FROM epochs ORDER BY epoch")
    return [{c: dict(zip(picked, r)).get(c) for c in columns} for r in rows]


def ruleset_events(conn: sqlite3.Connection) -> list[tuple[int, str, str, int, str]]:
    """The RuleSet events (epoch, op, name, clock, by) in the order they were committed (none in
    a log written before RuleSet events existed)."""
    if not _has_table(conn, "ruleset_events"):
        return []
    rows = conn.execute("SELECT epoch, op, name, clock, by FROM ruleset_events ORDER BY seq")
    return [(int(e), str(op), str(n), int(c), str(b)) for e, op, n, c, b in rows]


def worker_faults(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The worker faults a multi-worker run survived, in order: the epoch redone, the worker, the
    phase, the cause (died, hung, blocked on a dead peer), the seconds lost, the failed process
    (none in a log written before faults were logged)."""
    if not _has_table(conn, "worker_faults"):
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
    if not _has_table(conn, "quorum_dissent"):
        return []
    rows = conn.execute(
        "SELECT epoch, value, replica, worker, cells FROM quorum_dissent ORDER BY seq"
    )
    return [
        {"epoch": int(e), "value": str(v), "replica": int(p), "worker": str(w), "cells": int(c)}
        for e, v, p, w, c in rows
    ]


# ---- reading the workers' stores --------------------------------------------------------------------
def _store_rows(run_dir: str | Path, worker: str, query: str, args: tuple[Any, ...]) -> list[Any]:
    path = folder(Path(run_dir), STORE_DIR, action="read") / store_path(run_dir, worker).name
    if not path.is_file():
        return []
    check_database(path, "read")
    try:
        with open_store(path) as conn:
            return conn.execute(query, args).fetchall()
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


# ---- arrays in blobs --------------------------------------------------------------------------------
# A blob is one tag byte (a numpy type character) followed by the little-endian array.
TAGS = {"B": "<u1", "H": "<u2", "I": "<u4", "q": "<i8", "f": "<f4", "d": "<f8"}


def encode(arr: np.ndarray, tag: str) -> bytes:
    return tag.encode() + np.ascontiguousarray(arr, dtype=TAGS[tag]).tobytes()


def decode(blob: bytes) -> np.ndarray:
    tag = chr(blob[0])
    if tag not in TAGS:
        raise RunDirError(f"a commit-log blob has an unknown type tag {tag!r}", code="D006")
    return np.frombuffer(blob, dtype=TAGS[tag], offset=1)


def uint_tag(top: int) -> str:
    """The smallest unsigned type that holds 0..top."""
    return "B" if top < 1 << 8 else "H" if top < 1 << 16 else "I" if top < 1 << 32 else "q"


def payload_tag(vocab: int | None) -> str:
    """Tokens in the smallest unsigned type that holds the vocabulary; numbers as float32."""
    return "f" if vocab is None else uint_tag(vocab - 1)


def cell_runs(cells: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split sorted cell ids into arithmetic runs with one ``key`` each: (starts, counts, steps).

    The step is the most common gap (1 for dense commits, 2 for a red-black schedule), so a commit
    of a whole tile is a handful of rows, not one row per cell. Vectorized: no loop per cell.
    """
    m = cells.size
    if m == 1:
        return np.zeros(1, np.int64), np.ones(1, np.int64), np.ones(1, np.int64)
    gap = np.diff(cells)
    top = int(gap.max())
    if top <= 4 * m:
        step = int(np.bincount(gap).argmax())
    else:
        vals, cnt = np.unique(gap, return_counts=True)
        step = int(vals[cnt.argmax()])
    brk = (gap != step) | (key[1:] != key[:-1])
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    counts = np.diff(np.append(starts, m))
    steps = np.where(counts > 1, step, 1)
    return starts, counts, steps


def commit_rows(record: EpochRecord) -> list[tuple[Any, ...]]:
    """The ``commits`` rows of one epoch: one per arithmetic run of cells with one winning rule.
    ``sums``: the committed payloads' checksums (int64, from the worker); ``crc``: their CRC-32."""
    out: list[tuple[Any, ...]] = []
    e = record.epoch
    for ve in record.values:
        rows = np.flatnonzero(ve.changed.cpu().numpy())
        if rows.size == 1:  # one cell (a decode's epoch): its row without the run splitting
            out.append(_one_commit(e, ve, int(rows[0])))
        elif rows.size:
            out.extend(_commit_runs(e, ve, rows))
    return out


def _commit_runs(e: int, ve: ValueEpoch, rows: np.ndarray) -> list[tuple[Any, ...]]:
    """:func:`commit_rows` of the record rows ``rows`` of one value."""
    out: list[tuple[Any, ...]] = []
    win = ve.winner.cpu().numpy()[rows]
    cells = ve.cells.cpu().numpy()[rows]
    rule = ve.col_rule.cpu().numpy()[win]
    clock = ve.new_clock.cpu().numpy()[rows]
    score = ve.score.cpu().numpy()[rows, win]
    sums = np.zeros(rows.size, np.int64) if ve.checksum is None else ve.checksum.cpu().numpy()[rows]
    starts, counts, steps = cell_runs(cells, rule)
    ends = starts + counts
    run_of = np.repeat(np.arange(starts.size), counts)
    cmin = np.minimum.reduceat(clock, starts)
    cmax = np.maximum.reduceat(clock, starts)
    smin = np.minimum.reduceat(score, starts)
    smax = np.maximum.reduceat(score, starts)
    kraw = np.ascontiguousarray(sums, dtype="<i8").tobytes()
    delta = clock - cmin[run_of]
    ctag = uint_tag(int(delta.max()) + 1)
    craw = np.ascontiguousarray(delta, dtype=TAGS[ctag]).tobytes()
    cw = np.dtype(TAGS[ctag]).itemsize
    sraw = np.ascontiguousarray(score, dtype="<f8").tobytes()
    ct = ctag.encode()
    for s, n, st, c0, c1, s0, s1, end in zip(
        starts.tolist(),
        counts.tolist(),
        steps.tolist(),
        cmin.tolist(),
        cmax.tolist(),
        smin.tolist(),
        smax.tolist(),
        ends.tolist(),
    ):
        k = kraw[s * 8 : end * 8]
        out.append(
            (
                e,
                ve.value,
                int(cells[s]),
                int(cells[end - 1]),
                st,
                n,
                int(rule[s]),
                c0,
                c1,
                s0,
                s1,
                zlib.crc32(k),
                b"q" + k,
                None if c0 == c1 else ct + craw[s * cw : end * cw],
                None if s0 == s1 else b"d" + sraw[s * 8 : end * 8],
            )
        )
    return out


def _one_commit(e: int, ve: ValueEpoch, r: int) -> tuple[Any, ...]:
    """:func:`commit_rows`' row of the one cell (record row ``r``) ``ve`` committed: the same row
    its general path writes for a run of one cell (checked by the tests against it)."""
    # (NumPy views of the host tensors: a tensor's scalar index costs several µs each)
    w = int(ve.winner.cpu().numpy()[r])
    sum_ = 0 if ve.checksum is None else int(ve.checksum.cpu().numpy()[r])
    return one_commit_row(
        e,
        ve.value,
        int(ve.cells.cpu().numpy()[r]),
        int(ve.col_rule.cpu().numpy()[w]),
        int(ve.new_clock.cpu().numpy()[r]),
        float(ve.score.cpu().numpy()[r, w]),
        sum_,
    )


def one_commit_row(
    e: int, value: str, cell: int, rule: int, clock: int, score: float, sum_: int
) -> tuple[Any, ...]:
    """The ``commits`` row of one cell committed alone in epoch ``e``, from its numbers (its
    winning rule, clock after the epoch, score, payload checksum): the row :func:`commit_rows`'
    general path writes for a run of one cell."""
    k = sum_.to_bytes(8, "little", signed=True)
    # (a NaN score is not equal to itself: written as its blob, as the general path does)
    scores = None if score == score else b"d" + struct.pack("<d", score)
    return (
        e,
        value,
        cell,
        cell,
        1,
        1,
        rule,
        clock,
        clock,
        score,
        score,
        zlib.crc32(k),
        b"q" + k,
        None,
        scores,
    )


# ---- checkpoints ------------------------------------------------------------------------------------
_ST_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
}


def safetensors_bytes(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """The safetensors file of ``arrays``, byte-for-byte the same for the same arrays: tensors in
    name order, the header's keys sorted (``safetensors.numpy.save`` orders the metadata by a hash
    map, so two identical runs' checkpoints differed in their sha256). Readable by safetensors."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": _ST_DTYPES[a.dtype.name],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return len(head).to_bytes(8, "little") + head + b"".join(chunks)


def write_checkpoint_file(
    run_dir: Path, rel: str, data: bytes, sync: bool = True
) -> tuple[str, int, str]:
    """Write a checkpoint file beside, fsync (unless ``sync`` is False), rename: (file, bytes,
    sha256)."""
    write_file(run_dir, rel, data, sync=sync)  # checkpoints/ a real folder of the run, no link
    return rel, len(data), hashlib.sha256(data).hexdigest()


def read_checkpoint(
    run_dir: Path, rel: str, sha: str, what: str = "checkpoint", size: int | None = None
) -> bytes:
    """A checkpoint file's bytes, checked against the sha256 (and ``size``, when known) the log or
    a control checkpoint recorded for it; RunDirError D007 when it is missing, truncated or
    altered. ``rel`` comes from the log: a plain name under ``checkpoints/`` (D033), a regular
    file no larger than recorded (D032), read only then."""
    rel = log_name(rel, CHECKPOINT_DIR)
    path = run_dir / rel
    try:
        data = read_file(run_dir, rel, limit=None if size is None else int(size))
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


def load_checkpoint(
    run_dir: Path, rel: str, sha: str, what: str = "checkpoint", size: int | None = None
) -> dict[str, np.ndarray]:
    """The arrays of a checkpoint file, checked as :func:`read_checkpoint` checks it."""
    data = read_checkpoint(run_dir, rel, sha, what, size)
    try:
        return load_safetensors(data)
    except Exception as e:
        raise RunDirError(f"{what} {run_dir / rel} is unreadable ({e})", code="D007") from None


def checkpoint_shards(run_dir: Path, rel: str) -> dict[str, dict[str, Any]]:
    """The worker shards a control checkpoint names: worker -> {file, bytes, sha256}, each entry
    checked to be one (D007); the file is read as :func:`read_checkpoint` reads it."""
    rel = log_name(rel, CHECKPOINT_DIR)
    try:
        data = read_file(run_dir, rel)
    except OSError as e:
        raise RunDirError(
            f"checkpoint {run_dir / rel} is missing ({e.strerror}); nothing was changed",
            code="D007",
        ) from None
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        shards = json.loads(header.get("__metadata__", {}).get("shards", "{}"))
        ok = isinstance(shards, dict) and all(
            isinstance(s, dict)
            and isinstance(s.get("file"), str)
            and isinstance(s.get("sha256"), str)
            and isinstance(s.get("bytes", 0), int)
            for s in shards.values()
        )
    except (ValueError, AttributeError, TypeError) as e:
        raise RunDirError(f"checkpoint {run_dir / rel} is unreadable ({e})", code="D007") from None
    if not ok:
        raise RunDirError(
            f"checkpoint {run_dir / rel} names its workers' shards in an unknown form",
            code="D007",
        )
    return dict(shards)
