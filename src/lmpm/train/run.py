"""The control plane of a training run: epochs of propose → check → agree → commit on a Params value.

Per epoch (one outer step): every worker runs its ``minimize`` inner loop and returns metadata
(:class:`~lmpm.train.worker.Proposal`); :func:`lmpm.train.policy.decide` turns the constraints and
the commit policy into per-cell weights; the workers all-reduce and apply the outer step among
themselves and report the committed θ's checksum, which must agree across workers; worker 0
writes the checkpoint; then the epoch goes into the log in one transaction (durable last). The
control plane never holds a parameter tensor.

>>> from lmpm.train.spec import DataSpec
>>> load_rows(b"hello world!", DataSpec("T", "t", length=4, rows=3, vocab=256)).tolist()
[[104, 101, 108, 108], [111, 32, 119, 111], [114, 108, 100, 33]]
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmpm.errors import InputError, RunDirError, RuntimeFault, UsageError
from lmpm.runtime.runfiles import claim_folder, folder, log_name, read_file
from lmpm.train import log as tlog
from lmpm.train.driver import (
    DEFAULT_TIMEOUT,
    MAX_RETRIES,
    EpochLost,
    LocalDriver,
    RayDriver,
    RayDriverOptions,
    TrainFault,
    WorkerLost,
)
from lmpm.train.policy import Decision, decide
from lmpm.train.spec import DataSpec, TrainSpec
from lmpm.train.worker import Committed, Proposal, inner_path, ring_bytes

CHECKPOINTS = "checkpoints"
KEEP = 2  # newest checkpoints kept (besides epoch 0's)
# the files a training run writes in checkpoints/ (and their temporary files): --force deletes
# these and nothing else there
CHECKPOINT_NAME = re.compile(r"\.?(params-\d{6}\.safetensors|inner-w\d+-\d{6}\.pt)(\.tmp)?")


def load_rows(src: str | Path | bytes, d: DataSpec) -> Tensor:
    """A data value's (rows, length) tokens from a ``.npy`` array of the value's shape (``[L]`` for
    ``Seq(L)``, ``[L, R]`` for ``Grid2D(L, R)``, as every LMPM input) or from text (bytes, row
    after row)."""
    where = {"value": d.name}
    if isinstance(src, bytes):
        raw = np.frombuffer(src, dtype=np.uint8).astype(np.int64)
        arr = raw
    else:
        p = Path(src)
        where["file"] = str(p)
        if not p.is_file():
            raise InputError(f"input file for `{d.name}` not found: {p}", where=where, code="R001")
        if p.suffix.lower() == ".npy":
            try:
                a = np.load(p, allow_pickle=False)
            except Exception as e:
                raise InputError(f"cannot read {p}: {e}", where=where, code="R002") from None
            want = (d.length,) if d.rows == 1 else (d.length, d.rows)
            if tuple(a.shape) != want or a.dtype.kind not in "iu":
                raise InputError(
                    f"{p} holds a {a.dtype} array of shape {list(a.shape)}; `{d.name}` needs "
                    f"integers of shape {list(want)}",
                    where=where,
                    code="R003",
                )
            arr = a.T.reshape(-1).astype(np.int64) if d.rows > 1 else a.astype(np.int64)
        else:
            arr = np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int64)
    need = d.rows * d.length
    if arr.size < need:
        raise InputError(
            f"`{d.name}` needs {need} tokens ({d.rows} rows of {d.length}); the input has "
            f"{arr.size}",
            where=where,
            code="R003",
        )
    rows = torch.from_numpy(arr[:need].copy()).view(d.rows, d.length)
    if int(rows.min()) < 0 or int(rows.max()) >= d.vocab:
        raise InputError(
            f"`{d.name}` holds tokens outside 0..{d.vocab - 1} (every cell of a data value must be "
            "set)",
            where=where,
            code="R003",
        )
    return rows


@dataclass(frozen=True, slots=True)
class EpochReport:
    """What the progress line and the API see of one committed epoch."""

    epoch: int
    loss: float
    eval_loss: float | None
    tokens: int
    seconds: float
    bytes: int
    changed: int
    frozen: int
    projected: int
    rejected: int
    checksum: str
    faults: tuple[TrainFault, ...] = ()


@dataclass(slots=True)
class TrainResult:
    epochs: list[EpochReport] = field(default_factory=list)
    faults: list[TrainFault] = field(default_factory=list)
    output: Path | None = None
    seconds: float = 0.0

    @property
    def loss(self) -> float:
        return self.epochs[-1].loss if self.epochs else float("nan")

    @property
    def eval_loss(self) -> float | None:
        return self.epochs[-1].eval_loss if self.epochs else None

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.epochs)

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.epochs)


class Trainer:
    """A training run of ``spec`` over ``data`` (each data value's (rows, length) tokens).

    ``driver``: ``single`` (the workers in this process) or ``ray`` (a Ray actor per worker;
    the default for more than one worker). ``init``: a state dict to start θ from (else the
    module's seeded initialisation). ``run_dir``: where the log, checkpoints and the output go.
    ``threads``: torch threads per worker (Ray: default 1; in-process: this process's setting).
    Runs with the same seed, workers and threads commit bit-identical parameters on either driver
    (the thread count changes how torch sums, so it is part of the recipe).
    """

    def __init__(
        self,
        spec: TrainSpec,
        data: dict[str, Tensor],
        *,
        epochs: int,
        workers: int = 1,
        driver: str | None = None,
        run_dir: str | Path | None = None,
        init: dict[str, Tensor] | None = None,
        cluster: str | None = None,
        worker_timeout: float | None = None,
        threads: int | None = None,
        meta: dict[str, Any] | None = None,
        progress: Callable[[EpochReport], None] | None = None,
        resume: bool = False,
    ) -> None:
        if epochs < 1:
            raise UsageError(f"--epochs {epochs}: a training run needs at least one", code="U091")
        if workers < 1:
            raise UsageError(f"--workers {workers}: must be at least 1", code="U080")
        self.spec = spec
        self.epochs = epochs
        self.workers = workers
        self.driver_name = driver or ("ray" if workers > 1 else "single")
        if self.driver_name not in ("single", "ray"):
            raise UsageError(
                f"--driver {self.driver_name}: a training run runs on `single` or `ray`",
                code="U080",
            )
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.progress = progress
        total = epochs * spec.rule.steps
        self.log: tlog.TrainLog | None = None
        self.first = 1  # the first epoch this run trains
        restart: Path | None = None
        clocks: list[int] | None = None
        if resume:
            if self.run_dir is None:
                raise UsageError("resuming needs the run directory", code="U026")
            hist = tlog.read(self.run_dir)
            self.first = (hist.epochs[-1]["epoch"] if hist.epochs else 0) + 1
            ck = {c["epoch"]: c for c in hist.checkpoints}.get(self.first - 1)
            restart = _checked_checkpoint(self.run_dir, ck, self.first - 1)
            clocks = hist.meta.get("clocks")
            self.log = tlog.TrainLog.open(self.run_dir)
            resumes = [*hist.meta.get("resumes", []), {"at": time.time(), "from": self.first - 1}]
            self.log.set_meta({"epochs": epochs, "resumes": resumes, **(meta or {})})
            self.log.claim()
            self.log.mark("running")
        elif self.run_dir is not None:
            claim_folder(self.run_dir)  # never into a folder of the user's own files (D034)
            self.log = tlog.TrainLog.create(
                self.run_dir,
                {
                    "program": spec.file,
                    "module": spec.params.module,
                    "value": spec.params.name,
                    "workers": workers,
                    "driver": self.driver_name,
                    "policy": _policy_meta(spec),
                    "steps": spec.rule.steps,
                    "batch": spec.rule.batch,
                    "epochs": epochs,
                    **(meta or {}),
                },
            )
        # a real folder of the run: a link in its place is refused (D032), never written through
        ckdir = folder(self.run_dir, CHECKPOINTS, create=True) if self.run_dir is not None else None
        try:
            if self.driver_name == "ray":
                timeout = DEFAULT_TIMEOUT if worker_timeout is None else worker_timeout
                self.driver: LocalDriver | RayDriver = RayDriver(
                    spec,
                    workers,
                    data,
                    total_steps=total,
                    init=init,
                    threads=threads,
                    options=RayDriverOptions(cluster, timeout, ckdir),
                )
            else:
                self.driver = LocalDriver(
                    spec, workers, data, total_steps=total, init=init, threads=threads
                )
        except BaseException as e:
            self._fail(e)
            raise
        self.names = self.driver.names()
        self.clocks = list(clocks) if clocks else [0] * len(self.names)
        self._ckdir = ckdir
        self._kept: list[Path] = []
        if restart is not None:
            try:
                self.driver.restore(restart)
            except BaseException as e:
                self._fail(e)
                self.driver.close()
                raise
            assert ckdir is not None
            self._kept = sorted(p for p in ckdir.glob("params-*.safetensors") if p.name != _ck(0))

    def _fail(self, e: BaseException) -> None:
        if self.log is not None:
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            self.log.mark(status, None if isinstance(e, KeyboardInterrupt) else str(e))
            self.log.close()
            self.log = None

    def _workers_table(self, state: str) -> None:
        if self.log is None:
            return
        for i, w in enumerate(self.driver.info()):
            self.log.worker(
                w["worker"],
                backend=w["backend"],
                host=w["host"],
                pid=w["pid"],
                state=state,
                restarts=self.driver.restarts[i],
            )

    def _checkpoint(self, epoch: int) -> tuple[str, int, str] | None:
        """θ and the outer momentum (worker 0) and every worker's inner state, renamed into place
        before the log names them; the newest KEEP epochs are kept, and epoch 0's."""
        if self._ckdir is None:
            if isinstance(self.driver, RayDriver):  # recovery needs a file: the driver's tmp dir
                self.driver.checkpoint(self.driver.checkpoint_dir / "params.safetensors", epoch)
            return None
        rel = f"{CHECKPOINTS}/{_ck(epoch)}"
        path = self._ckdir.parent / rel
        nbytes, sha = self.driver.checkpoint(path, epoch)
        if epoch > 0:
            self._kept.append(path)
            while len(self._kept) > KEEP:
                old = self._kept.pop(0)
                old.unlink(missing_ok=True)
                for i in range(self.workers):
                    inner_path(old, i).unlink(missing_ok=True)
        return rel, nbytes, sha

    def _epoch(self, epoch: int) -> tuple[list[Proposal | None], Decision, list[Committed]]:
        """Propose, decide, commit; redone (up to MAX_RETRIES times) when the commit fails."""
        for _ in range(MAX_RETRIES + 1):
            props = self.driver.propose(epoch)
            dec = decide(self.spec, self.names, epoch, props)
            try:
                return props, dec, self.driver.commit(epoch, dec.weights, dec.keep)
            except EpochLost:
                continue
        raise WorkerLost(
            f"training workers failed {MAX_RETRIES + 1} times in the commit of epoch {epoch}",
            where={"epoch": epoch},
            code="R060",
            hint="the run directory holds every epoch before this one",
        )

    def run(self) -> TrainResult:
        """Train every epoch; the log is marked finished (or failed, with the error)."""
        try:
            return self._run()
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self.driver.close()

    def _run(self) -> TrainResult:
        t_start = time.perf_counter()
        result = TrainResult()
        if self.first == 1:
            ck0 = self._checkpoint(0)
            if self.log is not None and ck0 is not None:
                self.log.conn.execute(
                    "INSERT OR REPLACE INTO checkpoints VALUES (0, ?, ?, ?, ?)",
                    (*ck0, time.time()),
                )
        self._workers_table("training")
        numel = self.driver.numel()
        for epoch in range(self.first, self.epochs + 1):
            t0 = time.perf_counter()
            props, dec, done = self._epoch(epoch)
            sums = {c.checksum for c in done}
            if len(sums) != 1:
                ref = done[0].checksum
                odd = [f"w{c.worker}" for c in done if c.checksum != ref]
                raise RuntimeFault(
                    f"the workers committed different parameters in epoch {epoch}",
                    where={"worker": ", ".join(odd), "epoch": epoch},
                    code="R071",
                )
            faults = tuple(self.driver.take_faults())
            result.faults += faults
            alive = [p for p in props if p is not None]
            changed = 0
            for c, keep in enumerate(dec.keep):
                if keep and any(p.changed[c] for p in alive):
                    self.clocks[c] += 1
                    changed += 1
            projected = {c for d in done for c in d.projected}
            inner = max((p.seconds for p in alive), default=0.0)
            nsteps = max((len(p.losses) for p in alive), default=0)
            steps = [
                sum(p.losses[i] for p in alive if i < len(p.losses))
                / max(sum(1 for p in alive if i < len(p.losses)), 1)
                for i in range(nsteps)
            ]
            loss = sum(steps) / max(len(steps), 1)
            moved = ring_bytes(numel, self.workers)
            checksum = f"{done[0].checksum:08x}"
            ck = self._checkpoint(epoch)
            seconds = time.perf_counter() - t0
            report = EpochReport(
                epoch,
                loss,
                done[0].eval_loss,
                sum(p.tokens for p in alive),
                seconds,
                moved,
                changed,
                dec.frozen,
                len(projected),
                dec.rejected,
                checksum,
                faults,
            )
            result.epochs.append(report)
            if self.log is not None:
                for f in faults:
                    self.log.fault(f.epoch, f.worker, f.phase, f.cause, f.seconds, f.pid)
                rows = [
                    tlog.WorkerRow(
                        epoch,
                        f"w{p.worker}",
                        len(p.losses),
                        sum(p.losses) / max(len(p.losses), 1),
                        p.losses[-1] if p.losses else float("nan"),
                        p.tokens,
                        p.seconds,
                        p.eval_loss,
                    )
                    for p in alive
                ]
                self.log.epoch(
                    tlog.EpochRow(
                        epoch,
                        loss,
                        report.eval_loss,
                        report.tokens,
                        seconds,
                        inner,
                        moved,
                        changed,
                        dec.frozen,
                        len(projected),
                        dec.rejected,
                        max(self.clocks, default=0),
                        checksum,
                    ),
                    workers=rows,
                    steps=steps,
                    constraints=[
                        r
                        if r.kind != "norm"
                        else tlog.ConstraintRow(
                            r.epoch,
                            r.name,
                            r.kind,
                            r.checked,
                            r.violations,
                            "projected" if projected else "none",
                        )
                        for r in dec.constraints
                    ],
                    checkpoint=ck,
                    meta={"clocks": self.clocks},
                )
                if faults:
                    self._workers_table("training")
            if self.progress is not None:
                self.progress(report)
        result.seconds = time.perf_counter() - t_start
        if self.run_dir is not None:
            out = self.run_dir / f"{self.spec.params.name}.safetensors"
            self.driver.save(out, self.epochs)
            result.output = out
        if self.log is not None:
            self._workers_table("done")
            self.log.set_meta({"seconds": round(result.seconds, 3)})
            self.log.mark("finished")
            self.log.close()
            self.log = None
        return result


def _checked_checkpoint(run_dir: Path, ck: dict[str, Any] | None, epoch: int) -> Path:
    """The parameters checkpoint the log names for ``epoch``, checked before anything loads it: a
    plain name in checkpoints/ (D033), a regular file (D032) of the recorded sha256 (D021)."""
    if ck is None:
        raise RunDirError(
            f"{run_dir}: the checkpoint of epoch {epoch} is missing",
            code="D022",
            hint="start the run over (--force)",
        )
    rel = log_name(ck.get("file"), CHECKPOINTS)
    size = ck.get("bytes")
    try:
        data = read_file(run_dir, rel, limit=size if isinstance(size, int) else None)
    except OSError:
        raise RunDirError(
            f"{run_dir}: the checkpoint of epoch {epoch} ({rel}) is missing",
            code="D022",
            hint="start the run over (--force)",
        ) from None
    if hashlib.sha256(data).hexdigest() != ck.get("sha256"):
        raise RunDirError(f"{run_dir / rel} does not match its checksum in the log", code="D021")
    return run_dir / rel


def _ck(epoch: int) -> str:
    return f"params-{epoch:06d}.safetensors"


def _policy_meta(spec: TrainSpec) -> dict[str, Any]:
    p = spec.policy
    if p.kind == "diloco":
        return {
            "kind": "diloco",
            "outer_lr": p.outer_lr,
            "momentum": p.momentum,
            "nesterov": p.nesterov,
        }
    return {"kind": p.kind}


def parameters(path: str | Path) -> dict[str, Tensor]:
    """The parameters (by the module's parameter names) of a checkpoint or output file."""
    return load_init(path)


def load_init(path: str | Path) -> dict[str, Tensor]:
    """A state dict from a safetensors file: a module's own weights (``weights.save``), or an LMPM
    training checkpoint/output (``param/<name>`` keys)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"initial parameters not found: {p}", where={"file": str(p)}, code="R001")
    from safetensors.torch import load_file

    try:
        state = load_file(str(p))
    except Exception as e:
        raise InputError(f"cannot read {p}: {e}", where={"file": str(p)}, code="R002") from None
    if any(k.startswith("param/") for k in state):
        return {k.removeprefix("param/"): v for k, v in state.items() if k.startswith("param/")}
    return dict(state)
