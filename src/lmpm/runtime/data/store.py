"""A worker's durable payload: ``RUN_DIR/payload/<worker>.db`` and its checkpoint shards.

The control plane's commit log (``lmpm.db``, :mod:`lmpm.runtime.control.commitlog`) holds metadata only:
which cells committed in which epoch, by which rule, with which clocks, scores and payload
checksums. The payload itself is written by the worker that holds it, here:

    rows(epoch, value, first, step, count, crc, payload)   committed payload, one row per
                                                           arithmetic run of cells (crc: CRC-32 of
                                                           the payload bytes after the type tag)
    candidates(epoch, value, cell, col, payload)            candidate payloads of the cells a
                                                           ``--trace cells`` region asks for
    commits, trace_cells, trace_candidates                  a multi-worker run's per-cell log
                                                           rows of its cells (the log's columns,
                                                           read through ``rundir.attach_shards``)

and, every ``checkpoint_every`` epochs, ``checkpoints/epoch-NNNNNNNN.<worker>.safetensors`` with each
value's whole payload (the format: :mod:`lmpm.runtime.rundir`).

An epoch commits in two steps: the worker appends its rows and commits its transaction
(:meth:`PayloadStore.sync`), *then* the control plane logs the epoch. A run killed between the two
has payload rows for an epoch the log does not have; resume drops them (:meth:`restore`) and redoes
the epoch, which is identical (counter-based randomness).
"""

from __future__ import annotations

import sqlite3
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lmpm.errors import RunDirError
from lmpm.runtime.lock import sqlite_error
from lmpm.runtime.received import check_schema, harden
from lmpm.runtime.rundir import (
    PAGE_SIZE,
    SHARDED,
    STORE_DIR,
    STORE_SCHEMA,
    TAGS,
    cell_runs,
    checkpoint_file,
    decode,
    encode,
    load_checkpoint,
    payload_tag,
    safetensors_bytes,
    store_path,
    store_schema,
    write_checkpoint_file,
)
from lmpm.runtime.runfiles import check_database, folder

if TYPE_CHECKING:
    from torch import Tensor

    from lmpm.resolve.plan import Plan


INSERT_ROW = "INSERT INTO rows VALUES (?,?,?,?,?,?,?)"


class PayloadStore:
    """The durable payload of one worker (see the module doc)."""

    def __init__(self, run_dir: str | Path, worker: str, plan: Plan, durable: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.worker = worker
        self.path = store_path(run_dir, worker)
        self.tags = {name: payload_tag(vp.vocab) for name, vp in plan.values.items()}
        self.cell_size = {
            name: int(np.prod(vp.cell_shape)) if vp.cell_shape else 1
            for name, vp in plan.values.items()
        }
        # a one-number cell's payload bytes packed straight from the scalar (a decode's epoch; the
        # tags are struct's codes): numpy's conversions cost ~3x as much on the caches a model
        # forward leaves behind
        self.scalar = {
            name: struct.Struct("<" + tag)
            for name, tag in self.tags.items()
            if self.cell_size[name] == 1
        }
        # payload/ a real folder of the run and the store a regular file: SQLite follows links
        folder(self.run_dir, STORE_DIR, create=True)
        check_database(self.path)
        try:
            self.conn = sqlite3.connect(str(self.path), isolation_level=None)
            harden(self.conn)  # a resumed run's store came with the directory: no trigger fires
            try:
                check_schema(self.conn, self.path, store_schema())
            except RunDirError:
                self.conn.close()
                raise
            self.conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new store's (before WAL mode)
            self.conn.execute("PRAGMA journal_mode=WAL")
            # as durable as the commit log (--durable: FULL, every epoch's commit fsynced; else
            # NORMAL: a killed process loses nothing, a power cut the last epochs of both)
            self.conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self.conn.executescript(f"BEGIN;{STORE_SCHEMA}COMMIT;")  # each page once in the WAL
        except (OSError, sqlite3.Error) as e:
            raise RunDirError(
                f"cannot open the payload store {self.path}: {e}", code="D012"
            ) from None
        self._open = False  # a transaction is open (per-cell log rows, candidates staged)
        self._rows: list[tuple[Any, ...]] = []  # the ``rows`` staged for the next sync

    def _begin(self) -> None:
        if not self._open:
            self.conn.execute("BEGIN IMMEDIATE")
            self._open = True

    def append_commits(self, epoch: int, value: str, cells: Tensor, payload: Tensor) -> None:
        """Stage the committed rows of ``value`` in ``epoch`` (written at :meth:`sync`)."""
        tag = self.tags[value]
        pack = self.scalar.get(value)
        if pack is not None and cells.numel() == 1:  # a decode's epoch: the row a run of one gets
            try:
                p = pack.pack(payload.item())
            except (struct.error, OverflowError):  # out of the tag's range: numpy's conversion
                p = np.ascontiguousarray(payload.cpu().numpy(), dtype=TAGS[tag]).tobytes()
            self._rows.append((epoch, value, cells.item(), 1, 1, zlib.crc32(p), tag.encode() + p))
            return
        cells_np = cells.cpu().numpy()
        if cells_np.size == 0:
            return
        if cells_np.size == 1:  # one cell of several numbers
            p = np.ascontiguousarray(payload.cpu().numpy(), dtype=TAGS[tag]).tobytes()
            self._insert_rows(
                [(epoch, value, int(cells_np[0]), 1, 1, zlib.crc32(p), tag.encode() + p)]
            )
            return
        order = np.argsort(cells_np, kind="stable")
        cells_np = cells_np[order]
        width = self.cell_size[value]
        raw = np.ascontiguousarray(payload.cpu().numpy()[order], dtype=TAGS[tag]).tobytes()
        size = np.dtype(TAGS[tag]).itemsize * width
        starts, counts, steps = cell_runs(cells_np, np.zeros(cells_np.size, np.int64))
        rows = []
        for s, n, st in zip(starts.tolist(), counts.tolist(), steps.tolist()):
            p = raw[s * size : (s + n) * size]
            rows.append((epoch, value, int(cells_np[s]), st, n, zlib.crc32(p), tag.encode() + p))
        self._insert_rows(rows)

    def _insert_rows(self, rows: list[tuple[Any, ...]]) -> None:
        self._rows.extend(rows)  # written at sync: a decode's one row is one statement then

    def append_log(
        self,
        commits: list[tuple[Any, ...]],
        cells: list[tuple[Any, ...]],
        candidates: list[tuple[Any, ...]],
    ) -> None:
        """Stage an owner's per-cell log rows of one epoch (the log's ``commits``, ``trace_cells``
        and ``trace_candidates`` rows of its cells), written with its payload at :meth:`sync`;
        `lmpm trace` reads them beside the control plane's log (rundir.attach_shards)."""
        if not (commits or cells or candidates):
            return
        try:
            self._begin()
            if commits:
                self.conn.executemany(
                    "INSERT INTO commits VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", commits
                )
            if cells:
                self.conn.executemany(
                    "INSERT INTO trace_cells VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", cells
                )
            if candidates:
                self.conn.executemany(
                    "INSERT INTO trace_candidates VALUES (?,?,?,?,?,?,?,?)", candidates
                )
        except sqlite3.Error as e:
            raise sqlite_error(e, "write the owner's log rows", self.path) from None

    def record_candidates(
        self,
        epoch: int,
        value: str,
        cells: Tensor,
        table: Tensor,
        which: Tensor,
        cols: list[int] | None = None,
    ) -> None:
        """Stage the candidate payloads of the open ``cells`` that are in ``which``; column j of
        ``table`` is recorded as column ``cols[j]`` (the merged column of a group; default j)."""
        cells_np = cells.cpu().numpy()
        pick = np.isin(cells_np, which.cpu().numpy())
        if not pick.any():
            return
        rows_idx = np.flatnonzero(pick)
        tab = table.cpu().numpy()[rows_idx]  # (m, C, *cell)
        tag = self.tags[value]
        out = []
        for i, r in enumerate(rows_idx.tolist()):
            for col in range(tab.shape[1]):
                at = col if cols is None else cols[col]
                out.append((epoch, value, int(cells_np[r]), at, encode(tab[i, col], tag)))
        try:
            self._begin()
            self.conn.executemany("INSERT OR REPLACE INTO candidates VALUES (?,?,?,?,?)", out)
        except sqlite3.Error as e:
            raise sqlite_error(e, "write the payload store", self.path) from None

    def sync(self, epoch: int) -> None:
        """Make everything staged for ``epoch`` durable (before the control plane logs it): one
        transaction; a lone payload row (a decode's epoch) is one INSERT, its own transaction."""
        rows, self._rows = self._rows, []
        try:
            if len(rows) == 1 and not self._open:
                self.conn.execute(INSERT_ROW, rows[0])
                return
            if rows:
                self._begin()
                self.conn.executemany(INSERT_ROW, rows)
            if self._open:
                self.conn.execute("COMMIT")
                self._open = False
        except sqlite3.Error as e:
            raise sqlite_error(e, "commit the payload store", self.path) from None

    def rollback(self) -> None:
        self._rows = []
        if self._open:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # nothing was committed; the connection is closed next
            self._open = False

    def checkpoint(
        self, label: int, payloads: dict[str, np.ndarray], sync: bool = True
    ) -> tuple[str, int, str]:
        """Write the payload at the start of epoch ``label``: (file, bytes, sha256); fsynced
        unless ``sync`` is False (:func:`~lmpm.runtime.runfiles.atomic_write`)."""
        arrays = {f"{name}.payload": np.ascontiguousarray(a) for name, a in payloads.items()}
        data = safetensors_bytes(arrays, {"epoch": str(label), "worker": self.worker})
        return write_checkpoint_file(self.run_dir, checkpoint_file(label, self.worker), data, sync)

    def restore(
        self, label: int, rel: str, sha: str, upto: int, counts: dict[tuple[int, str], int]
    ) -> dict[str, np.ndarray]:
        """The payload after epoch ``upto - 1``: checkpoint ``rel`` (taken at the start of epoch
        ``label``) plus the committed rows of epochs ``label .. upto - 1``, each checked against
        its CRC and, per (epoch, value), against the cell ``counts`` the control plane logged.
        Rows of epochs the control plane never logged (a kill between the two commit steps) are
        dropped, payload and per-cell log rows alike."""
        self.rollback()  # rows staged by an epoch that did not finish
        loaded = load_checkpoint(self.run_dir, rel, sha, "payload checkpoint")
        arrays = {k.removesuffix(".payload"): v.copy() for k, v in loaded.items()}
        seen: dict[tuple[int, str], int] = {}
        cur = self.conn.execute(
            "SELECT epoch, value, first, step, count, crc, payload FROM rows "
            "WHERE epoch >= ? AND epoch < ? ORDER BY epoch, rowid",
            (label, upto),
        )
        for ep, value, first, step, count, crc, payload in cur:
            into = arrays.get(value)
            if into is None or zlib.crc32(payload[1:]) != crc:
                raise RunDirError(
                    f"payload of epoch {ep} for `{value}` in {self.path} is corrupt (CRC mismatch); "
                    "nothing was changed",
                    code="D006",
                )
            idx = first + step * np.arange(count)
            into[idx] = decode(payload).reshape(count, *into.shape[1:])
            seen[(ep, value)] = seen.get((ep, value), 0) + count
        want = {k: v for k, v in counts.items() if label <= k[0] < upto and v}
        if seen != want:
            bad = sorted(set(seen.items()) ^ set(want.items()))[0]
            raise RunDirError(
                f"the payload store {self.path} and the commit log disagree on epoch {bad[0][0]} "
                f"of `{bad[0][1]}` (log: {want.get(bad[0], 0)} cells, store: "
                f"{seen.get(bad[0], 0)}); nothing was changed",
                code="D013",
            )
        self.conn.execute("BEGIN IMMEDIATE")
        for table in ("rows", "candidates", *SHARDED):  # the log never got these epochs
            self.conn.execute(f"DELETE FROM {table} WHERE epoch >= ?", (upto,))
        self.conn.execute("COMMIT")
        return arrays

    def close(self) -> None:
        self.rollback()
        self.conn.close()
