"""An exclusive lock per run directory, and the translation of OS failures into RunDirErrors.

Every process that writes a run directory (``lmpm run --out D``, ``--resume D``, ``--force``) takes
``D/lmpm.lock`` with ``flock(LOCK_EX | LOCK_NB)`` before it reads or changes anything and holds it
for the run's life; the OS releases it when the process dies, even by ``kill -9``, so a stale lock
file never blocks anyone. The file holds the owner's PID, which the refusal names. Readers
(``lmpm trace``) take no lock: SQLite's WAL lets them read a live run.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> with RunLock(d):
...     pass
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
from pathlib import Path
from types import TracebackType

from lmpm.errors import RunDirError

LOCK_NAME = "lmpm.lock"

MSG_LOCKED = (
    "{dir} is in use by a live run (pid {pid}, `{argv}`); refusing to {what} it while that run is "
    "alive. Wait for it to finish or stop it (kill {pid}), or use another --out directory."
)


def os_error(e: OSError, action: str, path: str | Path | None = None) -> RunDirError:
    """A RunDirError for an OSError: what was being done, the path, and the OS's own reason."""
    where = e.filename if e.filename is not None else path
    name = errno.errorcode.get(e.errno or 0, "")
    reason = f"{e.strerror or e} ({name})" if name else str(e.strerror or e)
    hint = None
    if e.errno == errno.ENOSPC or e.errno == errno.EFBIG:
        hint = "free space (or raise the file-size limit), then `lmpm run --resume` the directory"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = "give an --out directory you can write"
    elif e.errno in (errno.ENOTDIR, errno.EEXIST):
        hint = "--out must name a directory (a path whose parents are directories)"
    return RunDirError(f"cannot {action} {where}: {reason}", code="D030", hint=hint)


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
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise os_error(e, "create the run directory", self.run_dir) from None
        path = self.run_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise os_error(e, "create the lock file", path) from None
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
            raise os_error(e, "lock", path) from None
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


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so a rename inside it survives a power cut (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write beside, fsync, rename, fsync the directory: readers see the old file or the whole new
    one, never a part. An OS failure (disk full, read-only, not a directory) removes the temporary
    file and raises :class:`~lmpm.errors.RunDirError` with the OS's reason and the path."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise os_error(e, "write", path) from None
    fsync_dir(path.parent)
