"""Reading a run's commit log (RUN_DIR/lmpm.db) with SQLite alone: no torch, no engine.

`lmpm trace` and `lmpm render` start in a fraction of a second because they read the log through
this module; :mod:`lmpm.runtime.commitlog` (the writing side, which needs the engine) re-uses the
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

SCHEMA_VERSION = 1  # the log schema this version reads (lmpm.runtime.commitlog writes it)
DB_NAME = "lmpm.db"

# A blob is one tag byte (a numpy type character) followed by the little-endian array.
TAGS = {"B": "<u1", "H": "<u2", "I": "<u4", "q": "<i8", "f": "<f4", "d": "<f8"}


def db_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / DB_NAME


def connect(run_dir: str | Path, *, check: bool = False) -> sqlite3.Connection:
    """Open RUN_DIR's log read-only and validate it (``check`` also runs ``quick_check``)."""
    path = db_path(run_dir)
    if not path.is_file():
        raise RunDirError(
            f"{run_dir} holds no LMPM run (no {DB_NAME})",
            code="D001",
            hint="give the --out directory of an `lmpm run`",
        )
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    except sqlite3.Error as e:
        raise RunDirError(f"cannot open {path}: {e}", code="D002") from None
    try:
        validate(conn, path, check=check)
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
                hint="upgrade lmpm to resume or inspect this run",
            )
        if version < SCHEMA_VERSION:
            raise RunDirError(
                f"{path} has log schema {version}; this version reads {SCHEMA_VERSION} only",
                code="D005",
            )
        if check:
            bad = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall() if r[0] != "ok"]
            if bad:
                raise RunDirError(f"{path} is corrupt: {bad[0]}; nothing was changed", code="D006")
    except RunDirError:
        raise
    except (sqlite3.Error, ValueError) as e:
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


def load_checkpoint(run_dir: Path, rel: str, sha: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    path = run_dir / rel
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RunDirError(
            f"checkpoint {path} is missing ({e.strerror}); nothing was changed", code="D007"
        ) from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise RunDirError(
            f"checkpoint {path} is corrupt or truncated (checksum mismatch); nothing was changed",
            code="D007",
        )
    try:
        return load(data)
    except Exception as e:
        raise RunDirError(f"checkpoint {path} is unreadable ({e})", code="D007") from None
