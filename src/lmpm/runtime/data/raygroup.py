"""Partitioned workers as Ray actors: one process per worker, the halo over ``torch.distributed``.

:class:`RayGroup` is a :class:`~lmpm.runtime.data.group.WorkerGroup` whose workers are Ray actors
(:class:`WorkerActor`), each holding one :class:`~lmpm.runtime.data.dataplane.DataPlane` with the
cells the topology gives it and the :class:`~lmpm.runtime.data.shard.ShardOwner` that decides
them. Per epoch the group makes one call per worker, all at once (``WorkerActor.epoch``), and waits
for the reports (fixed size). Inside it the owners exchange metadata point to point
(:func:`~lmpm.runtime.data.transport.exchange_objects`) and, after applying, the workers send
their changed routed cells to each other (:class:`~lmpm.runtime.data.transport.GlooTransport`),
over a gloo process group, never through the driver. Only metadata crosses Ray's channels in the
epoch loop; payload crosses them only at the API edge (inputs in, outputs out).

Elasticity. Each worker appends its committed rows to its own payload store (the run directory's
``payload/w<i>.db``, or a temporary directory when the run has none) before the control plane
counts the epoch as done. When a worker dies (its process is killed, its node is lost) or does not
answer its epoch call within ``EPOCH_TIMEOUTS * timeout`` seconds (then it is killed), anywhere in
an epoch or between epochs, the group:

1. kills the failed actor (if its process still runs) and starts a new one in its place, whose
   constructor reopens the worker's store; a worker that does not answer then (blocked in an
   exchange with the dead peer) is replaced too;
2. rebuilds the gloo process group for a new *generation* (a gloo group cannot survive a dead
   peer; every worker, the survivors too, joins the new one);
3. restores every worker to the start of the epoch: the surviving owners undo the epoch, a new
   worker's owner copies a survivor's metadata (R063 when none survived); each worker loads its
   newest checkpoint shard plus the rows its store took since (the counts the reports gave),
   then every routed cell moves so each worker's halo holds its owners' payload;
4. redoes the epoch (counter-based randomness: the same proposals, the same commits).

The fault (worker, epoch, phase, cause, seconds lost) is kept in :attr:`RayGroup.faults` and goes
into the epoch's record, the commit log and ``lmpm trace``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lmpm.bindings import Bindings
from lmpm.errors import LmpmError, RuntimeFault, UsageError
from lmpm.ir.nodes import Program
from lmpm.resolve.plan import Plan, resolve
from lmpm.resolve.topology import Topology
from lmpm.runtime.config import DEFAULT_CHECKPOINT_EVERY, RunConfig
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.group import (
    CORRUPT,
    HOWS,
    INJECT_ENV,
    PHASES,
    WorkerGroup,
    check_fault,
    parse_fault,
    received,
    stored_rows,
)
from lmpm.runtime.data.raylog import quiet_worker_deaths
from lmpm.runtime.data.shard import OwnersView, ShardOwner, merge_reports
from lmpm.runtime.data.transport import GlooTransport, exchange_objects
from lmpm.runtime.protocol import EpochReport, EpochRequest, Traffic, from_wire, to_wire
from lmpm.runtime.records import INPUT_RULE

DEFAULT_TIMEOUT = 120.0  # seconds a worker may take for one phase before it is declared hung
EPOCH_TIMEOUTS = 2  # a worker's epoch call may take this many timeouts (propose, then apply)
MAX_RETRIES = 3  # consecutive faults in one epoch before the run gives up
BLOCKED_GRACE = 2.0  # seconds the other workers get to answer once one has died
RESTART_LIMIT = 120.0  # seconds the workers get to come back after a fault
SLICE = 0.25  # seconds between looks at the answers while waiting for the workers
PING = 1.0  # seconds a worker gets to answer a ping during recovery before it is restarted


class WorkerLost(RuntimeFault):
    """A worker kept failing: the run cannot go on (nothing committed is lost)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """A worker fault the group survived."""

    worker: str  # "w<i>"
    epoch: int  # the epoch that was redone
    phase: str  # propose | apply (the halo exchange is part of apply)
    cause: str  # died | hung
    seconds: float  # time from the fault's detection to the workers being ready again
    pid: int  # the process that failed

    def to_json(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "epoch": self.epoch,
            "phase": self.phase,
            "cause": self.cause,
            "seconds": round(self.seconds, 6),
            "pid": self.pid,
        }


@dataclass(frozen=True, slots=True)
class Recipe:
    """How a worker process rebuilds the run's plan (sent instead of the plan, whose bound
    models need not pickle): resolved again in the worker (:meth:`plan`)."""

    ir: Program  # the checked program
    params: Mapping[str, int]  # every parameter's value (the plan's, tokenizer sizes included)
    bind: tuple[str, ...]  # the --bind modules (imported again in the worker)
    mapping: Mapping[str, Any]  # the bindings= objects (pickled by Ray)
    epochs: int | None  # the plan's epochs (they fix the confidence schedule)

    def plan(self) -> Plan:
        return resolve(
            self.ir, dict(self.params), Bindings(self.bind, dict(self.mapping)), epochs=self.epochs
        )


@dataclass(frozen=True, slots=True)
class RayOptions:
    """How a :class:`RayGroup` runs its actors."""

    cluster: str | None = None  # a running Ray cluster's address; None: a local Ray instance
    recipe: Recipe | None = None  # how a worker rebuilds the plan; None: the plan is sent (pickled)
    timeout: float = DEFAULT_TIMEOUT  # seconds a worker may take for one phase before it is hung
    threads: int = 1  # torch threads per worker
    # epochs between the workers' payload checkpoints (what a replaced worker restores from):
    # the run's --checkpoint-every, so a run with a log writes no shard the log does not name
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY

    @classmethod
    def of(cls, config: RunConfig, recipe: Recipe | None = None) -> RayOptions:
        """The options a run's config gives (its cluster, worker timeout, checkpoint cadence)."""
        return cls(
            cluster=config.cluster,
            recipe=recipe,
            timeout=DEFAULT_TIMEOUT if config.worker_timeout is None else config.worker_timeout,
            checkpoint_every=config.checkpoint_every,
        )


def import_ray() -> Any:
    """The ``ray`` module, or U082 when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise UsageError(
            "more than one worker process needs Ray, which is not installed",
            code="U082",
            hint="pip install 'lmpm[ray]' (scripts/setup.sh installs it), or use the in-process "
            "driver: --driver process",
        ) from None
    return ray


def probe_cluster(address: str, timeout: float = 3.0) -> None:
    """Fail fast (U090) when nothing listens at a ``host:port`` cluster address (Ray itself would
    retry for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and the like: Ray resolves them
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise UsageError(
            f"--cluster {address}: nothing answers there ({e.strerror or e})",
            code="U090",
            hint="start a cluster with `ray start --head` and give the address it prints "
            "(host:port)",
        ) from None


def node_id() -> str:
    """The id of the Ray node this process (a worker) runs on."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def rendezvous() -> tuple[str, int]:
    """This node's address and a free port: where a new process group meets (worker 0 asks)."""
    import ray

    return ray.util.get_node_ip_address(), _free_port()


def join_gloo(addr: str, port: int, rank: int, world: int, timeout: float) -> None:
    """Join a new gloo process group (a new membership generation; the old group is dropped: a
    gloo group cannot survive a dead peer)."""
    if addr.startswith("127."):  # one machine: the gloo pairs listen on loopback only
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class WorkerActor:
    """One worker process (the body of the Ray actor): a DataPlane and its halo transport.

    A replacement worker is a new actor: the worker's store is reopened in its constructor and the
    group restores its state before the epoch is redone."""

    def __init__(
        self,
        recipe: Recipe | Plan,
        index: int,
        topology: Topology,
        seed: int,
        backend: str,
        checksum_policies: frozenset[str],
        threads: int,
        store: tuple[str, bool] | None,  # the payload store: (directory, --durable)
    ) -> None:
        torch.set_num_threads(threads)
        plan = recipe if isinstance(recipe, Plan) else recipe.plan()
        self.index = index
        self.topology = topology
        self.dp = DataPlane(
            plan,
            backend=backend,
            seed=seed,
            worker=f"w{index}",
            checksum_policies=checksum_policies,
            decides=False,
        )
        # the owner of this worker's cells, with a replica of every cell's metadata
        self.owner = ShardOwner(plan, topology, index, seed)
        if store is not None:
            self.dp.open_store(*store)
        self.transport: Any = None
        self.faults: list[tuple[str, int, str]] = []  # (phase, epoch, how) to fail at

    # ---- membership ------------------------------------------------------------------------------
    def ping(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return node_id()

    def rendezvous(self) -> tuple[str, int]:
        """An address and a free port for the process group (asked of worker 0)."""
        return rendezvous()

    def join(self, addr: str, port: int, world: int, timeout: float) -> None:
        """Join a new process group (a new generation; the old one is dropped)."""
        join_gloo(addr, port, self.index, world, timeout)
        self.transport = GlooTransport(self.dp, self.topology, self.index)

    # ---- the data plane ----------------------------------------------------------------------------
    def call(self, method: str, *args: Any) -> Any:
        """A DataPlane method outside the epoch loop (inputs, outputs, stores, checkpoints)."""
        return getattr(self.dp, method)(*args)

    def ensure_store(self, run_dir: str, durable: bool = False) -> None:
        """Open the worker's store unless it is open (a restarted worker's constructor may not
        have known the directory)."""
        if self.dp.store is None:
            self.dp.open_store(run_dir, durable)

    def own(self, method: str, *args: Any) -> Any:
        """A method of this worker's owner outside the epoch loop (its metadata: checkpoints,
        the stop reason, inputs, restores)."""
        return getattr(self.owner, method)(*args)

    def epoch(self, wired: EpochRequest) -> EpochReport:
        """One epoch of this worker: its owner opens, proposes, agrees, applies and commits its
        cells, exchanging metadata with the other owners over the process group
        (:func:`~lmpm.runtime.data.transport.exchange_objects`); then the changed routed cells
        go to the peers that read them. The report has a size independent of the cells (and
        the per-cell records only when the control plane asks for them). Messages cross in
        their wire form (:func:`lmpm.runtime.protocol.to_wire`).

        An error here ends the run (the group raises it, or a worker fault's recovery forms a
        new process group), so the worker first leaves its process group: the peers waiting on
        it in an exchange then fail at once (gloo: connection closed) instead of holding their
        actors until the group's timeout, which the calls that close the run wait behind."""
        try:
            return self._epoch(from_wire(wired))
        except Exception:
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # the error that ended the epoch is the one
                    dist.destroy_process_group()
            raise

    def _epoch(self, req: EpochRequest) -> EpochReport:
        e = req.epoch
        self._maybe_fail("propose", e)
        run = self.owner.decide(self.dp, req)
        try:
            ask = next(run)
            while True:
                ask = run.send(exchange_objects(ask.part))
        except StopIteration as stop:
            report: EpochReport = stop.value
        self._maybe_fail("apply", e)
        changed: dict[str, Tensor] = {}
        for name, cells in self.dp.written.items():
            mask = torch.zeros(self.dp.plan.values[name].ncells, dtype=torch.bool)
            mask[cells.cpu()] = True
            changed[name] = mask
        self._maybe_fail("halo", e)
        report.halo_bytes = self.transport.exchange(changed)
        # a spread quorum value's cells written elsewhere: this worker's store keeps them too
        got = received(
            self.topology,
            self.index,
            {(v, q): m for (v, q), m in self.transport.received.items()},
        )
        if got:
            self.dp.keep_received(e, got)
        rows = stored_rows(self.dp.written, got)
        report.stored = tuple(sorted((k, n) for k, n in rows.items() if n))
        return to_wire(report)  # type: ignore[no-any-return]

    def restore_owned(
        self, label: int, shards: Mapping[str, Mapping[str, Any]], upto: int, counts: Any
    ) -> None:
        """Restore this worker's payload to the start of epoch ``upto`` after a fault: its
        checkpoint shard plus its store's rows since (``counts[(epoch, value)]``: how many the
        group saw it store), with the committed and input flags of its owner's metadata (rolled
        back, or copied from a surviving worker)."""
        st = self.owner.state
        committed = {name: s.committed for name, s in st.items()}
        from_input = {name: s.rule == INPUT_RULE for name, s in st.items()}
        shard = shards[self.dp.worker]
        self.dp.restore(
            label, str(shard["file"]), str(shard["sha256"]), upto, counts, committed, from_input
        )

    def resync(self) -> int:
        """Send every routed cell (after a restore)."""
        every = {
            name: torch.ones(vp.ncells, dtype=torch.bool)
            for name, vp in self.dp.plan.values.items()
        }
        return int(self.transport.exchange(every))

    # ---- fault injection (tests, benchmarks) --------------------------------------------------
    def inject(self, phase: str, epoch: int, how: str = "kill") -> None:
        """Fail when this worker reaches ``phase`` of ``epoch``: ``kill`` (SIGKILL of this
        process), ``hang`` (stop answering) or ``corrupt`` (from ``epoch`` on, every proposal of
        this worker is changed after its model ran: for quorum drills)."""
        if how == CORRUPT:
            self.dp.set_corrupt(epoch)
            return
        self.faults.append((phase, epoch, how))

    def _maybe_fail(self, phase: str, epoch: int) -> None:
        due = [f for f in self.faults if f[:2] == (phase, epoch)]
        if not due:
            return
        self.faults.remove(due[0])
        how = due[0][2]
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "hang":
            time.sleep(10**6)


@dataclass
class Gathered:
    """What waiting for a round of worker calls found: ``out`` (answers, None where missing),
    ``failed`` ((worker, died|hung|blocked)), ``errors`` ((worker, a non-LMPM error raised in
    it)) and ``why`` (Ray's first message about a death)."""

    out: list[Any]
    failed: list[tuple[int, str]]
    errors: list[tuple[int, Exception]]
    why: str

    def lost(self) -> list[tuple[int, str]]:
        """Every worker to replace: the failed ones, and those whose call raised (a collective
        broke under them when a peer died)."""
        return sorted(self.failed + [(i, "blocked") for i, _ in self.errors])


def gather(refs: list[Any], timeout: float, *, grace: bool = True) -> Gathered:
    """The one supervision policy of LMPM's Ray workers (the engine's group and the trainer's):
    wait for every call (None refs are skipped) until ``timeout`` seconds, looking at the answers
    every ``SLICE`` seconds so that a death is seen early. A call still running at the deadline
    is *hung*: it is cancelled (Ray allows only a cooperative cancel of an actor's call; the
    caller replaces the worker, which ends it). ``grace``: once a worker died, the others get
    ``BLOCKED_GRACE`` seconds more and are *blocked* past it (waiting on the dead one in a halo
    exchange or a collective). An LMPM error raised in a worker is raised here as itself."""
    ray = import_ray()
    from ray.exceptions import (
        ActorUnavailableError,
        GetTimeoutError,
        RayActorError,
        RayTaskError,
    )

    out: list[Any] = [None] * len(refs)
    pending = {r: i for i, r in enumerate(refs) if r is not None}
    failed: list[tuple[int, str]] = []
    errors: list[tuple[int, Exception]] = []
    deadline = time.monotonic() + timeout
    late = "hung"
    why = ""
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            for r, i in pending.items():
                failed.append((i, late))
                ray.cancel(r, force=False)
            break
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(left, SLICE))
        for r in ready:
            i = pending.pop(r)
            try:
                out[i] = ray.get(r, timeout=0)
            except (RayActorError, ActorUnavailableError) as e:
                failed.append((i, "died"))
                why = why or _last_line(e)
                if grace:
                    deadline = min(deadline, time.monotonic() + BLOCKED_GRACE)
                    late = "blocked"
            except RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, LmpmError):
                    raise cause from None
                errors.append((i, e))
                why = why or _last_line(e)
            except GetTimeoutError:
                failed.append((i, "hung"))
    return Gathered(out, sorted(failed), errors, why)


def _last_line(e: BaseException) -> str:
    """The last meaningful line of a Ray error (the remote exception's own message)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith(("File ", "^", "Traceback", "The actor", "Actor ID")):
            return ln[:300]
    return lines[-1][:300] if lines else type(e).__name__


class WorkersFailed(Exception):
    """Workers that died or did not answer in time: (index, cause) each."""

    def __init__(self, failed: list[tuple[int, str]], why: str = "") -> None:
        super().__init__(failed)
        self.failed = failed
        self.why = why  # the first error Ray reported, if any


class RayGroup(WorkerGroup):
    """W workers, each a Ray actor in its own process (see the module doc).

    ``options``: its Ray settings (:class:`RayOptions`: cluster, recipe, timeout, threads,
    checkpoint cadence).
    """

    def __init__(
        self,
        plan: Plan,
        workers: int,
        *,
        topology: Topology | None = None,
        backend: str = "cpu",
        seed: int = 0,
        checksum_policies: frozenset[str] = frozenset(),
        options: RayOptions | None = None,
    ) -> None:
        opts = options or RayOptions()
        if opts.timeout <= 0:
            raise UsageError(f"worker timeout {opts.timeout}: must be positive", code="U083")
        if opts.checkpoint_every < 1:
            raise UsageError(
                f"checkpoint every {opts.checkpoint_every} epochs: give at least 1", code="U024"
            )
        self.cluster = opts.cluster
        self.recipe = opts.recipe
        self.timeout = float(opts.timeout)
        self.threads = int(opts.threads)
        self.checkpoint_every = int(opts.checkpoint_every)
        self.faults: list[Fault] = []
        self._new_faults: list[Fault] = []
        self._owns_ray = False
        self._tmp: str | None = None  # the stores' directory when the run has none
        self._store_dir: str | None = None
        self._durable = False  # the stores' --durable (as the commit log's)
        self.generation = 0
        self.running = -1  # the epoch running
        self.done = 0  # the epochs the workers' durable state holds (a restore goes back here)
        self._recovering = False
        self._injected: list[tuple[int, str, int, str]] = []
        self._fired: set[tuple[int, str, int]] = set()
        self.round_trips = 0  # parallel calls to the workers (benchmarks)
        super().__init__(
            plan,
            workers,
            topology=topology,
            backend=backend,
            seed=seed,
            checksum_policies=checksum_policies,
        )

    def _owners(self) -> Any:
        """The owners live in the workers' processes (WorkerActor.owner): only a view here."""
        return OwnersView(self)

    # ---- starting and stopping -------------------------------------------------------------------
    def _start(self) -> list[Any]:
        ray = import_ray()
        if not ray.is_initialized():
            if self.cluster:
                probe_cluster(self.cluster)
                try:
                    ray.init(address=self.cluster, logging_level=logging.ERROR, log_to_driver=True)
                except (ConnectionError, RuntimeError, ValueError) as e:
                    raise UsageError(
                        f"--cluster {self.cluster}: cannot join the Ray cluster there: {e}",
                        code="U090",
                        hint="start one with `ray start --head` and give the address it prints",
                    ) from None
            else:
                # "local": a new instance of our own, never another process's local Ray (which
                # ray.init would otherwise join, refusing num_cpus)
                ray.init(
                    address="local",
                    num_cpus=max(os.cpu_count() or 1, self.size * self.threads),
                    include_dashboard=False,
                    logging_level=logging.ERROR,
                    _node_ip_address="127.0.0.1",
                )
            self._owns_ray = True
        quiet_worker_deaths()  # LMPM replaces a dead worker and says so itself
        self._ref = ray.put(self.recipe if self.recipe is not None else self.plan)
        # across nodes, spread the workers (one per node while nodes last); Ray's scheduler
        # places a replacement wherever resources are left
        opts: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0, "num_cpus": self.threads}
        if self.cluster:
            opts["scheduling_strategy"] = "SPREAD"
        self._cls = ray.remote(WorkerActor).options(**opts)
        actors = [self._spawn(i) for i in range(self.size)]
        self.workers = actors
        try:
            self._pids = self._get([a.ping.remote() for a in actors], "start", -1, RESTART_LIMIT)
            self._join()
        except WorkersFailed as f:
            self.close()
            raise WorkerLost(
                f"the workers could not start: {f.why or 'no answer'}",
                where={"worker": ", ".join(f"w{i}" for i, _ in f.failed)},
                code="R062",
                hint="a model or binding a worker cannot import (a module only this process "
                "knows) is the usual cause: bind it from a .py file or an importable module",
            ) from None
        return actors

    def _spawn(self, i: int) -> Any:
        return self._cls.remote(
            self._ref,
            i,
            self.topology,
            self.seed,
            self.backend,
            self.checksum_policies,
            self.threads,
            None if self._store_dir is None else (self._store_dir, self._durable),
        )

    def _replace(self, i: int) -> None:
        """Kill worker ``i`` (if its process still runs) and start a new one in its place; its
        constructor reopens the worker's store."""
        try:
            import_ray().kill(self.workers[i], no_restart=True)
        except Exception:
            pass  # already gone
        self.workers[i] = self._spawn(i)
        if self._log_args is not None:  # its predecessor's owner wrote the log rows
            self.workers[i].own.remote("set_log", *self._log_args)
        # the faults still to come for this worker (its predecessor held them)
        for w, phase, epoch, how in self._injected:
            due = epoch >= self.done and (w, phase, epoch) not in self._fired
            if w == i and (due or how == CORRUPT):  # corrupt: from its epoch on, for good
                self.workers[i].inject.remote(phase, epoch, how)

    def _join(self) -> None:
        """A new process-group generation: every worker joins it."""
        addr, port = self._get([self.workers[0].rendezvous.remote()], "join", -1, RESTART_LIMIT)[0]
        self.generation += 1
        self._get(
            [w.join.remote(addr, port, self.size, self.timeout) for w in self.workers],
            "join",
            -1,
            RESTART_LIMIT,
        )

    def close(self) -> None:
        ray = import_ray()
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers = []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    # ---- calls -------------------------------------------------------------------------------------
    def _get(
        self, refs: list[Any], phase: str, epoch: int, timeout: float | None = None
    ) -> list[Any]:
        """Wait for every call; raise WorkersFailed naming the workers that died, hung (no answer in
        ``timeout``, default the group's) or were blocked on a dead peer. A user error raised in
        a worker (a model fault, ...) is raised here as itself."""
        self.round_trips += 1
        got = gather(refs, self.timeout if timeout is None else timeout, grace=True)
        if got.failed:
            # a worker whose halo exchange broke because a peer died is reset with it
            raise WorkersFailed(got.lost(), got.why)
        if got.errors:
            raise got.errors[0][1]
        return got.out

    def _each(self, method: str, *args: Any) -> list[Any]:
        return self._calls(method, [args] * self.size)

    def _calls(
        self, method: str, args: list[tuple[Any, ...] | None], via: str = "call"
    ) -> list[Any]:
        """Between epochs (inputs, outputs, stores, checkpoints): a worker lost here is replaced
        and restored like one lost in an epoch, then the call is made again. ``via``: the
        actor's ``call`` (its data plane) or ``own`` (its owner)."""

        def once() -> list[Any]:
            refs = [
                None if a is None else getattr(w, via).remote(method, *a)
                for w, a in zip(self.workers, args, strict=True)
            ]
            return self._get(refs, method, -1, RESTART_LIMIT)

        if self._recovering:  # the recovery's own calls: its caller retries
            return once()
        if self.checkpointed is None:  # nothing durable to restore a worker from yet
            try:
                return once()
            except WorkersFailed as f:
                raise WorkerLost(
                    f"worker {', '.join(f'w{i} ({c})' for i, c in f.failed)} failed before the "
                    f"run's first checkpoint{': ' + f.why if f.why else ''}",
                    where={"worker": ", ".join(f"w{i}" for i, _ in f.failed)},
                    code="R061",
                ) from None
        return self._retry(self.done, method, once)

    def owner_calls(self, method: str, args: list[tuple[Any, ...] | None]) -> list[Any]:
        """Call ``method`` on worker i's owner with ``args[i]`` (None: not called), in the
        workers' processes (:class:`~lmpm.runtime.data.shard.OwnersView` reads the metadata so)."""
        return self._calls(method, args, via="own")

    # ---- the epoch, with recovery ----------------------------------------------------------------
    def _decide(self, req: EpochRequest) -> EpochReport:
        """One parallel call per worker (WorkerActor.epoch): the owners decide their cells and
        exchange metadata and halo among themselves; the reports (fixed size) come back here. A
        worker fault anywhere in the epoch: recover and redo it."""
        e = req.epoch
        self._before(e)
        self.traffic = Traffic()
        wired = to_wire(req)

        def once() -> list[EpochReport]:
            self.traffic = Traffic()  # what crossed in the attempt that counted
            # a worker's epoch is its two phases (each up to `timeout`); its exchanges with a
            # peer that stopped answering time out within one (join: the group's timeout), so
            # the others answer (blocked) before it is declared hung
            refs = [w.epoch.remote(wired) for w in self.workers]
            got = self._get(refs, "epoch", e, EPOCH_TIMEOUTS * self.timeout)
            self.traffic.count(wired, *got, wired=True)
            self.traffic.times(wired, self.size - 1, wired=True)  # the same to every worker
            return [from_wire(g) for g in got]

        reports: list[EpochReport] = self._retry(e, "epoch", once)
        self.done = e + 1
        self.halo_bytes = sum(r.halo_bytes for r in reports)
        self.halo_bytes_total += self.halo_bytes
        for i, r in enumerate(reports):
            self._count_stored(e, i, dict(r.stored))
        return merge_reports(reports, self.order, self.rule_rank, req.records)

    def _before(self, epoch: int) -> None:
        self.running = self.done = epoch
        # a run without a directory checkpoints into temporary stores of its own, only to
        # recover from a worker fault within this process's life: no fsync buys anything there
        sync = self._tmp is None
        if self.checkpointed is None:
            if self._store_dir is None:
                self._tmp = tempfile.mkdtemp(prefix="lmpm-workers-")
                self.open_store(self._tmp)
                sync = False
            self.checkpoint_shards(epoch, sync)
        elif epoch - self.checkpointed[0] >= self.checkpoint_every:
            self.checkpoint_shards(epoch, sync)

    def open_store(self, run_dir: Any, durable: bool = False) -> None:
        if self._tmp is not None and str(run_dir) != self._tmp:
            self.close_store()
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self._store_dir = str(run_dir)
        self._durable = durable
        super().open_store(self._store_dir, durable)

    def close_store(self) -> None:
        super().close_store()
        self._store_dir = None

    def _retry(self, epoch: int, phase: str, call: Any) -> Any:
        """``call()``; after a worker fault, recover and call again (a fault while recovering
        counts as one more)."""
        failed: list[tuple[int, str]] = []
        tries = 0
        while True:
            try:
                if failed:
                    self._recover(failed, epoch, phase)
                return call()
            except WorkersFailed as f:
                tries += 1
                failed = f.failed
                if tries > MAX_RETRIES:
                    names = ", ".join(f"w{i} ({c})" for i, c in f.failed)
                    raise WorkerLost(
                        f"workers failed {tries} times in epoch {epoch}, last: {names}",
                        where={"worker": names, "epoch": epoch, "phase": phase},
                        code="R060",
                        hint="the run directory holds every epoch before this one: fix the "
                        "cause and continue with `lmpm run --resume`",
                    ) from None

    def _recover(self, failed: list[tuple[int, str]], epoch: int, phase: str) -> None:
        """Replace the failed workers, start a new process-group generation, restore every
        worker to the start of ``epoch``."""
        self._recovering = True
        try:
            self._recover_once(failed, epoch, phase)
        finally:
            self._recovering = False

    def _recover_once(self, failed: list[tuple[int, str]], epoch: int, phase: str) -> None:
        for i, cause in failed:  # an injected fault that went off is not armed again
            if cause != "blocked":
                self._fired |= {(w, p, e) for w, p, e, _ in self._injected if (w, e) == (i, epoch)}
        t0 = time.perf_counter()
        for i, cause in failed:
            if cause != "blocked":  # a blocked worker answered (its exchange broke): kept
                self._replace(i)
        # a survivor that does not answer now (blocked in the old generation's exchange) is
        # replaced too; then every worker, new ones included, must answer
        replaced = {i for i, cause in failed if cause != "blocked"}
        new = set(replaced)
        try:
            self._get(
                [None if i in replaced else w.ping.remote() for i, w in enumerate(self.workers)],
                "ping",
                epoch,
                PING,
            )
        except WorkersFailed as f:
            for i, _ in f.failed:
                self._replace(i)
                new.add(i)
                failed = [(j, c) for j, c in failed if j != i] + [(i, "blocked")]
        try:
            pids = self._get([w.ping.remote() for w in self.workers], "ping", epoch, RESTART_LIMIT)
        except WorkersFailed as f:
            raise WorkerLost(
                f"workers {', '.join(f'w{i}' for i, _ in f.failed)} did not come back after a "
                f"fault in epoch {epoch}",
                where={"epoch": epoch, "phase": phase},
                code="R061",
            ) from None
        old = dict(enumerate(self._pids))
        self._pids = list(pids)
        self._join()
        self._restore_owners(new, epoch)
        assert self.checkpointed is not None
        label, shards = self.checkpointed
        self._reopen()
        args: list[tuple[Any, ...]] = []
        for i in range(self.size):
            counts = {k: n[i] for k, n in self.stored.items() if label <= k[0] < epoch and n[i]}
            args.append((label, shards, epoch, counts))
        self._get(
            [w.restore_owned.remote(*a) for w, a in zip(self.workers, args, strict=True)],
            "restore",
            epoch,
            RESTART_LIMIT,
        )
        self.stored = {k: n for k, n in self.stored.items() if k[0] < epoch}
        self._resync()
        self.done = epoch
        seconds = time.perf_counter() - t0
        for i, cause in failed:
            fault = Fault(f"w{i}", epoch, phase, cause, seconds, old.get(i, -1))
            self.faults.append(fault)
            self._new_faults.append(fault)

    def _restore_owners(self, new: set[int], epoch: int) -> None:
        """The owners back at the start of ``epoch``: the surviving ones undo what they did in
        it; the new ones copy a survivor's metadata (every owner keeps all of it)."""
        kept = [i for i in range(self.size) if i not in new]
        if not kept:
            raise WorkerLost(
                f"every worker was lost in epoch {epoch}, and with them the cells' metadata "
                "(each worker's owner keeps it; none survived to hand it on)",
                where={"epoch": epoch},
                code="R063",
                hint="the run directory holds every epoch before this one: continue with "
                "`lmpm run --resume`",
            )
        self._get(
            [
                w.own.remote("rollback", epoch) if i in kept else None
                for i, w in enumerate(self.workers)
            ],
            "restore",
            epoch,
            RESTART_LIMIT,
        )
        if not new:
            return
        state = self._get([self.workers[kept[0]].own.remote("get_state")], "restore", epoch)[0]
        for value, st in state.items():
            self._get(
                [self.workers[i].own.remote("restore", value, st) for i in sorted(new)],
                "restore",
                epoch,
                RESTART_LIMIT,
            )
        self.changes += 1

    def _reopen(self) -> None:
        """A restarted worker reopened its store in its constructor only if the store's directory
        was known when it was made: make sure every worker has it open."""
        if self._store_dir is not None:
            self._get(
                [w.ensure_store.remote(self._store_dir, self._durable) for w in self.workers],
                "open_store",
                -1,
            )

    def _resync(self) -> int:
        return sum(
            self._get([w.resync.remote() for w in self.workers], "resync", -1, RESTART_LIMIT)
        )

    def take_faults(self) -> list[Fault]:
        """The faults survived since the last call (the engine puts them in the epoch record)."""
        out, self._new_faults = self._new_faults, []
        return out

    def inject(self, worker: int, phase: str, epoch: int, how: str = "kill") -> None:
        """Make worker ``worker`` fail at ``phase`` (propose, apply, halo) of ``epoch``: ``kill``,
        ``hang``, or ``corrupt`` (phase propose: its proposals are wrong from ``epoch`` on)."""
        if phase not in PHASES:
            raise UsageError(f"phase {phase!r}: one of {', '.join(PHASES)}", code="U084")
        check_fault(worker, phase, how, self.size, HOWS)
        self._injected.append((worker, phase, epoch, how))
        self._get(
            [self.workers[worker].inject.remote(phase, epoch, how)], "inject", -1, RESTART_LIMIT
        )

    def restore_shards(
        self,
        label: int,
        shards: Mapping[str, Mapping[str, Any]],
        upto: int,
        commits: Mapping[tuple[int, str], Tensor],
        committed: Mapping[str, Tensor],
        from_input: Mapping[str, Tensor],
    ) -> None:
        super().restore_shards(label, shards, upto, commits, committed, from_input)
        self.done = upto

    def nodes(self) -> list[str]:
        """The Ray node each worker runs on."""
        return list(self._get([w.node.remote() for w in self.workers], "node", -1, RESTART_LIMIT))

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return list(self._pids)


__all__ = [
    "DEFAULT_TIMEOUT",
    "INJECT_ENV",
    "Fault",
    "RayGroup",
    "RayOptions",
    "Recipe",
    "WorkerActor",
    "WorkerLost",
    "parse_fault",
]
