"""An exclusive lock per run directory, and the translation of OS failures into RunDirErrors.

Every process that writes a run directory (``lmpm run --out D``, ``--resume D``, ``--force``) takes
``D/lmpm.lock`` with ``flock(LOCK_EX | LOCK_NB)`` before it reads or changes anything and holds it
for the run's life; the OS releases it when the process dies, even by ``kill -9``, so a stale lock
file never blocks anyone. The file holds the owner's PID, which the refusal names. Readers
(``lmpm trace``) take no lock: SQLite's WAL lets them read a live run. The lock file is opened as
:mod:`lmpm.runtime.runfiles` opens every file of a run (a link in its place is refused, D032), and
a writer that may create a run first refuses a folder of other files (D034).

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> with RunLock(d):
...     pass
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from pathlib import Path
from types import TracebackType

from lmpm.errors import RunDirError
from lmpm.runtime.runfiles import atomic_write as atomic_write
from lmpm.runtime.runfiles import claim_folder, open_lock
from lmpm.runtime.runfiles import fsync_dir as fsync_dir
from lmpm.runtime.runfiles import os_error as os_error

LOCK_NAME = "lmpm.lock"

MSG_LOCKED = (
    "{dir} is in use by a live run (pid {pid}, `{argv}`); refusing to {what} it while that run is "
    "alive. Wait for it to finish or stop it (kill {pid}), or use another --out directory."
)


def sqlite_error(e: sqlite3.Error, action: str, path: str | Path) -> RunDirError:
    """A RunDirError for a failed write of the commit log (disk full, read-only, I/O error)."""
    name = getattr(e, "sqlite_errorname", "") or type(e).__name__
    hint = None
    free = _free_bytes(Path(path).parent)
    if free is not None and free < 1 << 20 and not name.startswith("SQLITE_READONLY"):
        name += f"; the filesystem is full: {free:,} bytes free"
    if name.startswith(("SQLITE_FULL", "SQLITE_IOERR")):
        hint = "free space, then `lmpm run --resume` the directory: committed epochs are kept"
    elif name.startswith("SQLITE_READONLY"):
        hint = "give an --out directory you can write"
    return RunDirError(f"cannot {action} {path}: {e} ({name})", code="D031", hint=hint)


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def is_io_error(e: sqlite3.Error) -> bool:
    """SQLite failed to read or write the disk (full, read-only, I/O): not a damaged database."""
    name = getattr(e, "sqlite_errorname", "") or ""
    return name.startswith(("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_READONLY", "SQLITE_CANTOPEN"))


class RunLock:
    """``flock`` on ``RUN_DIR/lmpm.lock``, held until :meth:`release` (or the process ends)."""

    def __init__(
        self, run_dir: str | Path, *, what: str = "write", create_dir: bool = True
    ) -> None:
        self.run_dir = Path(run_dir)
        self.what = what  # for the refusal: "write", "resume", "delete (--force)"
        self.create_dir = create_dir
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(
                f"cannot use {self.run_dir} as a run directory: it is a file, not a directory "
                "(ENOTDIR)",
                code="D030",
                hint="--out must name a directory (it is created if missing)",
            )
        if self.create_dir:
            claim_folder(self.run_dir)  # never a folder of the user's own files (D034)
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise os_error(e, "create the run directory", self.run_dir) from None
        fd = open_lock(self.run_dir / LOCK_NAME)  # a regular file, no link followed (D032)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip().split("\n", 1)
            os.close(fd)
            pid = owner[0] or "?"
            argv = owner[1] if len(owner) > 1 else "lmpm run"
            raise RunDirError(
                MSG_LOCKED.format(dir=self.run_dir, pid=pid, argv=argv, what=self.what),
                code="D020",
            ) from None
        except OSError as e:
            os.close(fd)
            raise os_error(e, "lock", self.run_dir / LOCK_NAME) from None
        try:
            import sys

            text = f"{os.getpid()}\nlmpm {' '.join(sys.argv[1:])}\n".encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, text, 0)
        except OSError:
            pass  # a full disk: the lock itself holds; only the PID shown to others is missing
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
