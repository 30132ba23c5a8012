"""Where the training workers run: in this process (``single``), or as Ray actors (``ray``).

Both drivers do the same three things per epoch for the control plane: ``propose`` (every worker
runs its inner loop; metadata comes back), ``commit`` (the workers all-reduce their weighted
candidates among themselves and apply the outer step; each reports the new θ's checksum) and
``save`` (worker 0 writes the committed θ and the outer momentum as a safetensors checkpoint).

The Ray driver is also the supervisor. Each worker is an actor in its own process with a gloo
process group per membership generation (a gloo group cannot survive a dead peer). A worker that
dies (SIGKILL, a lost node) or hangs past ``timeout`` in its inner loop is killed and replaced by a
new actor; all workers join a new generation, a survivor broadcasts the committed θ, the outer
momentum and the schedule's step to it (worker to worker), and the epoch commits with the
candidates that arrived: the new worker rejoins at the next outer step. A fault during the commit
(every worker is then blocked in the all-reduce) replaces the workers that do not answer, restores
every worker from the last checkpoint and redoes the epoch. Faults are kept in
:attr:`RayDriver.faults` (and the log's ``worker_faults``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import LmpmError, RunDirError, UsageError
from lmpm.runtime.data.raygroup import (
    WorkerLost,
    WorkersFailed,
    gather,
    import_ray,
    probe_cluster,
)
from lmpm.runtime.data.raylog import quiet_worker_deaths
from lmpm.runtime.lock import atomic_write
from lmpm.train.spec import TrainSpec
from lmpm.train.worker import Committed, Proposal, TrainWorker, inner_path

DEFAULT_TIMEOUT = 600.0  # seconds one worker's inner loop may take before it counts as hung
MAX_RETRIES = 3
START_LIMIT = 180.0
TRAIN_PHASES = ("propose", "commit")


@dataclass(frozen=True, slots=True)
class TrainFault:
    worker: str
    epoch: int
    phase: str
    cause: str  # died | hung | blocked
    seconds: float  # from detection until the workers were ready again
    pid: int


def save_state(
    path: Path, state: dict[str, Tensor], step: int, epoch: int, inner: list[str] | None = None
) -> tuple[int, str]:
    """Write a checkpoint atomically; (bytes, sha256). ``inner``: the sha256 of each worker's
    inner state file beside it, by rank (checked when it is loaded)."""
    from safetensors.torch import save

    meta = {"step": str(step), "epoch": str(epoch)}
    if inner is not None:
        meta["inner"] = json.dumps(inner)
    data = save({k: v.contiguous() for k, v in state.items()}, metadata=meta)
    atomic_write(path, data)
    return len(data), hashlib.sha256(data).hexdigest()


def load_state(path: Path) -> tuple[dict[str, Tensor], int, list[str | None]]:
    """(θ and momentum, the schedule step, each worker's inner state sha256: None where a
    checkpoint from before they were recorded has none) of a checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        step = int(meta.get("step", "0"))
        inner = json.loads(meta.get("inner", "[]"))
        if not isinstance(inner, list) or not all(isinstance(s, str) for s in inner):
            raise ValueError("its `inner` checksums are not a list of strings")
        return load_file(str(path)), step, list(inner)
    except Exception as e:  # OSError, bad JSON or numbers, safetensors' own SafetensorError
        raise RunDirError(f"checkpoint {path} is unreadable ({e})", code="D021") from None


def _inner_sha(inner: list[str | None], rank: int) -> str | None:
    return inner[rank] if rank < len(inner) else None


def parse_fault(text: str, workers: int) -> tuple[int, str, int, str]:
    """``w<i>:<propose|commit>:<epoch>[:kill|hang]`` (LMPM_INJECT_FAULT for a training run)."""
    parts = text.strip().split(":")
    how = parts[3] if len(parts) == 4 else "kill"
    ok = len(parts) in (3, 4) and parts[0][:1] == "w" and parts[0][1:].isdigit()
    ok = ok and parts[1] in TRAIN_PHASES and parts[2].isdigit() and how in ("kill", "hang")
    if not ok or int(parts[0][1:]) >= workers:
        raise UsageError(
            f"LMPM_INJECT_FAULT={text!r}: give w<i>:<phase>:<epoch>[:kill|hang] with i < {workers} "
            f"and phase one of {', '.join(TRAIN_PHASES)}",
            code="U085",
        )
    return int(parts[0][1:]), parts[1], int(parts[2]), how


class LocalDriver:
    """W workers in this process, one after another; the all-reduce is a sum in worker order."""

    backend = "cpu"

    def __init__(
        self,
        spec: TrainSpec,
        workers: int,
        data: dict[str, Tensor],
        *,
        total_steps: int,
        init: dict[str, Tensor] | None = None,
        threads: int | None = None,
    ) -> None:
        if threads is not None:  # process-wide: this driver's workers share this process
            torch.set_num_threads(threads)
        self.size = workers
        self.workers = [
            TrainWorker(spec, r, workers, data, total_steps=total_steps, init=init)
            for r in range(workers)
        ]
        self.faults: list[TrainFault] = []
        self.restarts = [0] * workers

    def names(self) -> list[str]:
        return self.workers[0].names

    def numel(self) -> int:
        return self.workers[0].numel()

    def propose(self, epoch: int) -> list[Proposal | None]:
        return [w.propose(epoch) for w in self.workers]

    def commit(self, epoch: int, weights: list[list[float]], keep: list[bool]) -> list[Committed]:
        total = self.workers[0].contribution(weights[0])
        for w, a in zip(self.workers[1:], weights[1:], strict=True):
            total = total + w.contribution(a)
        return [w.commit(epoch, total, keep) for w in self.workers]

    def save(self, path: Path, epoch: int, inner: list[str] | None = None) -> tuple[int, str]:
        w = self.workers[0]
        return save_state(path, w.state(), w.step, epoch, inner)

    def checkpoint(self, path: Path, epoch: int) -> tuple[int, str]:
        """Every worker's inner state, then the parameters (worker 0) naming their sha256."""
        inner = [w.save_inner(inner_path(path, w.rank)) for w in self.workers]
        return self.save(path, epoch, inner)

    def restore(self, path: Path) -> None:
        state, step, inner = load_state(path)
        for w in self.workers:
            w.load_state(state, step)
            w.load_inner(inner_path(path, w.rank), _inner_sha(inner, w.rank))
            w.proposed = None

    def info(self) -> list[dict[str, Any]]:
        return [
            {"worker": f"w{i}", "backend": "cpu", "host": socket.gethostname(), "pid": os.getpid()}
            for i in range(self.size)
        ]

    def take_faults(self) -> list[TrainFault]:
        return []

    def inject(self, worker: int, phase: str, epoch: int, how: str = "kill") -> None:
        raise UsageError(
            "fault injection needs worker processes",
            code="U088",
            hint="lmpm run --workers N --driver ray",
        )

    def close(self) -> None:
        """Nothing to stop (the workers stay readable: tests, the Python API)."""


class TrainActor:
    """The body of one Ray actor: a :class:`TrainWorker` and its gloo process group."""

    def __init__(
        self, spec: TrainSpec, rank: int, world: int, data: Any, total: int, init: Any, threads: int
    ):
        torch.set_num_threads(threads)
        self.rank = rank
        self.w = TrainWorker(spec, rank, world, data, total_steps=total, init=init)
        self.faults: list[tuple[str, int, str]] = []

    def hello(self) -> tuple[int, str]:
        return os.getpid(), socket.gethostname()

    def node(self) -> str:
        from lmpm.runtime.data.raygroup import node_id

        return node_id()

    def rendezvous(self) -> tuple[str, int]:
        from lmpm.runtime.data.raygroup import rendezvous

        return rendezvous()

    def join(self, addr: str, port: int, world: int, timeout: float) -> None:
        from lmpm.runtime.data.raygroup import join_gloo

        join_gloo(addr, port, self.rank, world, timeout)

    def share(self, src: int) -> int:
        """Broadcast the committed state from worker ``src`` to every worker (after a respawn)."""
        import torch.distributed as dist

        w = self.w
        buf = torch.cat(
            [
                torch.cat([c.reshape(-1) for c in w.committed]),
                torch.cat([m.reshape(-1) for m in w.momentum]),
                torch.tensor([float(w.step)]),
            ]
        )
        dist.broadcast(buf, src)
        if self.rank != src:
            off = 0
            for t in [*w.committed, *w.momentum]:
                t.copy_(buf[off : off + t.numel()].view_as(t))
                off += t.numel()
            w.step = int(buf[-1])
        return int(buf.numel() * 4)

    def names(self) -> list[str]:
        return self.w.names

    def numel(self) -> int:
        return self.w.numel()

    def propose(self, epoch: int) -> Proposal:
        due = [f for f in self.faults if f[:2] == ("propose", epoch)]
        if due:
            self.faults.remove(due[0])
            self.w.propose(epoch, steps=max(self.w.spec.rule.steps // 2, 0))  # mid inner loop
            self._fail(due[0][2])
        return self.w.propose(epoch)

    def commit(self, epoch: int, weights: list[float], keep: list[bool]) -> Committed:
        import torch.distributed as dist

        due = [f for f in self.faults if f[:2] == ("commit", epoch)]
        if due:
            self.faults.remove(due[0])
            self._fail(due[0][2])
        if self.w.proposed is None:  # respawned this epoch: no candidate
            part = torch.zeros(self.w.numel())
        else:
            part = self.w.contribution(weights)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(part)
        return self.w.commit(epoch, part, keep)

    def save(self, path: str, epoch: int, inner: list[str] | None = None) -> tuple[int, str]:
        return save_state(Path(path), self.w.state(), self.w.step, epoch, inner)

    def save_inner(self, path: str) -> str:
        return self.w.save_inner(inner_path(Path(path), self.rank))

    def restore(self, path: str) -> None:
        state, step, inner = load_state(Path(path))
        self.w.load_state(state, step)
        self.w.load_inner(inner_path(Path(path), self.rank), _inner_sha(inner, self.rank))
        self.w.proposed = None

    def inject(self, phase: str, epoch: int, how: str) -> None:
        self.faults.append((phase, epoch, how))

    def _fail(self, how: str) -> None:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10**6)


class EpochLost(Exception):
    """The commit of an epoch failed and the workers are back at its start: redo it."""


@dataclass(frozen=True, slots=True)
class RayDriverOptions:
    """Where and how :class:`RayDriver` runs its workers. Not the epoch engine's
    :class:`lmpm.runtime.data.raygroup.RayOptions`: a training worker's hang timeout bounds its
    whole inner loop (600 s), not one phase of an epoch (120 s), and its recovery checkpoints go
    to a folder rather than every ``checkpoint_every`` epochs into the run's log."""

    # a running Ray cluster's address; None starts a local Ray instance on 127.0.0.1 for the run
    cluster: str | None = None
    timeout: float = DEFAULT_TIMEOUT  # seconds a worker's inner loop may take before it is hung
    checkpoint_dir: Path | None = None  # the recovery checkpoints' folder (None: a temporary one)


class RayDriver:
    """W workers as Ray actors (see the module doc), placed and timed by ``options``."""

    backend = "cpu"

    def __init__(
        self,
        spec: TrainSpec,
        workers: int,
        data: dict[str, Tensor],
        *,
        total_steps: int,
        init: dict[str, Tensor] | None = None,
        threads: int | None = None,
        options: RayDriverOptions = RayDriverOptions(),
    ) -> None:
        cluster, checkpoint_dir = options.cluster, options.checkpoint_dir
        if options.timeout <= 0:
            raise UsageError(f"worker timeout {options.timeout}: must be positive", code="U083")
        ray = import_ray()
        self.size = workers
        self.timeout = float(options.timeout)
        self.faults: list[TrainFault] = []
        self._new: list[TrainFault] = []
        self.restarts = [0] * workers
        self._owns_ray = False
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if checkpoint_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="lmpm-train-")
            checkpoint_dir = Path(self._tmp.name)
        self.checkpoint_dir = checkpoint_dir
        self.last_checkpoint: Path | None = None
        self._injected: list[tuple[int, str, int, str]] = []
        if not ray.is_initialized():
            if cluster:
                probe_cluster(cluster)
                ray.init(address=cluster, logging_level=logging.ERROR)
            else:
                ray.init(
                    address="local",
                    num_cpus=max(os.cpu_count() or 1, workers),
                    include_dashboard=False,
                    logging_level=logging.ERROR,
                    _node_ip_address="127.0.0.1",
                )
            self._owns_ray = True
        quiet_worker_deaths()  # the supervisor replaces a dead worker and says so itself
        self.threads = 1 if threads is None else int(threads)
        opts: dict[str, Any] = {
            "max_restarts": 0,
            "max_task_retries": 0,
            "num_cpus": self.threads,
        }
        if cluster:
            opts["scheduling_strategy"] = "SPREAD"
        self._cls = ray.remote(TrainActor).options(**opts)
        self._args = (spec, ray.put(data), int(total_steps), ray.put(init))
        self.actors = [self._spawn(i) for i in range(workers)]
        try:
            hello = self._get([a.hello.remote() for a in self.actors], START_LIMIT)
            self._join()
            self._names = self._get([self.actors[0].names.remote()], START_LIMIT)[0]
            self._numel = self._get([self.actors[0].numel.remote()], START_LIMIT)[0]
        except WorkersFailed as f:
            self.close()
            raise WorkerLost(
                f"the training workers could not start: {f.why or 'no answer'}",
                where={"worker": ", ".join(f"w{i}" for i, _ in f.failed)},
                code="R062",
            ) from None
        except LmpmError:
            self.close()
            raise
        self.pids = [p for p, _ in hello]
        self.hosts = [h for _, h in hello]

    # ---- actors -----------------------------------------------------------------------------------
    def _spawn(self, i: int) -> Any:
        spec, data, total, init = self._args
        return self._cls.remote(spec, i, self.size, data, total, init, self.threads)

    def _join(self) -> None:
        addr, port = self._get([self.actors[0].rendezvous.remote()], START_LIMIT)[0]
        self._get(
            [a.join.remote(addr, port, self.size, self.timeout) for a in self.actors], START_LIMIT
        )

    def _get(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        out, failed, why = self._gather(refs, timeout, grace=True)
        if failed:
            raise WorkersFailed(failed, why)
        return out

    def _gather(
        self, refs: list[Any], timeout: float | None, *, grace: bool
    ) -> tuple[list[Any], list[tuple[int, str]], str]:
        """Wait for every call: (answers, [(worker, died|hung|blocked)], Ray's first error), by
        the engine group's supervision policy (:func:`lmpm.runtime.data.raygroup.gather`). ``grace``:
        once one died, the others get a little longer (they are blocked in a collective on it)."""
        got = gather(refs, self.timeout if timeout is None else timeout, grace=grace)
        return got.out, got.lost(), got.why

    def _replace(self, i: int) -> None:
        import ray

        try:
            ray.kill(self.actors[i], no_restart=True)
        except Exception:
            pass
        self.actors[i] = self._spawn(i)
        self.restarts[i] += 1

    # ---- the epoch ------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._names)

    def numel(self) -> int:
        return int(self._numel)

    def propose(self, epoch: int) -> list[Proposal | None]:
        """Every worker's inner loop; a worker lost here is replaced, gets the committed state
        from a survivor, and has no candidate this epoch (it rejoins at the next outer step)."""
        refs = [a.propose.remote(epoch) for a in self.actors]
        out, failed, _ = self._gather(refs, None, grace=False)
        if not failed:
            return out
        t0 = time.perf_counter()
        lost = {i for i, _ in failed}
        for i in lost:
            self._replace(i)
        self._recovered(epoch, "propose", failed, t0, lost)
        alive = [i for i in range(self.size) if i not in lost]
        if not alive:  # nobody holds the state: back to the last checkpoint, redo the epoch
            self._restore_all()
            return self.propose(epoch)
        self._share(alive[0])
        return [None if i in lost else p for i, p in enumerate(out)]

    def _recovered(
        self, epoch: int, phase: str, failed: list[tuple[int, str]], t0: float, lost: set[int]
    ) -> None:
        hello = self._get([self.actors[i].hello.remote() for i in sorted(lost)], START_LIMIT)
        old = dict(enumerate(self.pids))
        for i, (pid, host) in zip(sorted(lost), hello, strict=True):
            self.pids[i], self.hosts[i] = pid, host
        for i, phase_, e, how in list(self._injected):
            if i in lost and e > epoch:
                self.actors[i].inject.remote(phase_, e, how)
        self._join()
        for i, cause in failed:
            fault = TrainFault(f"w{i}", epoch, phase, cause, time.perf_counter() - t0, old[i])
            self.faults.append(fault)
            self._new.append(fault)

    def _share(self, src: int) -> None:
        self._get([a.share.remote(src) for a in self.actors], START_LIMIT)

    def _restore_all(self) -> None:
        if self.last_checkpoint is None:
            raise WorkerLost("every worker was lost before the first checkpoint", code="R061")
        self.restore(self.last_checkpoint)

    def restore(self, path: Path) -> None:
        """Every worker back to a checkpoint: θ, momentum, its inner optimizer and step."""
        self._get([a.restore.remote(str(path)) for a in self.actors], START_LIMIT)
        self.last_checkpoint = path

    def commit(self, epoch: int, weights: list[list[float]], keep: list[bool]) -> list[Committed]:
        """Every worker all-reduces and applies the outer step. A worker lost here leaves the others
        blocked in the all-reduce: the ones that do not answer are replaced, every worker is
        restored from the last checkpoint, and :class:`EpochLost` tells the control plane to redo
        the epoch."""
        refs = [a.commit.remote(epoch, w, keep) for a, w in zip(self.actors, weights, strict=True)]
        out, failed, _ = self._gather(refs, None, grace=True)
        if not failed:
            return out
        t0 = time.perf_counter()
        lost = {i for i, _ in failed}
        for i in lost:
            self._replace(i)
        self._recovered(epoch, "commit", failed, t0, lost)
        self._restore_all()
        raise EpochLost(epoch)

    def save(self, path: Path, epoch: int) -> tuple[int, str]:
        out = self._get([self.actors[0].save.remote(str(path), epoch)], START_LIMIT)[0]
        return tuple(out)  # type: ignore[return-value]

    def checkpoint(self, path: Path, epoch: int) -> tuple[int, str]:
        """Every worker's inner state, then the parameters (worker 0) naming their sha256;
        recovery restores it."""
        inner = self._get([a.save_inner.remote(str(path)) for a in self.actors], START_LIMIT)
        out = self._get([self.actors[0].save.remote(str(path), epoch, inner)], START_LIMIT)[0]
        self.last_checkpoint = path
        return tuple(out)  # type: ignore[return-value]

    def info(self) -> list[dict[str, Any]]:
        return [
            {"worker": f"w{i}", "backend": "cpu", "host": self.hosts[i], "pid": self.pids[i]}
            for i in range(self.size)
        ]

    def nodes(self) -> list[str]:
        """The Ray node of each worker."""
        return list(self._get([a.node.remote() for a in self.actors], START_LIMIT))

    def take_faults(self) -> list[TrainFault]:
        out, self._new = self._new, []
        return out

    def inject(self, worker: int, phase: str, epoch: int, how: str = "kill") -> None:
        self._injected.append((worker, phase, epoch, how))
        self._get([self.actors[worker].inject.remote(phase, epoch, how)], START_LIMIT)

    def close(self) -> None:
        import ray

        for a in getattr(self, "actors", []):
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
