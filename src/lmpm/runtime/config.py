"""How a run is set up: one :class:`RunConfig`, built once from `lmpm run`'s flags or from the
Python API's keyword options, validated here, stored in the run's log (``meta``) and read back by
resume; and the :class:`ResumeRequest` a resume is asked with.

A leaf module (no torch, nothing of the runtime): the CLI builds a config before it imports the
engine, and every layer below takes the record rather than its fields one by one.

>>> from lmpm.runtime.config import RunConfig
>>> cfg = RunConfig(params={"N": 8}, seed=3, workers=2, checkpoint_every=5)
>>> cfg.driver_name, cfg.checkpoint_every
('ray', 5)
>>> RunConfig.from_meta(cfg.stored()).seed
3
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmpm.errors import RunDirError, UsageError

DEFAULT_CHECKPOINT_EVERY = (
    20  # epochs between payload checkpoints; resume replays at most this many (more after a
    # power cut took the newest ones, which are not fsynced without --durable: docs/trace.md)
)
TRACE_LEVELS = ("off", "summary", "cells")
DRIVERS = ("single", "process", "ray")
MAX_WORKERS = 4096
MAX_EPOCHS_PER_REPLAY = 64  # a window's graph holds K copies of the epoch's kernels
MAX_EPOCHS = 2**31 - 1  # epochs numbered beyond this would not fit the log's and trace's counters

# The settings a run's log stores (its ``meta`` keys) and a resume reads back; the other fields
# are chosen per session (a resumed run may change its driver, compile or not, ...).
STORED = (
    "params",
    "bind",
    "inputs",
    "seed",
    "backend",
    "epochs",
    "until",
    "workers",
    "checkpoint_every",
    "durable",
    "trace",
    "trace_region",
)


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Every setting of one run (``lmpm run``'s flags; the keyword options of
    :class:`lmpm.runtime.session.Run`, ``Compiled.runner`` and :func:`lmpm.resume`).
    Change one with :meth:`replace` (validated again)."""

    params: Mapping[str, int] = field(default_factory=dict)  # --set NAME=INT overrides
    bind: tuple[str, ...] = ()  # --bind modules, as given (files resolved when stored)
    # Python objects bound by name (``bindings=``, or the lmpm.bindings.Bindings of ``bind`` and
    # a mapping already loaded): never stored; the log records the names they bind (``bound``)
    bindings: Any = field(default=None, compare=False, repr=False)
    inputs: Mapping[str, str] = field(default_factory=dict)  # --input NAME=PATH
    tokenizers: Mapping[str, str] = field(default_factory=dict)  # --tokenizer NAME=PATH
    seed: int = 0  # the counter-based RNG's seed: same seed, same run
    backend: str = "cpu"  # worker backend (cpu, cuda)
    epochs: int | None = None  # --epochs (also fixes the confidence schedule's steps); None: none
    until: str | None = None  # --until stable: stop at the first epoch without a commit
    workers: int = 1  # the partition's size (one payload shard per worker)
    driver: str | None = None  # single | process | ray; None: single for 1 worker, ray for more
    cluster: str | None = None  # a running Ray cluster's address; None: a local Ray
    worker_timeout: float | None = None  # seconds a worker may take per phase; None: 120
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY  # the log's and every worker group's
    durable: bool = False  # --durable: the log fsynced at every epoch (synchronous=FULL)
    trace: str = "summary"  # constraint trace level: off | summary | cells
    trace_region: str | None = None  # with trace cells: only these cells ('Vid[0, 0..15]')
    compile: bool = False  # --compile: each value's epoch step as one compiled step
    # --epochs-per-replay: K epochs per CUDA-graph replay where the run allows it (with compile on
    # cuda; lmpm.runtime.data.kepochs); a power of two from 1 to MAX_EPOCHS_PER_REPLAY
    epochs_per_replay: int = 1
    max_memory: int | None = None  # refuse a plan needing more bytes; None: this machine's
    keep_records: bool = True  # RunResult.records keeps every epoch (the CLI's log keeps them)
    guard: bool = False  # check every payload crossing into the worker (one worker only)
    out: Path | None = None  # the run directory (RUN_DIR/lmpm.db); None: no log
    force: bool = False  # start over in an ``out`` that holds a run (deletes its log)

    def __post_init__(self) -> None:
        check_config(self)

    def replace(self, **changes: Any) -> RunConfig:
        """This config with ``changes`` (keyword options; an unknown one is U107)."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise UsageError(
                f"unknown run option{'s' if len(unknown) > 1 else ''} "
                + ", ".join(f"{k}=" for k in unknown),
                code="U107",
                hint="the options: " + ", ".join(f"{k}=" for k in FIELDS),
            )
        return dataclasses.replace(self, **changes)

    @property
    def driver_name(self) -> str:
        """Which driver runs the workers: the one asked for, else ``single`` for one worker and
        ``ray`` for more (or with a cluster address)."""
        if self.driver is not None:
            return self.driver
        return "ray" if self.workers > 1 or self.cluster else "single"

    def epoch_driver(self) -> str:
        """:attr:`driver_name` for an epoch run, whose ``single`` driver runs one worker (a
        training run's ``single`` driver holds its replicas in one process: it may have more)."""
        if self.driver == "single" and self.workers > 1:
            raise UsageError(f"the single driver runs one worker, not {self.workers}", code="U084")
        return self.driver_name

    def stored(self) -> dict[str, Any]:
        """The settings the log stores (JSON values, under their ``meta`` keys): what
        :meth:`from_meta` reads back. ``bind`` files and ``inputs`` as absolute paths."""
        return {
            "params": dict(self.params),
            "bind": list(bind_specs(self.bind)),
            "inputs": {k: str(Path(v).resolve()) for k, v in self.inputs.items()},
            "seed": self.seed,
            "backend": self.backend,
            "epochs": self.epochs,
            "until": self.until,
            "workers": self.workers,
            "checkpoint_every": self.checkpoint_every,
            "durable": self.durable,
            "trace": self.trace,
            "trace_region": self.trace_region,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], where: str = "the run's log") -> RunConfig:
        """The config a run's log stores (``meta``, as :func:`lmpm.runtime.rundir.read_meta`
        reads it). Logs of earlier versions lack some keys: ``workers`` (1), ``durable``
        (False), ``inputs`` ({}), ``trace_region`` (None). A missing key, a value of another
        JSON type (:data:`STORED_TYPES`) or one the config refuses is D006 (``where``: the log,
        in the message). ``bind`` is left empty: the modules a run directory names are code,
        which a resume imports only through :func:`lmpm.bindings.recorded_modules` (the session
        reads them)."""
        m = {**OLD_LOG_DEFAULTS, **meta}
        check_stored(m, STORED_TYPES, where)
        params, inputs = dict(m["params"]), dict(m["inputs"] or {})
        if not all(_int(v) for v in params.values()) or not all(
            isinstance(v, str) for v in inputs.values()
        ):
            raise RunDirError(f"{where} has damaged run settings; nothing was changed", code="D006")
        try:
            return cls(
                params={str(k): v for k, v in params.items()},
                inputs={str(k): v for k, v in inputs.items()},
                **{k: m[k] for k in STORED if k not in ("params", "inputs", "bind")},
            )
        except UsageError as e:
            raise RunDirError(
                f"{where} has damaged run settings ({e.message}); nothing was changed", code="D006"
            ) from None


FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))

# The JSON type of each setting a log stores (a bool is no int here), and the values of those a
# log from an earlier version lacks.
STORED_TYPES: dict[str, tuple[type, ...]] = {
    "params": (dict,),
    "bind": (list,),
    "inputs": (dict, type(None)),
    "seed": (int,),
    "backend": (str,),
    "epochs": (int, type(None)),  # None: the run was started without --epochs
    "until": (str, type(None)),
    "workers": (int,),
    "checkpoint_every": (int,),
    "durable": (bool,),
    "trace": (str,),
    "trace_region": (str, type(None)),
}
OLD_LOG_DEFAULTS: dict[str, Any] = {
    "workers": 1,
    "durable": False,
    "inputs": {},
    "trace_region": None,
}


def check_stored(
    meta: Mapping[str, Any], types: Mapping[str, tuple[type, ...]], where: str
) -> None:
    """Every key of ``types`` is in ``meta`` with one of its JSON types (a bool only where
    ``bool`` is named), else D006 naming the key; ``where``: the log, in the message."""
    for key, allowed in types.items():
        if key not in meta:
            raise RunDirError(
                f"{where} lacks the run's `{key}` (meta table damaged); nothing was changed",
                code="D006",
            )
        value = meta[key]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise RunDirError(
                f"{where} has a damaged `{key}` ({str(value)[:40]!r}); nothing was changed",
                code="D006",
            )


def check_config(cfg: RunConfig) -> None:
    """The one validation of a run's settings (UsageError, coded, naming the bad value)."""
    if cfg.trace not in TRACE_LEVELS:
        raise UsageError(f"trace {cfg.trace!r}: use off, summary or cells", code="U025")
    if cfg.trace_region and cfg.trace != "cells":
        raise UsageError(
            "a trace region (--trace-region, trace_region=) needs trace level cells", code="U025"
        )
    if not _int(cfg.checkpoint_every) or cfg.checkpoint_every < 1:
        raise UsageError(
            f"checkpoint every {cfg.checkpoint_every!r} epochs: give at least 1 "
            "(--checkpoint-every, checkpoint_every=)",
            code="U024",
        )
    if cfg.epochs is not None and (not _int(cfg.epochs) or not 1 <= cfg.epochs <= MAX_EPOCHS):
        raise UsageError(
            f"--epochs must be between 1 and {MAX_EPOCHS:,}, got {cfg.epochs}", code="U022"
        )
    if not _int(cfg.seed) or not -(2**63) <= cfg.seed < 2**63:
        raise UsageError(f"--seed must fit in 64 bits, got {cfg.seed}", code="U042")
    if not _int(cfg.workers) or not 1 <= cfg.workers <= MAX_WORKERS:
        raise UsageError(
            f"workers={cfg.workers!r}: give a count from 1 to {MAX_WORKERS}", code="U080"
        )
    if cfg.worker_timeout is not None and not cfg.worker_timeout > 0:
        raise UsageError(
            f"worker timeout {cfg.worker_timeout}: give a positive number of seconds", code="U083"
        )
    _check_driver(cfg)
    check_epochs_per_replay(cfg.epochs_per_replay, cfg.compile)


def check_epochs_per_replay(k: Any, compile: bool = True) -> None:
    """``k`` epochs per CUDA-graph replay: a power of two from 1 to 64, and with compile (U109)."""
    if not _int(k) or not 1 <= k <= MAX_EPOCHS_PER_REPLAY or k & (k - 1):
        raise UsageError(
            f"--epochs-per-replay {k!r}: give a power of two from 1 to {MAX_EPOCHS_PER_REPLAY} "
            "(1, 2, 4, 8, 16, ...)",
            code="U109",
            hint="1 replays one epoch at a time (the captured epoch); 8 or 16 suit long runs",
        )
    if k != 1 and not compile:
        raise UsageError(
            f"--epochs-per-replay {k} replays compiled epochs: add --compile (compile=True)",
            code="U109",
        )


def _check_driver(cfg: RunConfig) -> None:
    if cfg.driver is not None and cfg.driver not in DRIVERS:
        raise UsageError(f"driver={cfg.driver!r}: one of {', '.join(DRIVERS)}", code="U084")
    if cfg.cluster and cfg.driver not in (None, "ray"):
        raise UsageError(f"a cluster address needs the ray driver, not {cfg.driver}", code="U084")
    if cfg.guard and cfg.driver_name != "single":
        raise UsageError("the payload guard checks one worker; use workers=1", code="U080")


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def bind_specs(items: Iterable[str]) -> tuple[str, ...]:
    """--bind specs as stored in a run: files as absolute paths, dotted modules as given."""
    return tuple(
        str(Path(b).resolve()) if b.endswith(".py") or Path(b).exists() else b for b in items
    )


# ---- resume -----------------------------------------------------------------------------------
# A stored setting a resume may name only with its stored value: field -> (CLI flag, keyword)
KEPT = {
    "params": ("--set", "params="),
    "seed": ("--seed", "seed="),
    "trace": ("--trace", "trace="),
    "checkpoint_every": ("--checkpoint-every", "checkpoint_every="),
}


@dataclass(frozen=True, slots=True)
class ResumeRequest:
    """What a resume is asked (`lmpm run --resume`, :func:`lmpm.resume`): the run goes on with
    its stored :class:`RunConfig`; these fields change it for the epochs to come. None: as
    stored (the session's own settings, which the log does not store: their defaults)."""

    file: Path | None = None  # the program (None: the source the run stored)
    epochs: int | None = None  # run to this many epochs (None: the stored --epochs)
    until: str | None = None
    backend: str | None = None
    durable: bool = False  # True turns --durable on (a run started with it keeps it)
    trace_region: str | None = None  # must name the stored region (D011 otherwise)
    # stored settings named again (KEPT): each must equal the stored one (D011 otherwise)
    params: Mapping[str, int] | None = None
    seed: int | None = None
    trace: str | None = None
    checkpoint_every: int | None = None
    workers: int | None = None  # must be the stored count (its payload is one shard per worker)
    # the session's own settings (not stored)
    driver: str | None = None
    cluster: str | None = None
    worker_timeout: float | None = None
    compile: bool = False
    keep_records: bool = True
    # what the run binds: the --bind modules named again, a bindings mapping, or trust_bind to
    # import the modules the run directory names
    bind: tuple[str, ...] | None = None
    bindings: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    trust_bind: bool = False
    ruleset: tuple[tuple[str, str], ...] = ()  # (add | remove, constraint) from now on
    argv: tuple[str, ...] = ()  # the command line (the log's resumes table)
    cli: bool = False  # messages name the command's flags rather than the keywords

    @classmethod
    def of(cls, request: ResumeRequest | None = None, **options: Any) -> ResumeRequest:
        """``request`` (default: none) with keyword ``options`` (its fields; an unknown one is
        U107); sequences as tuples, ``file`` as a Path."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(
                "unknown resume option"
                + ("s " if len(unknown) > 1 else " ")
                + ", ".join(f"{k}=" for k in unknown),
                code="U107",
            )
        for key in ("bind", "ruleset", "argv"):
            if options.get(key) is not None:
                options[key] = tuple(options[key])
        if options.get("file") is not None:
            options["file"] = Path(options["file"])
        return dataclasses.replace(request or cls(), **options)

    def flag(self, key: str) -> str:
        """How the caller names setting ``key``: a flag (``cli``) or a keyword."""
        cli, kw = KEPT[key]
        return cli if self.cli else kw

    def kept(self) -> dict[str, Any]:
        """The stored settings this resume names again (each must be the stored one)."""
        return {k: getattr(self, k) for k in KEPT if getattr(self, k) is not None}

    def config(self, stored: RunConfig) -> RunConfig:
        """The resumed run's config: the stored one, with this request's changes (epochs and
        until as asked, else as stored; durable once asked; the session's own settings)."""
        return stored.replace(
            epochs=self.epochs if self.epochs is not None else stored.epochs,
            until=self.until or stored.until,
            backend=self.backend or stored.backend,
            durable=stored.durable or self.durable,
            driver=self.driver,
            cluster=self.cluster,
            worker_timeout=self.worker_timeout,
            compile=self.compile,
            keep_records=self.keep_records,
        )
