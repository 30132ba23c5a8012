"""The commit log: one SQLite database per run (``RUN_DIR/lmpm.db``), appended once per epoch.

Commit is the sole causal interface between a run and the world, so what a run committed is never
lost. Each epoch is one SQLite transaction (WAL mode) holding the epoch's row, its commits and its
constraint trace (:mod:`lmpm.runtime.control.trace`); an epoch is in the log entirely or not at all.

The log is the control plane's and holds metadata only: which cells committed, by which rule, with
which clocks, scores and payload checksums. The payload is made durable by the worker holding it
(:mod:`lmpm.runtime.data.store`, ``RUN_DIR/payload/<worker>.db``) *before* the epoch is logged here (a
two-step commit). Every ``checkpoint_every`` epochs the control plane's state (committed flags,
clocks, provenance, scores) is written as a safetensors file beside the database, and each worker
writes its payload shard; the control checkpoint names the shards (and their sha256) in its
metadata. Files are renamed into place before the transaction that references them commits. A
killed run resumes from its newest checkpoint plus the commits logged after it, which is exactly
the state after its last complete epoch: with the counter-based RNG, the rest of the run is then
identical to an uninterrupted one.

The format (schemas, blobs, checkpoint files) is :mod:`lmpm.runtime.rundir`'s, shared with
``lmpm trace``. This module imports no torch at module level (commands import it before a run
starts; :func:`restore` and :class:`CommitLog` import it when they run).

Schema (version :data:`~lmpm.runtime.rundir.SCHEMA_VERSION`; plain SQL, see ``docs/trace.md``)::

    meta(key, value)                      run metadata, values JSON-encoded
    value_defs / rule_defs / constraint_defs   what the ids in the other tables mean
    epochs(epoch, open_cells, attempts, candidates, commits, violations, decided, ...)
    commits(epoch, value, first, last, step, count, rule, clock_min, clock_max, ..., sums, ...)
    checkpoints(epoch, file, bytes, sha256, created)
    resumes(id, at, from_epoch, argv)
    trace_summary / trace_cells / trace_candidates   (written by the tracer)

Example (a run directory written by ``lmpm run``)::

    >>> import sqlite3                                             # doctest: +SKIP
    >>> db = sqlite3.connect("runs/video/lmpm.db")                 # doctest: +SKIP
    >>> db.execute("SELECT epoch, commits FROM epochs").fetchall()  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sqlite3
import sys
import time
import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lmpm.errors import RunDirError, RuntimeFault, UsageError
from lmpm.ir.nodes import PredKind, Status
from lmpm.ir.serialize import to_dict, to_json
from lmpm.runtime.control.crdt import ORSet
from lmpm.runtime.control.trace import TraceRows
from lmpm.runtime.lock import fsync_dir, os_error, sqlite_error
from lmpm.runtime.records import INPUT_RULE, CellState, OneCell, committed_sum, wrap64
from lmpm.runtime.rundir import (
    CHECKPOINT_DIR,
    CHECKPOINT_NAME,
    DB_NAME,
    INSERT_COMMIT,
    INSERT_EPOCH,
    KEEP_RULE,
    PAGE_SIZE,
    SCHEMA,
    SCHEMA_VERSION,
    attach_shards,
    checkpoint_file,
    checkpoint_shards,
    commit_rows,
    completed_epochs,
    connect,
    db_path,
    decode,
    detach_shards,
    load_checkpoint,
    one_commit_row,
    read_checkpoint,
    read_meta,
    remove_stores,
    ruleset_events,
    safetensors_bytes,
    unlink_db,
    upgrade,
    write_checkpoint_file,
)
from lmpm.runtime.runfiles import folder, remove_files
from lmpm.version import __version__

if TYPE_CHECKING:
    from lmpm.ir.nodes import Program
    from lmpm.resolve.plan import Plan
    from lmpm.runtime.control.engine import Engine
    from lmpm.runtime.control.trace import Tracer
    from lmpm.runtime.records import EpochRecord

KEEP_CHECKPOINTS = 2  # newest checkpoints kept besides epoch 0's (the inputs)

MSG_FOREIGN = (
    "{dir} holds a run of a different program (hash {stored} ≠ {given}); nothing was changed. "
    "Resume it with the program it was started with, or start a new run in another directory."
)
MSG_EXISTS = (
    "{dir} already holds a run ({epochs} epochs complete, {status}); refusing to overwrite it. "
    "Continue it with `lmpm run --resume {dir}`, or start over with --force."
)


# ---- metadata -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunInfo:
    """What identifies a run and how it was started (stored in ``meta``, checked on resume)."""

    program_hash: str  # sha256 of the IR JSON without spans and file name
    program_file: str  # the .lmpm path as given
    source: str  # the program text (resume works without the file)
    params: dict[str, int]  # --set overrides
    bind: tuple[str, ...]  # --bind modules (files as absolute paths)
    seed: int
    backend: str
    epochs: int | None  # --epochs (also fixes the confidence schedule's steps)
    until: str | None  # --until
    trace: str  # off | summary | cells
    trace_region: str | None  # --trace-region (cells level)
    checkpoint_every: int
    inputs: dict[str, str] = field(default_factory=dict)  # --input NAME -> absolute path
    durable: bool = False  # --durable: synchronous=FULL (every epoch fsynced), see docs/trace.md
    workers: int = 1  # --workers: the partition's size (one payload shard per worker)
    # the call names the run binds itself -> {"from": module spec or "bindings=", "signature"}
    # (lmpm.bindings.bound_record; a resumed run must bind the same, however it gets them)
    bound: dict[str, dict[str, str]] = field(default_factory=dict)
    # --tokenizer: vocabulary NAME -> its values (the tokenizer: RUN_DIR/tokenizers/NAME.json)
    tokenizers: dict[str, list[str]] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        return asdict(self)


IDENTITY = ("params", "bind", "seed", "trace", "trace_region", "checkpoint_every")


def program_hash(program: Program) -> str:
    """sha256 of the program's IR, independent of formatting, comments and the file's name."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            # (a soft constraint's `hard: false` is left out: hashes from before it existed hold)
            return {
                k: strip(v)
                for k, v in x.items()
                if k not in ("span", "file") and not (k == "hard" and v is False)
            }
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    text = json.dumps(strip(to_dict(program)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---- the run directory ----------------------------------------------------------------------------
def failed_before_first_epoch(run_dir: str | Path) -> bool:
    """The run in ``run_dir`` failed before it completed an epoch: it committed nothing but its
    inputs (which are still in their files), so a new run may take its place."""
    try:
        conn = connect(run_dir)
        try:
            return completed_epochs(conn) == 0 and read_meta(conn).get("status") == "failed"
        finally:
            conn.close()
    except RunDirError:
        return False


def refuse_existing(run_dir: str | Path) -> None:
    """Raise the usage error for `lmpm run` into a directory that already holds a run."""
    epochs, status = "?", "unreadable"
    try:
        conn = connect(run_dir)
        try:
            epochs, status = str(completed_epochs(conn)), str(read_meta(conn).get("status", "?"))
        finally:
            conn.close()
    except RunDirError:
        pass
    raise UsageError(MSG_EXISTS.format(dir=run_dir, epochs=epochs, status=status), code="U030")


# ---- checkpoints ----------------------------------------------------------------------------------
STATE_FIELDS = ("committed", "clock", "rule", "epoch", "score")


def state_arrays(engine: Engine) -> dict[str, np.ndarray]:
    """The control plane's state as numpy arrays named ``VALUE.clock``, ``VALUE.rule``, ..."""
    out: dict[str, np.ndarray] = {}
    for name in engine.plan.values:
        st = engine.state[name]
        for f in STATE_FIELDS:
            out[f"{name}.{f}"] = getattr(st, f).detach().cpu().numpy()
    return out


def write_checkpoint(
    run_dir: Path, engine: Engine, label: int, phash: str, sync: bool = True
) -> tuple[str, int, str]:
    """Checkpoint the state at the start of epoch ``label``: the worker writes its payload shard
    first, then the control plane's file (naming the shard and its sha256) is written beside,
    fsynced (each file; unless ``sync`` is False) and renamed. Returns the control file's (file,
    bytes, sha256)."""
    shards = engine.dataplane.checkpoint_shards(label, sync)
    data = safetensors_bytes(
        state_arrays(engine),
        metadata={
            "epoch": str(label),
            "program_hash": phash,
            "schema": str(SCHEMA_VERSION),
            "shards": json.dumps(shards, sort_keys=True),
        },
    )
    return write_checkpoint_file(run_dir, checkpoint_file(label), data, sync)


# ---- resume ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Restored:
    epoch: int  # the next epoch to run
    quiet: int  # trailing epochs without a commit (for the stability test)
    checkpoint: int  # the checkpoint it started from
    replayed: int  # commit rows replayed on top of it
    skipped: int = 0  # newer checkpoints that were missing or damaged


def _maskplan_element(data: Any) -> Hashable:
    def tup(x: Any) -> Any:
        return tuple(tup(v) for v in x) if isinstance(x, list) else x

    return tup(data)


def check_epochs(conn: sqlite3.Connection, run_dir: str | Path) -> int:
    """The number of complete epochs, after checking the epoch rows are 0..n-1 with no gap (a
    deleted row would otherwise go unnoticed, and resume would skip that epoch's commits)."""
    count, top = conn.execute("SELECT count(*), max(epoch) FROM epochs").fetchone()
    n = 0 if top is None else int(top) + 1
    if int(count) != n:
        have = {int(r[0]) for r in conn.execute("SELECT epoch FROM epochs")}
        missing = [e for e in range(n) if e not in have]
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise RunDirError(
            f"{db_path(run_dir)} lacks the rows of epoch(s) {shown} of 0..{n - 1} (a gap in the "
            "epochs table: the log was edited or damaged); nothing was changed",
            code="D012",
            hint="restore lmpm.db from a copy",
        )
    return n


def restore(
    engine: Engine, conn: sqlite3.Connection, run_dir: str | Path, durable: bool = False
) -> Restored:
    """Bring a fresh engine to the state after the run's last complete epoch (newest usable
    checkpoint at or before it, then the commits logged after the checkpoint, each checked against
    its CRC). A missing or damaged checkpoint is skipped for an older one: the commits table holds
    every epoch, so any checkpoint plus the replay gives the same state. ``durable``
    (--durable): the payload stores reopened fsync every epoch, as the log does."""
    try:
        return _restore(engine, conn, run_dir, durable)
    except RunDirError:
        raise
    except (sqlite3.Error, ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise RunDirError(
            f"{db_path(run_dir)} has a damaged row ({type(e).__name__}: {e}); nothing was changed",
            code="D006",
            hint="restore lmpm.db from a copy",
        ) from None


def _restore(
    engine: Engine, conn: sqlite3.Connection, run_dir: str | Path, durable: bool
) -> Restored:
    import torch  # not at import: commands import this module before a run needs torch

    d = Path(run_dir)
    nxt = check_epochs(conn, d)
    label, state, shards, skipped = _newest_checkpoint(engine, conn, d, nxt)
    # the checkpoint's arrays seen as tensors (shared memory): the replay writes through them
    cells = {
        n: CellState(*(torch.from_numpy(v[f]) for f in STATE_FIELDS)) for n, v in state.items()
    }
    commits, replayed = _replay_commits(conn, d, label, nxt, cells)
    engine.dataplane.open_store(d, durable)
    try:
        engine.dataplane.restore_shards(
            label,
            shards,
            nxt,
            {k: torch.from_numpy(np.concatenate(v)) for k, v in commits.items()},
            {n: torch.from_numpy(v["committed"]) for n, v in state.items()},
            {n: torch.from_numpy(v["rule"] == INPUT_RULE) for n, v in state.items()},
        )
    except BaseException:
        engine.dataplane.close_store()
        raise
    for name, cs in cells.items():
        engine.restore(name, cs)
    engine.epoch = nxt
    quiet = _restore_control(engine, conn)
    return Restored(nxt, quiet, label, replayed, len(skipped))


def _newest_checkpoint(
    engine: Engine, conn: sqlite3.Connection, d: Path, nxt: int
) -> tuple[int, dict[str, dict[str, np.ndarray]], dict[str, dict[str, Any]], list[str]]:
    """The newest usable checkpoint at or before epoch ``nxt``: its epoch, its metadata arrays
    per value, its payload shards, and why each newer one was skipped (a note for each on
    stderr)."""
    rows = conn.execute(
        "SELECT epoch, file, sha256, bytes FROM checkpoints WHERE epoch <= ? ORDER BY epoch DESC",
        (nxt,),
    ).fetchall()
    if not rows:
        raise RunDirError(
            f"{d} has no checkpoint to resume from (the run never started)",
            code="D008",
            hint="start it again with --force",
        )
    folder(d, CHECKPOINT_DIR, action="read")  # a real folder of the run (D032), checked once
    state: dict[str, dict[str, np.ndarray]] | None = None
    skipped: list[str] = []
    codes: set[str] = set()
    label = -1
    shards: dict[str, dict[str, Any]] = {}
    for ep, rel, sha, nbytes in rows:
        label, rel = int(ep), str(rel)
        try:
            state = _checkpoint_state(engine, d, rel, str(sha), int(nbytes))
            shards = _shards_of(engine, d, rel)
            break
        except RunDirError as e:
            state = None
            skipped.append(e.message)
            codes.add(e.code)
    if state is None:
        # each reason once; the code of the refusal when every checkpoint had the same one
        reasons = dict.fromkeys(m.removesuffix("; nothing was changed") for m in skipped)
        raise RunDirError(
            f"{d}: no checkpoint is usable; {'; '.join(reasons)}; nothing was changed",
            code=codes.pop() if len(codes) == 1 else "D007",
        )
    for msg in skipped:
        sys.stderr.write(f"note: {msg.removesuffix('; nothing was changed')}; using an older one\n")
    return label, state, shards, skipped


def _replay_commits(
    conn: sqlite3.Connection, d: Path, label: int, nxt: int, cells: Mapping[str, CellState]
) -> tuple[dict[tuple[int, str], list[np.ndarray]], int]:
    """Write the metadata of the commits logged in epochs ``label .. nxt - 1`` into ``cells``
    (each commit row checked against its CRC); the committed cells per (epoch, value) and the
    number of rows replayed."""
    import torch

    from lmpm.runtime.data.decide import write_meta  # imports torch

    replayed = 0
    commits: dict[tuple[int, str], list[np.ndarray]] = {}
    # a multi-worker run's commits are in the workers' stores: read them beside the log's, then
    # detach them, so the epochs to come are logged into this connection's own tables
    attach_shards(conn, d)
    try:
        replay = conn.execute(
            "SELECT epoch, value, first, step, count, rule, clock_min, clocks, score_min, scores, "
            "sums, crc FROM commits WHERE epoch >= ? AND epoch < ? ORDER BY epoch, value, first",
            (label, nxt),
        ).fetchall()
    finally:
        detach_shards(conn)
    for epoch, value, first, step, count, rule, cmin, clocks, smin, scores, sums, crc in replay:
        into = cells.get(value)
        if into is None or not isinstance(sums, bytes) or zlib.crc32(sums[1:]) != crc:
            raise RunDirError(
                f"commit of epoch {epoch} for `{value}` is corrupt (checksum mismatch)", code="D006"
            )
        idx = first + step * np.arange(count)
        commits.setdefault((epoch, value), []).append(idx)
        data = decode(sums)
        n = into.committed.numel()
        if count < 1 or data.size != count or int(idx.min()) < 0 or int(idx.max()) >= n:
            raise RunDirError(
                f"commit of epoch {epoch} for `{value}` does not fit the value ({count} cells from "
                f"{first} step {step}; {n} cells)",
                code="D006",
            )
        clock = np.full(count, cmin) if clocks is None else cmin + decode(clocks).astype(np.int64)
        score = (
            float(smin) if scores is None else torch.from_numpy(decode(scores).astype(np.float64))
        )
        write_meta(into, torch.from_numpy(idx), torch.from_numpy(clock).long(), rule, epoch, score)
        replayed += 1
    return commits, replayed


def _restore_control(engine: Engine, conn: sqlite3.Connection) -> int:
    """The control plane's state from the log: the mask plan, the RuleSet's events, and how many
    quiet epochs ended the log (returned)."""
    mp = ORSet("control")
    for (elem,) in conn.execute("SELECT maskplan FROM epochs ORDER BY epoch"):
        mp.add(_maskplan_element(json.loads(elem)))
    engine.maskplan = mp
    for epoch, op, name, clock, by in ruleset_events(conn):
        engine.change_ruleset(op, name, by, epoch=epoch, clock=clock)
    quiet = 0
    for (commits,) in conn.execute("SELECT commits FROM epochs ORDER BY epoch DESC"):
        if commits:
            break
        quiet += 1
    engine.restore_quiet(quiet)  # raster / random go on with their pass
    return quiet


def _checkpoint_state(
    engine: Engine, d: Path, rel: str, sha: str, nbytes: int
) -> dict[str, dict[str, np.ndarray]]:
    arrays = load_checkpoint(d, rel, sha, size=nbytes)
    state: dict[str, dict[str, np.ndarray]] = {}
    for name, vp in engine.plan.values.items():
        vals = {}
        for f in STATE_FIELDS:
            a = arrays.get(f"{name}.{f}")
            if a is None or a.shape != (vp.ncells,):
                raise RunDirError(
                    f"checkpoint {d / rel} does not fit value `{name}` ({vp.ncells} cells)",
                    code="D007",
                )
            vals[f] = a.copy()
        state[name] = vals
    return state


def _shards_of(engine: Engine, d: Path, rel: str) -> dict[str, dict[str, Any]]:
    """The workers' payload shards that control checkpoint ``rel`` names, each checked (sha256)."""
    shards = checkpoint_shards(d, rel)
    out: dict[str, dict[str, Any]] = {}
    for worker in engine.dataplane.shard_names:
        shard = shards.get(worker)
        if shard is None:
            raise RunDirError(
                f"checkpoint {d / rel} names no payload shard of worker `{worker}` "
                f"(it has: {', '.join(shards) or 'none'}); nothing was changed",
                code="D007",
            )
        size = shard.get("bytes")
        read_checkpoint(
            d,
            shard["file"],
            shard["sha256"],
            "payload checkpoint",
            size if isinstance(size, int) else None,
        )
        out[worker] = dict(shard)
    return out


# ---- the observer ---------------------------------------------------------------------------------
def _bindings_of(plan: Plan) -> dict[str, str]:
    def where(obj: Any) -> str:
        return (
            f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"
        )

    out: dict[str, str] = {}
    for rp in plan.rules:
        out[rp.ir.proposal.func] = where(rp.model)
        if rp.score is not None and rp.ir.score is not None:
            out[rp.ir.score.func] = where(rp.score)
    for cp in plan.constraints:
        if cp.predicate is not None and cp.ir.call is not None:
            out[cp.ir.call.func] = where(cp.predicate)
    return out


def _definitions(conn: sqlite3.Connection, plan: Plan, source: str) -> None:
    lines = source.splitlines()
    for i, (name, vp) in enumerate(plan.values.items()):
        conn.execute(
            "INSERT INTO value_defs VALUES (?,?,?,?,?,?,?,?)",
            (
                i,
                name,
                json.dumps(list(vp.dims)),
                vp.ncells,
                vp.offset,
                vp.vocab,
                str(vp.dtype).removeprefix("torch."),
                vp.policy_text,
            ),
        )
    conn.execute(
        "INSERT INTO rule_defs VALUES (?,?,?,?,?,?)", (KEEP_RULE, "keep", None, None, None, None)
    )
    conn.execute(
        "INSERT INTO rule_defs VALUES (?,?,?,?,?,?)", (INPUT_RULE, "input", None, None, None, None)
    )
    for rp in plan.rules:
        conn.execute(
            "INSERT INTO rule_defs VALUES (?,?,?,?,?,?)",
            (
                rp.id,
                rp.name,
                rp.target,
                rp.ir.proposal.func,
                rp.ir.score.func if rp.ir.score else None,
                rp.replicas,
            ),
        )
    for cp in plan.constraints:
        proved = cp.status == Status.PROVED or cp.pred == PredKind.READ_FUTURE
        sp = cp.ir.span
        text = " ".join(x.strip() for x in lines[sp.line - 1 : sp.end_line]) if lines else None
        conn.execute(
            "INSERT INTO constraint_defs VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                cp.id,
                cp.name,
                cp.target,
                cp.kind,
                cp.pred.value,
                cp.priority,
                "proved" if proved else "evaluated",
                str(sp),
                text,
                None if cp.needs_inputs_region else int(cp.cells.sum()),
            ),
        )


class CommitLog:
    """An engine observer appending each epoch to ``RUN_DIR/lmpm.db`` in one transaction.

    >>> from lmpm.runtime.session import Run                                   # doctest: +SKIP
    >>> log = CommitLog("runs/x", info, tracer=None)                          # doctest: +SKIP
    >>> run = Run.from_file("prog.lmpm", observers=[log]); run.run(10)        # doctest: +SKIP
    """

    def __init__(
        self,
        run_dir: str | Path,
        info: RunInfo,
        *,
        tracer: Tracer | None = None,
        conn: sqlite3.Connection | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.info = info
        self.tracer = tracer
        self.conn = conn  # given: resume an existing log (opened read-write)
        self.argv = list(argv or [])
        self._checkpointed = -1  # label of the newest checkpoint
        self.log_seconds = 0.0  # time spent in on_epoch, the log's whole cost to the run
        self._ruleset_logged = 0  # engine.ruleset_events already in the log
        self.wants_records = True  # the epoch records' per-cell part (not when the owners log)
        self._maskplan_elem: object = None  # the mask plan element last logged, and its JSON
        self._maskplan_json = ""
        self._opened: object = None  # the last epoch element's open cells per value, and its JSON
        self._opened_json = ""

    # Observer protocol
    def on_start(self, engine: Engine) -> None:
        self._dataplane = engine.dataplane  # its store is closed with the log
        engine.checkpoint_every = self.info.checkpoint_every  # (a window of epochs ends there)
        engine.checksums = True  # the committed rows' checksums go into the log
        # a worker group's owners write the per-cell rows into their stores (log shards): the
        # epoch records then carry counts only
        self.wants_records = not engine.dataplane.log_cells(self.tracer)
        if self.tracer is not None and self.tracer.level == "cells":
            engine.record = self.tracer.recorded_cells()  # the worker stores their candidates
        if self.conn is not None:
            self._resume_start(engine)
            return
        # Built under a temporary name and renamed once complete: a run killed while starting
        # leaves no half-made log (a plain rerun works, no --force needed); a run that cannot
        # start (disk full, read-only) leaves no temporary file.
        tmp = self.run_dir / f".{DB_NAME}.tmp"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            unlink_db(tmp)
            self._create(engine, tmp)
        except BaseException as e:
            try:
                unlink_db(tmp)
            except OSError:
                pass
            if isinstance(e, OSError):
                raise os_error(e, "create the commit log", tmp) from None
            if isinstance(e, sqlite3.Error):
                raise sqlite_error(e, "create the commit log", tmp) from None
            raise
        self.conn = connect(self.run_dir, readonly=False, durable=self.info.durable)
        self._checkpointed = engine.epoch

    def _create(self, engine: Engine, tmp: Path) -> None:
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # (a new database's, before WAL mode)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={'FULL' if self.info.durable else 'NORMAL'}")
            self._fill(engine, conn)
            # Move the WAL into the file now, where a failure (disk full) raises: close() would
            # swallow it, and the rename would then move a file whose data is still in the WAL.
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            conn.close()
        wal = Path(f"{tmp}-wal")
        if busy or (wal.exists() and wal.stat().st_size > 0):
            raise sqlite3.OperationalError("the new log could not be checkpointed")
        tmp.replace(db_path(self.run_dir))
        fsync_dir(self.run_dir)

    def _fill(self, engine: Engine, conn: sqlite3.Connection) -> None:
        remove_stores(self.run_dir)  # a half-started run's (LMPM's own files only)
        engine.dataplane.open_store(self.run_dir, self.info.durable)
        rel, nbytes, sha = write_checkpoint(
            self.run_dir, engine, engine.epoch, self.info.program_hash
        )
        import torch  # (see _restore)

        meta: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            **self.info.to_meta(),
            "plan_epochs": self.info.epochs,  # fixes the plan (confidence steps); never updated
            "ir_json": to_json(engine.plan.program),
            "ir_version": engine.plan.program.version,
            "bindings": _bindings_of(engine.plan),
            "bind_sha256": {b: file_sha256(b) for b in self.info.bind if Path(b).is_file()},
            "env": engine.plan.env,
            "versions": {
                "lmpm": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "sqlite": sqlite3.sqlite_version,
            },
            "created_at": time.time(),
            "argv": self.argv,
            "status": "running",
        }
        conn.execute("BEGIN IMMEDIATE")
        for stmt in SCHEMA.split(";"):
            if stmt.strip():
                conn.execute(stmt)
        conn.executemany(
            "INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()]
        )
        _definitions(conn, engine.plan, self.info.source)
        conn.execute(
            "INSERT INTO checkpoints VALUES (?,?,?,?,?)",
            (engine.epoch, rel, nbytes, sha, time.time()),
        )
        conn.execute("COMMIT")

    def _resume_start(self, engine: Engine) -> None:
        assert self.conn is not None
        try:
            self._resume_rows(engine)
        except sqlite3.Error as e:
            _rollback(self.conn)
            raise sqlite_error(e, "record the resume in", db_path(self.run_dir)) from None
        self._prune_files()

    def _resume_rows(self, engine: Engine) -> None:
        assert self.conn is not None
        row = self.conn.execute("SELECT max(epoch) FROM checkpoints").fetchone()
        self._checkpointed = int(row[0]) if row[0] is not None else -1
        self.conn.execute("BEGIN IMMEDIATE")
        upgrade(self.conn)  # a log of an older schema this version reads
        self._ruleset_logged = len(ruleset_events(self.conn))  # replayed by restore()
        self.conn.execute(
            "INSERT INTO resumes (at, from_epoch, argv) VALUES (?,?,?)",
            (time.time(), engine.epoch, json.dumps(self.argv)),
        )
        for key in ("epochs", "until", "backend", "durable"):
            self.conn.execute(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                (key, json.dumps(getattr(self.info, key))),
            )
        self.conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'status'", (json.dumps("running"),)
        )
        self.conn.execute("COMMIT")

    def on_epoch(self, engine: Engine, record: EpochRecord) -> None:
        assert self.conn is not None
        if record.commits and not record.durable:
            # the epoch row is the "epoch durable" mark: never written before the workers say
            # their payload stores hold the epoch's commits
            raise RuntimeFault(
                f"epoch {record.epoch}: the workers did not acknowledge its {record.commits} "
                "commits as durable in their payload stores, so the epoch is not logged",
                where={"epoch": record.epoch},
                code="R090",
                hint="`lmpm resume` redoes it from the last logged epoch",
            )
        t0 = time.perf_counter()
        rows = self._epoch_rows(engine, record)
        label = record.epoch + 1
        ckpt = None
        if label % self.info.checkpoint_every == 0:
            # fsynced only with --durable: a killed process loses none of it either way, and a
            # checkpoint a power cut lost is skipped by resume for an older one (epoch 0's and the
            # final one are fsynced), which replays the same state (docs/trace.md, Durability)
            ckpt = write_checkpoint(
                self.run_dir, engine, label, self.info.program_hash, sync=self.info.durable
            )
        maskplan = self._maskplan(engine)
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            self._log_ruleset(engine)
            _insert_faults(conn, record)
            if len(rows.commits) == 1:  # (a decode's epoch: execute binds one row the faster)
                conn.execute(INSERT_COMMIT, rows.commits[0])
            elif rows.commits:
                conn.executemany(INSERT_COMMIT, rows.commits)
            if rows.trace is not None:
                rows.trace.insert(conn)
            if ckpt is not None:
                _insert_checkpoint(conn, label, ckpt)
            seconds = time.perf_counter() - t0
            conn.execute(INSERT_EPOCH, rows.epoch_row(record, seconds, maskplan))
            conn.execute("COMMIT")
        except BaseException as e:
            _rollback(conn)
            if ckpt is not None:  # no committed row references it
                (self.run_dir / ckpt[0]).unlink(missing_ok=True)
            if isinstance(e, sqlite3.Error):
                raise sqlite_error(
                    e, f"append epoch {record.epoch} to the commit log", db_path(self.run_dir)
                ) from None
            raise
        if ckpt is not None:
            self._checkpointed = label
            self._prune_files()
        self.log_seconds += time.perf_counter() - t0

    def _maskplan(self, engine: Engine) -> str:
        """The epochs row's ``maskplan``: the mask plan's newest element as JSON (encoded once
        while it stays the same element, as it does epoch after epoch)."""
        elem = next(reversed(engine.maskplan.adds))
        if elem is not self._maskplan_elem:
            self._maskplan_json = self._maskplan_text(elem)
            self._maskplan_elem = elem
        return self._maskplan_json

    def _maskplan_text(self, elem: Any) -> str:
        """``json.dumps(elem, separators=(",", ":"))``. An epoch's ``("open", epoch, opened)`` (a new
        element every epoch) is written around the JSON of its ``opened``, encoded once while it
        stays the same (a decode's one open cell of one value, epoch after epoch)."""
        if isinstance(elem, tuple) and len(elem) == 3 and elem[0] == "open":
            e, opened = elem[1], elem[2]
            if type(e) is int:  # (not a bool: JSON's true)
                if opened != self._opened:
                    self._opened_json = json.dumps(opened, separators=(",", ":"))
                    self._opened = opened
                return f'["open",{e},{self._opened_json}]'
        return json.dumps(elem, separators=(",", ":"))

    def _epoch_rows(self, engine: Engine, record: EpochRecord) -> _EpochRows:
        """The epoch's per-cell rows and totals: from the records, or (``record.log``) the
        owners' merged summary when they wrote the per-cell rows into their stores."""
        if record.log is None:  # the per-cell rows come from the records
            ones = [one for one in map(OneCell.of, record.values) if one is not None]
            if len(ones) == len(record.values):  # one open cell per value (a decode's epoch)
                return self._one_cell_rows(record, ones)
            commits = commit_rows(record)
            trace = self.tracer.record(engine, record) if self.tracer is not None else None
            # (NumPy: torch's threaded count over a row of k = V candidates costs milliseconds)
            candidates = sum(int(np.count_nonzero(ve.valid.cpu().numpy())) for ve in record.values)
            return _EpochRows(commits, trace, candidates, committed_sum(record.values))
        trace = None
        if self.tracer is not None:
            trace = TraceRows(summary=list(record.log.summary), decided=record.log.decided)
        return _EpochRows([], trace, record.log.candidates, record.log.checksum)

    def _one_cell_rows(self, record: EpochRecord, ones: list[OneCell]) -> _EpochRows:
        """:meth:`_epoch_rows` of an epoch whose values had one open cell each, from their numbers
        read once (``ones``): the rows and totals of the general path (the tests hold them
        equal), without its tensor reads per field."""
        e = record.epoch
        commits = [
            one_commit_row(
                e,
                ve.value,
                one.cell,
                one.col_rule[one.winner],
                one.clock,
                one.score[one.winner],
                0 if one.checksum is None else one.checksum,
            )
            for ve, one in zip(record.values, ones)
            if one.changed
        ]
        trace = None if self.tracer is None else self.tracer.rows(e, record.values, ones)
        sums = [one.checksum if one.changed else 0 for one in ones if one.checksum is not None]
        checksum = wrap64(sum(sums)) if sums else None
        return _EpochRows(commits, trace, sum(sum(one.valid) for one in ones), checksum)

    def _log_ruleset(self, engine: Engine) -> None:
        """Insert the RuleSet events made since the last epoch (inside the caller's transaction:
        they commit with the epoch they govern)."""
        assert self.conn is not None
        new = engine.ruleset_events[self._ruleset_logged :]
        if not new:
            return
        now = time.time()
        self.conn.executemany(
            "INSERT INTO ruleset_events (epoch, op, name, clock, by, at) VALUES (?,?,?,?,?,?)",
            [(ev.epoch, ev.op, ev.name, ev.clock, ev.by, now) for ev in new],
        )
        self._ruleset_logged = len(engine.ruleset_events)

    def on_end(self, engine: Engine) -> None:
        """Record why the run stopped (meta ``stop``: :meth:`StopReason.to_json`) and the RuleSet
        events made after the last epoch, then checkpoint the final state, so reading or resuming
        a finished run replays nothing."""
        if self.conn is None:
            return
        if engine.stop is not None:
            try:
                self.conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('stop', ?)",
                    (json.dumps(engine.stop.to_json()),),
                )
            except sqlite3.Error as e:
                raise sqlite_error(
                    e, "record why the run stopped in", db_path(self.run_dir)
                ) from None
        if len(engine.ruleset_events) > self._ruleset_logged:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                self._log_ruleset(engine)
                self.conn.execute("COMMIT")
            except sqlite3.Error as e:
                _rollback(self.conn)
                raise sqlite_error(e, "record the RuleSet in", db_path(self.run_dir)) from None
        if engine.epoch == self._checkpointed:
            return
        rel, nbytes, sha = write_checkpoint(
            self.run_dir, engine, engine.epoch, self.info.program_hash
        )
        try:
            self.conn.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?,?)",
                (engine.epoch, rel, nbytes, sha, time.time()),
            )
        except sqlite3.Error as e:
            (self.run_dir / rel).unlink(missing_ok=True)
            raise sqlite_error(e, "record the final checkpoint in", db_path(self.run_dir)) from None
        self._checkpointed = engine.epoch

    def mark(self, status: str, error: str | None = None) -> None:
        """Record how the run ended when it did not finish ("failed" with the error, or
        "interrupted"). Best effort: on a full disk the log keeps "running", which resume handles
        the same way."""
        if self.conn is None:
            return
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute(
                "UPDATE meta SET value = ? WHERE key = 'status'", (json.dumps(status),)
            )
            self.conn.execute(
                "INSERT OR REPLACE INTO meta VALUES ('error', ?)", (json.dumps(error),)
            )
            self.conn.execute("COMMIT")
        except sqlite3.Error:
            _rollback(self.conn)

    def finish(self, outputs: Iterable[Path] = ()) -> None:
        """Mark the run finished (its outputs are written) and close the log."""
        if self.conn is None:
            return
        try:
            self._finish(outputs)
        except sqlite3.Error as e:
            _rollback(self.conn)
            raise sqlite_error(e, "mark the run finished in", db_path(self.run_dir)) from None
        self.close()

    def _finish(self, outputs: Iterable[Path]) -> None:
        assert self.conn is not None
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'status'", (json.dumps("finished"),)
        )
        self.conn.execute(
            "INSERT OR REPLACE INTO meta VALUES ('outputs', ?)",
            (json.dumps(sorted(p.name for p in outputs)),),
        )
        self.conn.execute(
            "INSERT OR REPLACE INTO meta VALUES ('finished_at', ?)", (json.dumps(time.time()),)
        )
        self.conn.execute("DELETE FROM meta WHERE key = 'error'")
        self.conn.execute("COMMIT")

    def close(self) -> None:
        """Close the payload stores, then the log: each close folds its WAL into its database and
        fsyncs it, in the two-step commit's order (a power cut between the two leaves payload
        rows of epochs the log lacks, which resume drops; never a logged epoch without them)."""
        dp = getattr(self, "_dataplane", None)
        try:
            if dp is not None:
                dp.close_store()
        finally:
            if self.conn is not None:
                self.conn.close()
                self.conn = None

    def _prune_files(self) -> None:
        """Delete checkpoint files no committed row references (pruned ones, or a crash's orphan):
        files of LMPM's checkpoint names only, in a real ``checkpoints/`` folder of the run (a
        user's ``checkpoints/best.pt`` stays; a link in its place is refused, D032)."""
        assert self.conn is not None
        keep = {str(r[0]) for r in self.conn.execute("SELECT file FROM checkpoints")}
        # a control checkpoint's worker shards share its "epoch-NNNNNNNN." prefix
        prefixes = {Path(f).name.split(".")[0] + "." for f in keep}
        ckdir = folder(self.run_dir, CHECKPOINT_DIR, action="prune")
        if not ckdir.is_dir():
            return
        stale = []
        for name in os.listdir(ckdir):
            if not CHECKPOINT_NAME.fullmatch(name) or f"{CHECKPOINT_DIR}/{name}" in keep:
                continue
            if name.split(".")[0] + "." in prefixes and name.count(".") >= 2:
                continue
            stale.append(name)
        remove_files(self.run_dir, CHECKPOINT_DIR, stale)


@dataclass(frozen=True, slots=True)
class _EpochRows:
    """What one epoch adds to the log besides its record's own fields."""

    commits: list[tuple[Any, ...]]  # the ``commits`` rows (none: the owners' stores hold them)
    trace: TraceRows | None  # None: the run is not traced
    candidates: int  # valid candidates over every open cell
    checksum: int | None  # of the committed payloads (:func:`committed_sum`; None: not known)

    def epoch_row(self, record: EpochRecord, seconds: float, maskplan: str) -> tuple[Any, ...]:
        """The ``epochs`` row (:data:`INSERT_EPOCH`); ``seconds``: the time spent logging it."""
        return (
            record.epoch,
            record.open_cells,
            record.attempts,
            self.candidates,
            record.commits,
            record.violations,
            None if self.trace is None else self.trace.decided,
            record.seconds,
            record.model_seconds,
            seconds,
            maskplan,
            time.time(),
            record.control_bytes,
            record.halo_bytes,
            record.driver_cpu_s,
            self.checksum,
        )


def _insert_faults(conn: sqlite3.Connection, record: EpochRecord) -> None:
    """The epoch's worker faults and quorum dissent (inside the epoch's transaction)."""
    if record.faults:
        now = time.time()
        conn.executemany(
            "INSERT INTO worker_faults (epoch, worker, phase, cause, seconds, pid, at) "
            "VALUES (?,?,?,?,?,?,?)",
            [(f.epoch, f.worker, f.phase, f.cause, f.seconds, f.pid, now) for f in record.faults],
        )
    if record.dissent:
        conn.executemany(
            "INSERT INTO quorum_dissent (epoch, value, replica, worker, cells) VALUES (?,?,?,?,?)",
            [(record.epoch, d.value, d.replica, d.worker, d.cells) for d in record.dissent],
        )


def _insert_checkpoint(conn: sqlite3.Connection, label: int, ckpt: tuple[str, int, str]) -> None:
    """Log checkpoint ``ckpt`` (file, bytes, sha256) of epoch ``label``, keeping the newest
    :data:`KEEP_CHECKPOINTS` besides epoch 0's."""
    conn.execute(
        "INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?,?)", (label, *ckpt, time.time())
    )
    conn.execute(
        "DELETE FROM checkpoints WHERE epoch > 0 AND epoch NOT IN "
        "(SELECT epoch FROM checkpoints ORDER BY epoch DESC LIMIT ?)",
        (KEEP_CHECKPOINTS,),
    )


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back if a transaction is open (SQLite rolls back by itself on SQLITE_FULL)."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
