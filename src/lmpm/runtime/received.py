"""Opening an SQLite database of a run directory: the log is data, never code.

A run directory may come from anyone (a colleague's ``runs/…``, a CI artefact), so LMPM treats
every database in it as SQLite's "Defense Against the Dark Arts" says to treat an untrusted one
(``docs/security.md``):

- ``PRAGMA trusted_schema=OFF`` and, where Python's sqlite3 can set it (3.12+), the defensive flag:
  the schema's views, triggers and indexes cannot call functions with side effects;
- the schema is checked before any query (:func:`check_schema`): no triggers at all, and every
  table LMPM reads is a table (not a view) holding the columns LMPM writes. LMPM's SQL names only
  the tables and columns of its own schemas (:class:`Schema`), never a name read from a database;
- a reader's connection (:func:`open_reader`) has a progress handler: SQLite's work on it is
  bounded by a time budget (:data:`READ_SECONDS`, ``LMPM_READ_SECONDS`` to change it; RunDirError
  D041 past it), and Ctrl-C interrupts a running query within milliseconds (KeyboardInterrupt).

A connection LMPM writes (the run's own log, a worker's store on resume) gets the same open-time
checks (:func:`harden`) but no progress handler: the per-epoch write path is unchanged.

>>> import tempfile, pathlib
>>> db = pathlib.Path(tempfile.mkdtemp()) / "x.db"
>>> s = Schema.of("CREATE TABLE t (a INTEGER, b TEXT);")
>>> _ = sqlite3.connect(db).executescript("CREATE TABLE t (a INTEGER, b TEXT); INSERT INTO t VALUES (1, 'x');")
>>> with open_reader(db, s) as conn:
...     conn.execute("SELECT a, b FROM t").fetchall()
[(1, 'x')]
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import urllib.parse
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmpm.errors import RunDirError
from lmpm.printable import printable

READ_SECONDS = 10.0  # SQLite work allowed on one reader's connection (a crafted view spins forever)
READ_SECONDS_ENV = "LMPM_READ_SECONDS"  # overrides READ_SECONDS (seconds, a positive number)
PROGRESS_STEPS = 1000  # SQLite VM instructions between two calls of the progress handler (~µs)
_GAP = 0.25  # a longer pause between two calls is Python's work between queries, not SQLite's


@dataclass(frozen=True, slots=True)
class Schema:
    """The tables LMPM reads in one kind of database: name -> the columns it needs, in order."""

    tables: Mapping[str, tuple[str, ...]]

    @staticmethod
    def of(ddl: str, optional: Mapping[str, Iterable[str]] | None = None) -> Schema:
        """The tables ``ddl`` creates (run in a memory database), less the ``optional`` columns
        (per table) that older schemas lack."""
        mem = sqlite3.connect(":memory:")
        try:
            mem.executescript(ddl)
            names = [
                str(r[0]) for r in mem.execute("SELECT name FROM sqlite_master WHERE type='table'")
            ]
            skip = {t: set(cols) for t, cols in (optional or {}).items()}
            tables = {
                t: tuple(
                    str(r[0])
                    for r in mem.execute("SELECT name FROM pragma_table_info(?)", (t,))
                    if r[0] not in skip.get(t, ())
                )
                for t in names
            }
        finally:
            mem.close()
        return Schema(tables)

    def __or__(self, other: Schema) -> Schema:
        return Schema({**self.tables, **other.tables})


def quote(name: str) -> str:
    """An SQL identifier LMPM generates, quoted (``"a""b"``)."""
    return '"' + name.replace('"', '""') + '"'


def read_seconds() -> float:
    """The time budget of a reader's connection: ``LMPM_READ_SECONDS`` or :data:`READ_SECONDS`."""
    raw = os.environ.get(READ_SECONDS_ENV)
    if raw is None:
        return READ_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        from lmpm.errors import UsageError

        raise UsageError(
            f"{READ_SECONDS_ENV}={raw!r} is not a positive number of seconds", code="U048"
        )
    return seconds


class Budget:
    """The progress handler: adds up the time SQLite spends in queries and stops it (returns 1)
    past ``seconds``. A KeyboardInterrupt raised in it (Ctrl-C) also stops the query: SQLite then
    reports "interrupted" and :func:`translate` raises the KeyboardInterrupt again."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy = 0.0  # seconds spent inside SQLite so far
        self.last = time.monotonic()
        self.tripped = False

    def __call__(self) -> int:
        now = time.monotonic()
        gap, self.last = now - self.last, now
        if gap < _GAP:
            self.busy += gap
        if self.busy > self.seconds:
            self.tripped = True
            return 1
        return 0


def _translate(conn: Any, e: sqlite3.Error) -> BaseException:
    """The error a reader raises for ``e``: the budget's (D041), Ctrl-C's, or ``e`` itself."""
    budget = getattr(conn, "budget", None)
    if not (isinstance(e, sqlite3.OperationalError) and str(e) == "interrupted"):
        return e
    if budget is not None and budget.tripped:
        return RunDirError(
            f"reading {printable(str(conn.path))} took more than {budget.seconds:g} s of SQLite "
            "work and was stopped; a log LMPM wrote reads in far less (a crafted view or query "
            "loop?); nothing was changed",
            code="D041",
            hint=f"if the run is genuinely that large, set {READ_SECONDS_ENV} to more seconds",
        )
    return KeyboardInterrupt()


class ReaderCursor(sqlite3.Cursor):
    """A cursor whose SQLite errors are translated (:func:`_translate`)."""

    def execute(self, sql: str, parameters: Any = (), /) -> ReaderCursor:
        try:
            super().execute(sql, parameters)
        except sqlite3.Error as e:
            raise _translate(self.connection, e) from None
        return self

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.Error as e:
            raise _translate(self.connection, e) from None

    def fetchmany(self, size: int | None = None) -> list[Any]:
        try:
            return super().fetchmany(self.arraysize if size is None else size)
        except sqlite3.Error as e:
            raise _translate(self.connection, e) from None

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.Error as e:
            raise _translate(self.connection, e) from None

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.Error as e:
            raise _translate(self.connection, e) from None

    def __iter__(self) -> ReaderCursor:
        return self


class ReaderConnection(sqlite3.Connection):
    """A read-only connection with a :class:`Budget` (see :func:`open_reader`)."""

    budget: Budget
    path: Path

    def cursor(self, factory: Any = ReaderCursor) -> Any:  # type: ignore[override]
        return super().cursor(factory)

    def execute(self, sql: str, parameters: Any = (), /) -> ReaderCursor:  # type: ignore[override]
        cur: ReaderCursor = self.cursor()
        return cur.execute(sql, parameters)

    def __enter__(self) -> ReaderConnection:
        return self

    def __exit__(self, *exc: object) -> None:  # type: ignore[override]
        self.close()


# What reading a row LMPM never wrote raises in code that trusts the schema's types: a TEXT where
# an INTEGER was, a JSON that is not LMPM's, a blob cut short, an index out of a table's range
MALFORMED = (
    TypeError,
    ValueError,  # json.JSONDecodeError, UnicodeDecodeError, int("x"), a short unpacking
    KeyError,
    IndexError,
    AttributeError,
    OverflowError,
    ZeroDivisionError,
    RecursionError,
    zlib.error,
    sqlite3.DatabaseError,  # a damaged page met while reading rows (the budget's are translated)
)


@contextlib.contextmanager
def interpreting(path: str | Path, what: str = "read") -> Iterator[None]:
    """Turn the errors of code interpreting rows of the database at ``path`` (:data:`MALFORMED`)
    into RunDirError D043: a received log can hold any value of any type in any column; the
    readers (``lmpm trace``, ``vm status``, resume's restore) report it, coded, never as an
    internal error."""
    try:
        yield
    except MALFORMED as e:
        raise RunDirError(
            f"cannot {what} {printable(str(path))}: it holds a value LMPM never writes "
            f"({type(e).__name__}: {printable(str(e))[:200]}); nothing was changed",
            code="D043",
            hint="ask for the run directory as `lmpm run` wrote it, or start a new run",
        ) from None


def harden(conn: sqlite3.Connection) -> None:
    """Turn off what lets a database's schema run code: ``trusted_schema`` and, on Python 3.12+,
    SQLite's defensive flag (no writes to the schema tables, no corrupting pragmas)."""
    conn.execute("PRAGMA trusted_schema=OFF")
    setconfig = getattr(conn, "setconfig", None)
    flag = getattr(sqlite3, "SQLITE_DBCONFIG_DEFENSIVE", None)
    if setconfig is not None and flag is not None:  # Python >= 3.12
        setconfig(flag, True)


def check_schema(
    conn: sqlite3.Connection, path: Path, schema: Schema, *, name: str = "main"
) -> None:
    """Refuse (D040) a database whose schema ``name`` holds a trigger, a view in place of one of
    ``schema``'s tables, or one of them without its columns. Views of other names are never read."""
    try:
        rows = conn.execute(
            f"SELECT type, name FROM {name}.sqlite_master WHERE type IN ('trigger', 'view', 'table')"
        ).fetchall()
    except UnicodeDecodeError:  # SQLite's message quotes the damaged schema's bytes, not UTF-8
        raise RunDirError(
            f"{printable(str(path))} is corrupt: its schema cannot be parsed; nothing was changed",
            code="D006",
        ) from None

    def refuse(what: str) -> RunDirError:
        return RunDirError(
            f"{printable(str(path))} {what}; LMPM never writes one, so the file was made or "
            "changed by something else and is not read; nothing was changed",
            code="D040",
            hint="ask for the run directory as `lmpm run` wrote it, or start a new run",
        )

    for kind, obj in rows:
        obj = str(obj)
        if kind == "trigger":
            raise refuse(f"holds a trigger ({printable(obj)!r})")
        if kind == "view" and obj in schema.tables:
            raise refuse(f"has a view in place of the table {obj!r}")
        if kind == "table" and obj in schema.tables:
            have = {
                str(r[0])
                for r in conn.execute("SELECT name FROM pragma_table_info(?, ?)", (obj, name))
            }
            missing = [c for c in schema.tables[obj] if c not in have]
            if missing:
                raise refuse(f"has a table {obj!r} without the column(s) {', '.join(missing)}")


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def uri(path: Path, *, readonly: bool) -> str:
    return f"file:{urllib.parse.quote(str(path.resolve()))}" + ("?mode=ro" if readonly else "")


def open_reader(path: Path, schema: Schema, *, seconds: float | None = None) -> ReaderConnection:
    """Open the database at ``path`` read-only, hardened (:func:`harden`), its schema checked
    (:func:`check_schema`), with a :class:`Budget` of ``seconds`` (:func:`read_seconds`) of SQLite
    work. The one way LMPM opens a database it reads; usable as a context manager."""
    budget = Budget(read_seconds() if seconds is None else seconds)
    try:
        conn = sqlite3.connect(
            uri(path, readonly=True),
            uri=True,
            isolation_level=None,
            factory=ReaderConnection,
        )
    except sqlite3.Error as e:
        raise RunDirError(f"cannot open {printable(str(path))}: {e}", code="D002") from None
    assert isinstance(conn, ReaderConnection)
    conn.budget, conn.path = budget, path
    conn.text_factory = _text  # TEXT that is not UTF-8 (LMPM writes only UTF-8): shown, not fatal
    conn.set_progress_handler(budget, PROGRESS_STEPS)
    try:
        harden(conn)
        check_schema(conn, path, schema)
    except BaseException as e:
        conn.close()
        if isinstance(e, sqlite3.DatabaseError):
            raise RunDirError(
                f"{printable(str(path))} is corrupt or not an SQLite database ({e}); nothing was "
                "changed",
                code="D006",
            ) from None
        raise
    return conn
