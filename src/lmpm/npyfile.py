"""``.npy`` files read from their header first: shape and dtype are known before any data is.

An input file or a run directory's ``NAME.npy`` is data (``docs/security.md``): a header may claim
any shape (a 2 GiB array in a sparse file loads gigabytes before a shape check could refuse it),
any dtype (objects need pickle, which is never allowed), or more bytes than the file holds.
:func:`npy_header` reads only the header (``numpy.lib.format``); :func:`load_npy` loads the array
once the header passed the caller's check. Imports numpy only.

>>> import io, tempfile, pathlib, numpy as np
>>> p = pathlib.Path(tempfile.mkdtemp()) / "a.npy"
>>> np.save(p, np.arange(6).reshape(2, 3))
>>> npy_header(p).shape
(2, 3)
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
from numpy.lib import format as npformat


class NpyError(ValueError):
    """The file is not a readable ``.npy`` of numbers (the caller raises its own coded error)."""


class NpyHeader(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    nbytes: int  # bytes of data the header promises


def npy_header(path: Path) -> NpyHeader:
    """The header of the ``.npy`` at ``path``, checked: a regular file, a version numpy reads, no
    Python objects, and no more data than the file holds (the caller checks shape and dtype).
    Raises :class:`NpyError` saying what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise NpyError(f"{p} is not a regular file")
    try:
        with open(p, "rb") as f:
            version = npformat.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = npformat.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = npformat.read_array_header_2_0(f)
            else:
                raise NpyError(f"{p} is a .npy of unknown version {version}")
            start = f.tell()
    except NpyError:
        raise
    except Exception as e:  # numpy's header parser raises ValueError, SyntaxError, TokenError...
        raise NpyError(f"{p} is not a .npy file ({type(e).__name__}: {e})") from None
    if dtype.hasobject:
        raise NpyError(f"{p} holds Python objects ({dtype}); LMPM never unpickles a file")
    count = 1
    for d in shape:
        count *= int(d)
    nbytes = count * dtype.itemsize
    have = p.stat().st_size - start
    if nbytes > have:
        raise NpyError(
            f"{p} is truncated: its header promises {nbytes:,} bytes of {dtype} {list(shape)}, "
            f"the file holds {have:,}"
        )
    return NpyHeader(tuple(int(d) for d in shape), dtype, bool(fortran), nbytes)


def load_npy(path: Path) -> np.ndarray:
    """The array of a ``.npy`` whose header :func:`npy_header` checked (pickle never allowed)."""
    try:
        return np.asarray(np.load(path, allow_pickle=False))
    except (OSError, ValueError, EOFError) as e:
        raise NpyError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
