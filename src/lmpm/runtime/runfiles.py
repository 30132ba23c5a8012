"""The run directory's files: the one way LMPM opens, writes and deletes them.

A run directory is data: a colleague's ``runs/…``, an attachment, a CI artefact. Whatever it holds,
LMPM writes, deletes and reads only inside it, and only plain files and folders it can name:

- **no symbolic link is followed** below the run directory (the directory itself is the user's
  path and may be one): a folder on the way to a file (``checkpoints/``, ``payload/``, ``render/``)
  must be a real directory, a file LMPM opens must be a regular file (``O_NOFOLLOW``), and a file it
  writes is created anew beside (``O_CREAT | O_EXCL``) and renamed over the old name, which replaces
  a link rather than writing through it (:func:`atomic_write`, :func:`write_file`);
- **names read from the log** (``checkpoints.file``, a checkpoint's ``shards``) are plain names
  under their folder: no absolute path, no ``..``, no separator (:func:`log_name`);
- **files named by the log are read** only when they are regular files (never a FIFO, a device,
  ``/dev/zero``), opened without blocking and no larger than asked (:func:`read_file`);
- **a folder that is not an LMPM run** (it holds files and no ``lmpm.lock``, ``lmpm.db`` or
  ``train.db``) is never written into (:func:`claim_folder`); deleting a run deletes the files
  LMPM names only (:func:`remove_files`), never a folder's other contents.

Every refusal is a :class:`~lmpm.errors.RunDirError`: D032 for a link or a special file, D033 for a
bad name in the log, D034 for a folder LMPM did not write. It imports nothing above it.

>>> import tempfile
>>> d = Path(tempfile.mkdtemp())
>>> write_file(d, "checkpoints/a.bin", b"abc")
>>> read_file(d, log_name("checkpoints/a.bin", "checkpoints"), limit=3)
b'abc'
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from lmpm.errors import RunDirError

# the files whose presence marks a folder as one an LMPM writer started (see claim_folder)
RUN_MARKERS = ("lmpm.lock", "lmpm.db", "train.db")
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")  # a database and the files SQLite keeps beside
PLAIN_NAME = re.compile(
    r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
)  # what LMPM names its files; no "..", no "/"

MSG_LINK = (
    "{path} is {what}, not {want} of the run; refusing to {action} through it (a run directory is "
    "data: LMPM follows no link and opens no special file in it); nothing was changed"
)
MSG_FOREIGN = (
    "{dir} is not an LMPM run (it has no lmpm.db, train.db or lmpm.lock) and is not empty: it "
    "holds {listing}; refusing to write into it (LMPM never deletes or overwrites files it did "
    "not write)"
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


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def refused(path: Path, mode: int, want: str, action: str) -> RunDirError:
    """D032: ``path`` is a link or a special file where LMPM wants ``want``."""
    return RunDirError(
        MSG_LINK.format(path=path, what=_kind(mode), want=want, action=action),
        code="D032",
        hint="remove or replace it with a plain file or folder, or use another run directory",
    )


def folder(run_dir: Path, rel: str, *, create: bool = False, action: str = "write") -> Path:
    """``run_dir/rel`` after checking that it and every folder between it and ``run_dir`` is a real
    directory of the run, not a link (D032); missing ones are created when ``create``, else the
    path is returned as it is (reading a missing folder finds nothing)."""
    path = run_dir
    for part in Path(rel).parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            if not create:
                return run_dir / rel
            try:
                os.mkdir(path)
            except FileExistsError:
                pass  # made meanwhile: checked below
            except OSError as e:
                raise os_error(e, "create the folder", path) from None
            mode = os.lstat(path).st_mode
        except OSError as e:
            raise os_error(e, action, path) from None
        if not stat.S_ISDIR(mode):
            raise refused(path, mode, "a folder", action)
    return path


def log_name(rel: object, under: str) -> str:
    """``rel`` (a file name read from the log) checked to be ``UNDER/NAME`` with NAME a plain file
    name (letters, digits, ``_ . -``, not starting with a dot): never an absolute path, ``..`` or
    another folder (D033)."""
    text = str(rel)
    folder_, sep, name = text.partition("/")
    if not (isinstance(rel, str) and folder_ == under and sep and PLAIN_NAME.fullmatch(name)):
        shown = text if len(text) <= 200 else text[:200] + "…"
        raise RunDirError(
            f"the run's log names the file {shown!r} where a file in {under}/ belongs (a plain "
            "name, no absolute path, `..` or other folder); refusing to open it; nothing was "
            "changed",
            code="D033",
            hint="the log was edited or damaged: restore the run directory from a copy",
        )
    return text


def memory_bytes() -> int:
    """This machine's memory (16 GiB where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 34


def read_file(run_dir: Path, rel: str, *, limit: int | None = None, action: str = "read") -> bytes:
    """The bytes of ``run_dir/rel``: a regular file inside the run (no link on the way, D032),
    opened without blocking (a FIFO never hangs), refused before reading when it is larger than
    ``limit`` bytes or half this machine's memory (D032: a sparse file of terabytes is never
    read). A missing file raises :class:`FileNotFoundError` for the caller."""
    cap = memory_bytes() // 2 if limit is None else min(limit, memory_bytes() // 2)
    parent = folder(run_dir, str(Path(rel).parent), action=action)
    path = parent / Path(rel).name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refused(path, stat.S_IFLNK, "a regular file", action) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refused(path, st.st_mode, "a regular file", action)
        if st.st_size > cap:
            raise RunDirError(
                f"{path} holds {st.st_size:,} bytes where at most {cap:,} are expected; refusing "
                "to read it; nothing was changed",
                code="D032",
                hint="the run directory was edited or damaged: restore it from a copy",
            )
        chunks = []
        left = st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


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


def _drop_stale(tmp: Path) -> None:
    """Remove a temporary file a killed writer left (a link is removed, never followed)."""
    try:
        mode = os.lstat(tmp).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise refused(tmp, mode, "a temporary file", "write")
    os.unlink(tmp)


def atomic_write(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write beside, fsync, rename, fsync the directory: readers see the old file or the whole new
    one, never a part. ``sync=False`` leaves out both fsyncs: the same for readers and for a killed
    process (the page cache holds the file), but a power cut may lose the file or leave it short
    (for a file whose loss is detected and survived: the periodic checkpoints, docs/trace.md).
    The temporary file ``.NAME.tmp`` is created anew (``O_EXCL | O_NOFOLLOW``:
    a link left in its place is removed, never written through) and the rename replaces whatever
    ``path`` was, a link included, rather than writing into it. ``path``'s folder is the caller's
    (:func:`write_file` checks it inside a run). An OS failure (disk full, read-only, not a
    directory) removes the temporary file and raises RunDirError with the OS's reason and path."""
    tmp = path.with_name(f".{path.name}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        _drop_stale(tmp)
        fd = os.open(tmp, flags, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink()
        except OSError:
            pass
        raise os_error(e, "write", path) from None
    if sync:
        fsync_dir(path.parent)


def write_file(run_dir: Path, rel: str, data: bytes, *, sync: bool = True) -> None:
    """:func:`atomic_write` of ``run_dir/rel``, its folders checked (and made) real directories of
    the run first."""
    parent = folder(run_dir, str(Path(rel).parent), create=True)
    atomic_write(parent / Path(rel).name, data, sync=sync)


def open_lock(path: Path) -> int:
    """A descriptor on the lock file ``path``, created if missing: a regular file, never a link
    followed or a FIFO waited on (D032)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refused(path, stat.S_IFLNK, "a regular file", "lock") from None
        if e.errno in (errno.EISDIR, errno.ENXIO):
            mode = os.lstat(path).st_mode
            raise refused(path, mode, "a regular file", "lock") from None
        raise os_error(e, "create the lock file", path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise refused(path, mode, "a regular file", "lock")
    return fd


def check_database(path: Path, action: str = "open") -> None:
    """Before SQLite opens ``path``: it and the files SQLite keeps beside it (``-wal``, ``-shm``,
    ``-journal``) are regular files or absent, never links (SQLite would follow them) nor special
    files (D032)."""
    for suffix in SQLITE_SUFFIXES:
        p = Path(f"{path}{suffix}")
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise os_error(e, action, p) from None
        if not stat.S_ISREG(mode):
            raise refused(p, mode, "a regular file", action)


def is_plain_file(path: Path) -> bool:
    """``path`` is a regular file itself (a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def claim_folder(run_dir: Path) -> None:
    """Refuse (D034) to write into ``run_dir`` when it holds anything but is not an LMPM run (no
    :data:`RUN_MARKERS`): ``--out`` on a user's own folder never touches it. A missing or empty
    folder, or one an LMPM writer started, is fine. Reads nothing but the folder's listing."""
    try:
        entries = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise RunDirError(
            f"cannot use {run_dir} as a run directory: it is a file, not a directory (ENOTDIR)",
            code="D030",
            hint="--out must name a directory (it is created if missing)",
        ) from None
    except OSError as e:
        raise os_error(e, "list", run_dir) from None
    if not entries or any(m in entries for m in RUN_MARKERS):
        return
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    raise RunDirError(
        MSG_FOREIGN.format(dir=run_dir, listing=shown),
        code="D034",
        hint=f"give a new or empty folder, e.g. --out {run_dir / 'run'}",
    )


def remove_files(
    run_dir: Path, under: str, names: Iterable[str] | re.Pattern[str], *, drop_empty: bool = False
) -> None:
    """Delete the files of ``run_dir/under`` that LMPM names (``names``: exact names, or a pattern
    a name must match in full), then, with ``drop_empty``, the folder when that left it empty. The
    folder must be a real directory of the run (D032); a folder found under a name is left alone
    (a link is removed itself, never its target), and every other file stays (a user's
    ``checkpoints/best.pt``)."""
    d = folder(run_dir, under, action="delete files in") if under else run_dir
    if not d.is_dir():
        return
    if isinstance(names, re.Pattern):
        pattern = names
        chosen = [n for n in os.listdir(d) if pattern.fullmatch(n)]
    else:
        chosen = list(names)
    for name in chosen:
        p = d / name
        try:
            if stat.S_ISDIR(os.lstat(p).st_mode):
                continue
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise os_error(e, "delete", p) from None
    if under and drop_empty:
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty: what else it holds is not LMPM's
