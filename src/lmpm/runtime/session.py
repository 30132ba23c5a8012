"""One run of a program: front end → plan → engine → outputs. The Python API behind `lmpm run`.

>>> import lmpm.runtime.session as s
>>> src = '''
... param N = 6
... value Txt : Token[Byte] shape Seq(N)
... visible Txt[t] <- Txt[0..t-1] when t > 0
... rule Gen:
...   on Txt[t]
...   read {ctx = Txt[0..t-1]}
...   emit proposal Txt[t] := Uniform(ctx)
... constraint Lower: require Txt[t] in Set(97..122) priority 10
... '''
>>> run = s.Run.from_source(src, seed=1)
>>> res = run.run(epochs=20)
>>> text = run.outputs()["Txt"]
>>> all(97 <= int(b) <= 122 for b in text) and len(text) == 6
True
"""

from __future__ import annotations

import math
import sqlite3
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lmpm.bindings import (
    MAPPING,
    Bindings,
    bound_differences,
    bound_record,
    origin_words,
    recorded_modules,
)
from lmpm.errors import (
    BindError,
    CheckError,
    ConstraintEvalError,
    DiagnosticSink,
    InputError,
    LmpmError,
    ModelError,
    RunDirError,
    UsageError,
)
from lmpm.ir import Frontend, check, compile_file, compile_source
from lmpm.resolve.plan import Plan, resolve
from lmpm.resolve.policies import POLICIES
from lmpm.runtime.config import ResumeRequest, RunConfig, check_stored
from lmpm.runtime.config import bind_specs as bind_specs
from lmpm.runtime.control.commitlog import (
    MSG_FOREIGN,
    CommitLog,
    Restored,
    RunInfo,
    check_epochs,
    failed_before_first_epoch,
    file_sha256,
    program_hash,
    refuse_existing,
    restore,
)
from lmpm.runtime.control.engine import Engine, Observer
from lmpm.runtime.control.trace import Tracer, parse_region
from lmpm.runtime.data import validate
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.group import WorkerGroup
from lmpm.runtime.data.raygroup import RayGroup, RayOptions, Recipe
from lmpm.runtime.io import load_input, output_array, write_outputs
from lmpm.runtime.lock import RunLock, os_error, sqlite_error
from lmpm.runtime.received import interpreting
from lmpm.runtime.records import CHECKSUM_POLICIES, RunResult
from lmpm.runtime.rundir import connect, db_path, holds_run, read_meta, remove_run
from lmpm.runtime.runfiles import claim_folder
from lmpm.runtime.vocab import (
    Vocabulary,
    bind_vocabularies,
    by_value,
    require_sizes,
    save_tokenizers,
    saved_tokenizers,
    tokenizer_meta,
)

MSG_WORKFLOW = (
    "`{name}` is a workflow: the epoch engine (`lmpm run`, `Run`) does not run workflows and would "
    "ignore its zones, prompts and triggers; the token-stream VM runs them"
)


def refuse_workflows(front: Frontend) -> None:
    """A program with a ``workflow`` is the token-stream VM's (docs/vm.md): refused here, at the
    workflow's line, with the command that runs it, rather than run epoch by epoch without it."""
    if not front.ir.workflows:
        return
    wf = front.ir.workflows[0]
    raise UsageError(
        MSG_WORKFLOW.format(name=wf.name),
        span=wf.span,
        code="U105",
        hint=f"run it with `lmpm vm run {wf.span.file}` (add the --bind modules of its tools); "
        "in Python, lmpm.vm.WorkflowRun.from_file(...)",
    )


# What Run.log_to may still change: the commit log's own settings.
LOG_SETTINGS = ("trace", "trace_region", "checkpoint_every", "durable", "until", "force")


class Run:
    """A program bound to parameters, bindings, inputs and a seed, ready to run epochs.

    ``config``: a :class:`~lmpm.runtime.config.RunConfig`; keyword ``options`` are its fields
    (``params=``, ``bind=``, ``bindings=``, ``inputs=``, ``seed=``, ``epochs=``, ``workers=``,
    ``compile=``...), given instead of it or on top of it. ``observers`` see every epoch;
    ``topology``: the partition of a multi-worker run (default
    :func:`lmpm.resolve.topology.partition`)."""

    def __init__(
        self,
        front: Frontend,
        config: RunConfig | None = None,
        /,
        *,
        observers: Sequence[Observer] = (),
        topology: Any = None,
        **options: Any,
    ) -> None:
        refuse_workflows(front)
        cfg = (config or RunConfig()).replace(**options)
        self.front = front
        # a tokenizer sizes its vocabulary (the parameter NAME of Token[NAME]): lmpm.runtime.vocab
        self.vocabularies, self.params = bind_vocabularies(front.ir, cfg.tokenizers, cfg.params)
        self.given_params = dict(cfg.params)  # what the caller set (a run's stored settings)
        require_sizes(front.ir, self.params)
        # ``bindings``: a mapping, or the Bindings of ``bind`` and a mapping already loaded (the
        # program was checked against them: `lmpm run`, lmpm.compile, resume)
        self.bindings = _loaded(cfg)
        self.config = cfg.replace(bind=self.bindings.modules, bindings=self.bindings)
        self.seed, self.backend, self.epochs = cfg.seed, cfg.backend, cfg.epochs
        self.bind = self.bindings.modules
        check_bindings(front, self.params, self.bindings, self.bindings.mapping)
        # what the run directory records of the names this run binds itself (resume checks it)
        self.bound = bound_record(self.bindings, {c.func for c in front.ir.calls()})
        self.plan: Plan = resolve(
            front.ir, self.params, self.bindings, epochs=cfg.epochs, max_memory=cfg.max_memory
        )
        self.workers, self.driver = cfg.workers, cfg.epoch_driver()
        self.engine = Engine(
            self.plan,
            backend=cfg.backend,
            seed=cfg.seed,
            observers=observers,
            keep_records=cfg.keep_records,
            guard=cfg.guard,
            dataplane=self._group(topology),
        )
        # the concrete data plane (the API edge reaches its workers; the engine only its port)
        self.dataplane: Any = self.engine.dataplane
        self.inputs = dict(cfg.inputs)
        self.restored: Restored | None = None  # set by resume()
        self.until: str | None = cfg.until
        try:
            self._prepare()
        except BaseException:
            self.close()  # worker processes started for this run
            raise

    def _group(self, topology: Any) -> Any:
        """The worker group of a multi-worker run (None: one worker, in this process)."""
        if self.driver == "single":
            return None
        cfg = self.config
        # (--bind files as absolute paths: a worker process need not share this one's directory)
        bind = bind_specs(self.bind)
        recipe = Recipe(self.front.ir, self.params, bind, self.bindings.mapping, cfg.epochs)
        return make_group(self.plan, cfg, recipe=recipe, topology=topology)

    def _prepare(self) -> None:
        """Compile the epoch step (``compile``) and commit the ``inputs``."""
        if self.config.compile:
            self.engine.compile()
            # LMPM_VALIDATE=eager: each compiled epoch decided eagerly too, and compared
            validate.install(self.dataplane)
            k = self.config.epochs_per_replay
            if k != 1:  # after compile: the data plane is a fused one
                fused = self.engine.dataplane
                assert isinstance(fused, DataPlane)  # (compile refuses a group, U101)
                self.engine.windows = fused.epoch_windows(k, self.engine.epoch)
        for name, path in self.config.inputs.items():
            vp = self.plan.values.get(name)
            if vp is None:
                raise UsageError(
                    f"--input {name}=...: the program has no value `{name}` with cells",
                    hint="values: " + ", ".join(self.plan.values),
                    code="U020",
                )
            payload, mask = load_input(path, vp, self.value_vocabularies.get(name))
            self.set_input(name, payload, mask)

    @property
    def value_vocabularies(self) -> dict[str, Vocabulary]:
        """Value name -> the tokenizer of its vocabulary (values of a bound vocabulary only)."""
        return by_value(self.front.ir, self.vocabularies)

    def save_tokenizers(self, run_dir: str | Path) -> list[Path]:
        """Copy the run's tokenizers into RUN_DIR (read by `lmpm trace` and a resume)."""
        return save_tokenizers(run_dir, self.vocabularies)

    @classmethod
    def from_source(
        cls, text: str, file: str = "<input>", *, observers: Sequence[Observer] = (), **options: Any
    ) -> Run:
        """A Run of program ``text`` (checked against its ``bind=``/``bindings=`` first)."""
        cfg = RunConfig().replace(**options)
        loaded = _loaded(cfg)
        front = compile_source(text, file, overrides=cfg.params, bound_names=loaded.user_names())
        return cls(front, cfg.replace(bindings=loaded), observers=observers)

    @classmethod
    def from_file(
        cls, path: str | Path, *, observers: Sequence[Observer] = (), **options: Any
    ) -> Run:
        """A Run of the program in ``path`` (checked against its ``bind=``/``bindings=`` first)."""
        cfg = RunConfig().replace(**options)
        loaded = _loaded(cfg)
        front = compile_file(path, overrides=cfg.params, bound_names=loaded.user_names())
        return cls(front, cfg.replace(bindings=loaded), observers=observers)

    def run(self, epochs: int | None = None, *, until_stable: bool = False, **kw: Any) -> RunResult:
        """Run epochs; ``RunResult.records`` holds one EpochRecord per epoch (``keep_records``)."""
        return self.engine.run(epochs, until_stable=until_stable, **kw)

    def enable(self, constraint: str, by: str = "api") -> None:
        """Make ``constraint`` count from the next epoch on (a RuleSet event, logged with that
        epoch). Unknown names are a UsageError (U075) listing the program's constraints."""
        self.engine.enable(constraint, by)

    def disable(self, constraint: str, by: str = "api") -> None:
        """Stop ``constraint`` counting from the next epoch on (a RuleSet event)."""
        self.engine.disable(constraint, by)

    @property
    def active_constraints(self) -> list[str]:
        """The constraints in the RuleSet for the next epoch, in program order."""
        return self.engine.active_constraints()

    def set_input(self, value: str, payload: Tensor, mask: Tensor) -> None:
        """Commit ``payload[mask]`` of ``value`` as given input: the payload goes to the workers,
        the cells' owner records them committed (provenance INPUT, clock 1)."""
        vp = self.plan.values.get(value)
        if vp is None:
            raise InputError(
                f"there is no value `{value}` with cells to take input",
                code="R010",
                hint="values: " + ", ".join(self.plan.values),
            )
        if payload.numel() != vp.ncells * math.prod(vp.cell_shape):
            raise InputError(
                f"input for `{value}` has {payload.numel()} elements; `{value}` has shape "
                f"{vp.dims} = {vp.ncells} cells"
                + (f" of {vp.cell_shape}" if vp.cell_shape else ""),
                where={"value": value},
                code="R011",
            )
        self.dataplane.set_input(value, payload, mask)  # its owner records the cells committed

    def payload(self, value: str) -> Tensor:
        """The committed payload of ``value`` ((ncells, *cell), fetched from the worker; unset
        cells hold 0)."""
        return self.dataplane.read(value)[0]

    # ---- the run directory (what `lmpm run --out` writes) --------------------------------------
    log: CommitLog | None = None
    run_dir: Path | None = None
    _lock: RunLock | None = None  # the run directory's, held until the run ends
    _ended = False  # the log says how the run ended
    _closed = False  # close() ran: the workers, the log and the lock are released

    def log_to(
        self,
        run_dir: str | Path | None = None,
        *,
        source: str,
        program_file: str | None = None,
        argv: Sequence[str] = (),
        quiet: bool = False,
        cli: bool = False,
        **settings: Any,
    ) -> CommitLog:
        """Append every epoch to RUN_DIR/lmpm.db (default ``config.out``), with the commit log's
        settings of :attr:`config` (trace, checkpoint_every, durable, until, force): the one
        new-run path of `lmpm run` and ``Compiled.runner(run_dir=...)``. The directory's lock
        is taken first and held until the run ends. A directory holding a run is refused (U030)
        unless ``force``, or unless that run failed before its first epoch (it is replaced: a
        note says so unless ``quiet``). ``cli``: messages name the command's flags. ``settings``:
        the log's settings changed on the way (``trace=``, ``trace_region=``,
        ``checkpoint_every=``, ``durable=``, ``until=``, ``force=``)."""
        out = Path(run_dir) if run_dir is not None else self.config.out
        if out is None:
            raise UsageError("give the run directory (run_dir=, --out)", code="U027")
        unknown = sorted(set(settings) - set(LOG_SETTINGS))
        if unknown:
            raise UsageError(
                f"log_to() takes no {', '.join(f'{k}=' for k in unknown)}",
                code="U107",
                hint="the log's settings: " + ", ".join(f"{k}=" for k in LOG_SETTINGS),
            )
        self.config = self.config.replace(out=out, **settings)
        if isinstance(self.dataplane, RayGroup):  # its workers checkpoint as the log does
            self.dataplane.checkpoint_every = self.config.checkpoint_every
        force = self.config.force
        flag = "--force" if cli else "force=True"
        lock = RunLock(out, what=f"delete ({flag})" if force else "write").acquire()
        try:
            log = self._new_log(out, source, program_file or self.front.ast.file, argv, quiet)
        except BaseException:
            lock.release()
            raise
        self._lock = lock
        return self._attach(log, out)

    def _new_log(
        self, out: Path, source: str, program_file: str, argv: Sequence[str], quiet: bool
    ) -> CommitLog:
        """The commit log of a new run in ``out`` (its lock held): a run already there is
        refused, replaced (it failed before its first epoch) or, with ``force``, deleted."""
        replace = False
        if holds_run(out) and not self.config.force:
            if not failed_before_first_epoch(out):
                refuse_existing(out)
            replace = True
            if not quiet:
                print(
                    f"note: replacing {out}: its run failed before its first epoch", file=sys.stderr
                )
        tracer, region = make_tracer(self, self.config.trace, self.config.trace_region)
        info = run_info(
            self.config,
            program_hash=program_hash(self.front.ir),
            program_file=program_file,
            source=source,
            bound=self.bound,
            tokenizers=tokenizer_meta(self.front.ir, self.vocabularies),
            trace_region=region,
        )
        if self.config.force or replace:
            try:
                remove_run(out)
            except OSError as e:
                raise os_error(e, "delete the old run in", out) from None
        log = CommitLog(out, info, tracer=tracer, argv=list(argv))
        self.save_tokenizers(out)
        return log

    def _attach(self, log: CommitLog, run_dir: Path) -> CommitLog:
        self.log, self.run_dir = log, run_dir
        self.engine.observers.append(log)
        return log

    def finish(self) -> list[Path]:
        """Write the outputs into the run directory and mark its log finished (no-op without
        one), then release the workers (:meth:`close`). A failure here ends the run as
        :meth:`failed` says."""
        with self:
            files = self.write(self.run_dir) if self.run_dir is not None else []
            if self.log is not None:
                self.log.finish(files)
            self._ended = True
        return files

    def failed(self, exc: BaseException) -> BaseException:
        """Record in the log how the run ended (``interrupted``, or ``failed`` with the error)
        and return the error to raise: an OS or SQLite error as the coded RunDirError it is, a
        model's or predicate's fault with where the run goes on from. The one end of a run that
        did not finish, for `lmpm run` and the API (``with Run(...)``, :meth:`finish`)."""
        self._ended = True
        if self.log is None or self.run_dir is None:
            return exc
        err = coded(exc, self.run_dir)
        if isinstance(err, ModelError | ConstraintEvalError):
            err.hint = resumable(err.hint, self.run_dir, self.engine.epoch)
        if isinstance(err, KeyboardInterrupt):
            self.log.mark("interrupted")
        elif isinstance(err, LmpmError):
            self.log.mark("failed", err.render())
        else:
            self.log.mark("failed", f"internal error: {type(err).__name__}: {err}")
        return err

    def close(self) -> None:
        """Release the worker processes of a multi-worker run (the payload lives in them: read
        the outputs first) and, for a run with a directory, its log and the directory's lock:
        every logged epoch stays, and `lmpm resume` goes on from it. Once: a second call does
        nothing."""
        if self._closed:
            return
        self._closed = True
        if self.log is not None:
            self.log.close()
        if self._lock is not None:
            self._lock.release()
        close = getattr(self.dataplane, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        """The log says how the run ended (:meth:`failed`); the run is closed."""
        try:
            if exc is not None and not self._ended:
                err = self.failed(exc)
                if err is not exc:
                    raise err from None
        finally:
            self.close()

    def outputs(self) -> dict[str, Any]:
        """Committed values as numpy arrays (unset: -1 for tokens, NaN for numbers)."""
        out = {}
        for name, vp in self.plan.values.items():
            payload, committed = self.dataplane.read(name)
            out[name] = output_array(vp, payload, committed)
        return out

    def payloads(self) -> dict[str, Tensor]:
        return {name: self.payload(name) for name in self.plan.values}

    def write(self, run_dir: str | Path) -> list[Path]:
        reads = {name: self.dataplane.read(name) for name in self.plan.values}
        return write_outputs(
            run_dir,
            self.plan.values,
            {n: r[0] for n, r in reads.items()},
            {n: r[1] for n, r in reads.items()},
            self.value_vocabularies,
        )


def _loaded(cfg: RunConfig) -> Bindings:
    """The Bindings of a config's ``bind=`` modules and ``bindings=`` (a mapping, or Bindings
    already loaded: the modules it lacks are added), loaded before the program is checked."""
    if isinstance(cfg.bindings, Bindings):
        extra = [m for m in cfg.bind if m not in cfg.bindings.modules]
        return cfg.bindings.extended(extra) if extra else cfg.bindings
    return Bindings(cfg.bind, dict(cfg.bindings or {}))


def make_group(
    plan: Plan, config: RunConfig, *, recipe: Recipe | None = None, topology: Any = None
) -> Any:
    """The data plane of a multi-worker run (``config.workers``, ``config.driver_name``): a
    WorkerGroup (``process``) or a RayGroup, which checkpoints its workers' payload every
    ``config.checkpoint_every`` epochs as the log does. ``recipe``: how a Ray worker rebuilds
    the plan; ``topology``: the partition (default :func:`lmpm.resolve.topology.partition`)."""
    if config.driver_name == "process":
        return WorkerGroup(
            plan,
            config.workers,
            topology=topology,
            backend=config.backend,
            seed=config.seed,
            checksum_policies=CHECKSUM_POLICIES,
        )
    return RayGroup(
        plan,
        config.workers,
        backend=config.backend,
        seed=config.seed,
        topology=topology,
        checksum_policies=CHECKSUM_POLICIES,
        options=RayOptions.of(config, recipe),
    )


def check_out(out: Path, force: bool) -> None:
    """Before any work (`lmpm run` checks again under the directory's lock, :meth:`Run.log_to`):
    ``out`` is no folder of the user's own files (D034), no live run's (its lock answers), and
    holds no run unless ``force`` or that run failed before its first epoch (U030)."""
    claim_folder(out)
    if holds_run(out) and not force:
        RunLock(out, create_dir=False).acquire().release()  # a live run: say so, not "exists"
        if not failed_before_first_epoch(out):
            refuse_existing(out)


def make_tracer(run: Run, level: str, region_text: str | None) -> tuple[Any, str | None]:
    if level == "off":
        return None, None
    region = None
    if region_text:
        region = parse_region(region_text, {n: vp.dims for n, vp in run.plan.values.items()})
    return Tracer(run.plan, level, region), None if region is None else str(region)


def run_info(
    cfg: RunConfig,
    *,
    program_hash: str,
    program_file: str,
    source: str,
    bound: dict[str, dict[str, str]],
    tokenizers: dict[str, list[str]],
    trace_region: str | None,
) -> RunInfo:
    """What the log stores of a run: the program's identity and its config's stored settings
    (:meth:`RunConfig.stored`, which :meth:`RunConfig.from_meta` reads back on resume)."""
    stored = cfg.stored()
    return RunInfo(
        program_hash=program_hash,
        program_file=program_file,
        source=source,
        params=stored["params"],
        bind=tuple(stored["bind"]),
        bound=bound,
        seed=cfg.seed,
        backend=cfg.backend,
        epochs=cfg.epochs,
        until=cfg.until,
        trace=cfg.trace,
        trace_region=trace_region,
        checkpoint_every=cfg.checkpoint_every,
        inputs=stored["inputs"],
        durable=cfg.durable,
        workers=cfg.workers,
        tokenizers=tokenizers,
    )


def coded(exc: BaseException, run_dir: Path) -> BaseException:
    """The error that ends a run with a directory: an OS or SQLite error writing it as the coded
    RunDirError it is (disk full, read-only...); any other error as itself."""
    if isinstance(exc, OSError):
        return os_error(exc, "write", run_dir)
    if isinstance(exc, sqlite3.Error):
        return sqlite_error(exc, "write", db_path(run_dir))
    return exc


def resumable(hint: str | None, out_dir: Path, epoch: int) -> str:
    """A model's or a predicate's fault ended epoch ``epoch``: the epochs before it are in the
    log, and the run goes on from there once the code is fixed (the hint of R050 and its kin)."""
    if epoch == 0:
        again = "after fixing it, run the same command again (no epoch was committed)"
    else:
        again = (
            f"epochs 0..{epoch - 1} are in {out_dir}: after fixing it, `lmpm run --resume "
            f"{out_dir}` goes on from epoch {epoch}"
        )
    return f"{hint}; {again}" if hint else again


# What resuming reads from the run's metadata besides its settings (RunConfig.from_meta reads
# those), with the JSON type each must have.
_META_TYPES: dict[str, tuple[type, ...]] = {
    "source": (str,),
    "program_file": (str,),
    "program_hash": (str,),
}


def check_meta(meta: Mapping[str, Any], run_dir: Path) -> None:
    """A hand-damaged ``meta`` table is a RunDirError naming the key, never an internal error;
    a workflow run's directory (`lmpm vm run`) is a UsageError saying what reads it."""
    if "workflow" in meta or meta.get("backend") == "vm":
        raise UsageError(
            f"{run_dir} holds a workflow run (`lmpm vm run`, workflow "
            f"`{meta.get('workflow', '?')}`): the epoch engine does not resume it; nothing was "
            "changed",
            code="U106",
            hint=f"see where it stands with `lmpm vm status {run_dir}`; run it again with "
            "`lmpm vm run`",
        )
    where = f"{run_dir}/lmpm.db"
    check_stored(meta, _META_TYPES, where)
    RunConfig.from_meta(meta, where)  # the stored settings, each checked
    if not all(isinstance(b, str) for b in meta["bind"]):
        raise RunDirError(f"{where} has damaged run settings; nothing was changed", code="D006")


def resume(run_dir: str | Path, request: ResumeRequest | None = None, **options: Any) -> Run:
    """A :class:`Run` continuing RUN_DIR from its last complete epoch, with its stored settings
    (:meth:`RunConfig.from_meta`): the one resume path of `lmpm run --resume` and
    :func:`lmpm.resume`. ``request``, or keyword ``options`` (its fields), says what changes
    (:class:`~lmpm.runtime.config.ResumeRequest`). ``run.restored`` says where it resumed;
    ``run.epochs`` is the epoch count to run to; call ``run.run(run.epochs)`` then
    ``run.finish()``. The directory's lock is taken first and held until ``finish()``.

    Refused, with nothing changed: a damaged meta table (D006), another program (D010), a program
    with check errors (CheckError), a stored setting named with another value (D011; ``bind``
    too). A run started with bound modules imports them again only when ``bind`` names them (the
    stored ones, D011 otherwise) or ``trust_bind=True`` says to import what the run directory
    names (U040): a run directory received from someone else never executes code by itself.
    ``cli``: messages name the command's flags (``--bind``, ``--trust-bind``) rather than the
    keywords."""
    req = ResumeRequest.of(request, **options)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        connect(run_dir)  # raises the RunDirError for a missing run
    lock = RunLock(run_dir, what="resume", create_dir=False).acquire()
    try:
        run = _resume_locked(run_dir, req)
    except BaseException:
        lock.release()
        raise
    run._lock = lock
    return run


def _resume_locked(run_dir: Path, req: ResumeRequest) -> Run:
    meta = _checked_meta(run_dir)
    params = dict(meta["params"])
    front = _resumed_front(meta, req.file, params, ())
    given = program_hash(front.ir)  # the IR does not depend on --set: compare before checking
    if given != meta["program_hash"]:
        raise RunDirError(
            MSG_FOREIGN.format(dir=run_dir, stored=meta["program_hash"][:12], given=given[:12]),
            code="D010",
        )
    for key, value in req.kept().items():
        stored = meta.get(key)
        if value != stored:
            raise RunDirError(
                f"{run_dir} was started with {req.flag(key)} {stored!r}; this command gives "
                f"{value!r}. A resumed run keeps its settings; nothing was changed.",
                code="D011",
                hint=f"drop {req.flag(key)}, or {_new_run(req.cli)}",
            )
    loaded = resume_bindings(
        meta, run_dir, req.bind, req.bindings, trust_bind=req.trust_bind, cli=req.cli
    )
    if loaded.user_names():  # checked against what the run binds, as it was started
        front = _resumed_front(meta, req.file, params, loaded.user_names())
    check_bound(meta, run_dir, loaded, {c.func for c in front.ir.calls()}, cli=req.cli)
    if front.errors:
        raise CheckError([d for d in front.diagnostics if d.severity == "error"])
    for spec, sha in dict(meta.get("bind_sha256", {})).items():
        if Path(spec).is_file() and file_sha256(spec) != sha:
            sys.stderr.write(f"note: {spec} changed since this run started; results may differ\n")
    return open_resumed(front, meta, run_dir, loaded, req)


def _checked_meta(run_dir: Path) -> dict[str, Any]:
    """The run's meta table, checked (D006: damaged; D012: a gap in its epochs)."""
    conn = connect(run_dir, readonly=True, check=True)
    try:
        with interpreting(db_path(run_dir), "resume"):
            meta = read_meta(conn)
            check_epochs(conn, run_dir)
            check_meta(meta, run_dir)
    finally:
        conn.close()
    return meta


def _resumed_front(
    meta: Mapping[str, Any], file: str | Path | None, params: dict[str, int], bound: Iterable[str]
) -> Frontend:
    """The resumed program (``file``, else the source the run stored), checked against the
    names ``bound`` the resumed run binds itself."""
    if file is not None:
        return compile_file(file, overrides=params, raise_errors=False, bound_names=bound)
    return compile_source(
        meta["source"],
        meta["program_file"],
        overrides=params,
        raise_errors=False,
        bound_names=bound,
    )


def resume_bindings(
    meta: Mapping[str, Any],
    run_dir: Path,
    bind: Sequence[str] | None,
    mapping: Mapping[str, Any] | None,
    *,
    trust_bind: bool,
    cli: bool,
) -> Bindings:
    """The Bindings a resumed run loads: the ``bind`` modules and the ``mapping`` it is given (or,
    with ``trust_bind``, the modules the run directory names). A module is imported only when the
    run was started with it, or when the run was started with a ``bindings=`` mapping (a module
    named now may stand in for it; :func:`check_bound` then holds it to the recorded names)."""
    stored = list(meta["bind"])
    given = list(bind_specs(bind or ()))
    mapped = [n for n, b in _stored_bound(meta).items() if b.get("from") == MAPPING]
    flag = "--bind" if cli else "bind="
    unnamed = set(stored) - set(given)  # a module the run was started with, not named now
    foreign = set(given) - set(stored)  # one it was not started with: only for a mapping's names
    if given and (unnamed or (foreign and not mapped)):
        raise RunDirError(
            f"{run_dir} was started with {flag} {stored!r}; this command gives {given!r}. "
            "A resumed run keeps its settings; nothing was changed.",
            code="D011",
            hint=f"drop {flag}, or {_new_run(cli)}",
        )
    modules = recorded_modules(stored, where=str(run_dir), given=given, trust=trust_bind, cli=cli)
    return Bindings(given or modules, dict(mapping or {}))


def _stored_bound(meta: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The names a run recorded binding itself ({} for a run from before they were recorded)."""
    bound = meta.get("bound")
    if not isinstance(bound, dict):
        return {}
    return {
        str(n): {"from": str(b.get("from", "")), "signature": str(b.get("signature", "?"))}
        for n, b in bound.items()
        if isinstance(b, dict)
    }


def check_bound(
    meta: Mapping[str, Any], run_dir: Path, loaded: Bindings, used: set[str], *, cli: bool
) -> None:
    """A resumed run binds the names its run bound itself, with the same Python signatures (a
    run from before they were recorded: not checked). Missing names are U040 (they are to be
    given again), other differences D011; nothing was changed."""
    if "bound" not in meta:
        return
    stored = _stored_bound(meta)
    now = bound_record(loaded, used)
    missing = sorted(set(stored) - set(now))
    if missing:
        names = ", ".join(f"`{n}`" for n in missing)
        how = (
            "give --bind MODULE binding them (a module whose @lmpm.bind or LMPM_BINDINGS binds "
            "the same names with the same signatures)"
            if cli
            else "pass bindings={"
            + ", ".join(f'"{n}": ...' for n in missing)
            + "} (or bind=[MODULE]) with the same names and signatures"
        )
        raise UsageError(
            f"{run_dir} was started binding {names} itself ("
            + "; ".join(
                f"`{n}{stored[n]['signature']}` from {origin_words(stored[n])}" for n in missing
            )
            + "); this resume does not bind "
            + ("it" if len(missing) == 1 else "them")
            + "; nothing was changed",
            code="U040",
            hint=how,
        )
    differences = bound_differences(stored, now)
    if differences:
        raise RunDirError(
            f"{run_dir} binds other names than its run did: "
            + "; ".join(differences)
            + ". A resumed run binds what it was started with; nothing was changed.",
            code="D011",
            hint="bind the same names with the same signatures, or " + _new_run(cli),
        )


def _new_run(cli: bool) -> str:
    return "start a new run with another --out" if cli else "start a new run in another run_dir"


def open_resumed(
    front: Frontend,
    meta: Mapping[str, Any],
    run_dir: Path,
    loaded: Bindings,
    request: ResumeRequest,
) -> Run:
    """The Run continuing RUN_DIR (its program checked against the stored one, its lock held by
    the caller) restored to its last complete epoch, with its commit log open and attached for
    the epochs to come: the stored config (:meth:`RunConfig.from_meta`) changed as ``request``
    asks (:meth:`ResumeRequest.config`). ``request.trace_region`` must name the stored region;
    ``request.ruleset``: (enable|disable, constraint) changes from now on."""
    stored_workers(meta, run_dir, request.workers)
    # the stored --bind specs, as the log recorded them (`loaded`: what resume_bindings let
    # load, through recorded_modules; the Run binds that and nothing else)
    stored = RunConfig.from_meta(meta, f"{run_dir}/lmpm.db").replace(bind=tuple(meta["bind"]))
    cfg = request.config(stored)
    saved = saved_tokenizers(run_dir)
    run = Run(
        front,
        # the plan's epochs are the run's first --epochs (they fix the confidence schedule)
        cfg.replace(
            epochs=meta.get("plan_epochs", meta["epochs"]),
            bind=loaded.modules,
            bindings=loaded,
            inputs={},  # in the first checkpoint
            tokenizers={n: saved[n] for n in meta.get("tokenizers", {}) if n in saved},
        ),
    )
    try:
        log, restored = _resumed_log(run, meta, run_dir, cfg, request)
    except BaseException:
        run.close()
        raise
    run.restored = restored
    run.epochs, run.until = cfg.epochs, cfg.until
    run._attach(log, run_dir)
    return run


def _resumed_log(
    run: Run, meta: Mapping[str, Any], run_dir: Path, cfg: RunConfig, request: ResumeRequest
) -> tuple[CommitLog, Restored]:
    """Restore ``run`` from RUN_DIR's log and open it for the epochs to come (the caller closes
    the run if this fails)."""
    region_text = meta.get("trace_region")
    if request.trace_region:
        mine = parse_region(request.trace_region, {n: vp.dims for n, vp in run.plan.values.items()})
        if str(mine) != region_text:
            raise RunDirError(
                f"{run_dir} was started with --trace-region {region_text!r}; this command "
                f"gives {str(mine)!r}; nothing was changed",
                code="D011",
            )
    tracer, region = make_tracer(run, cfg.trace, region_text)
    conn = connect(run_dir, readonly=False, durable=cfg.durable)
    try:
        with interpreting(db_path(run_dir), "resume"):  # the log's rows and checkpoints
            restored = restore(run.engine, conn, run_dir)
        for op, name in request.ruleset:
            run.engine.change_ruleset(op, name, "cli")
    except BaseException:
        conn.close()
        raise
    info = run_info(
        cfg,
        program_hash=meta["program_hash"],
        program_file=meta["program_file"],
        source=meta["source"],
        bound=_stored_bound(meta) if "bound" in meta else run.bound,
        tokenizers=tokenizer_meta(run.front.ir, run.vocabularies),
        trace_region=region,
    )
    log = CommitLog(run_dir, info, tracer=tracer, conn=conn, argv=list(request.argv))
    return log, restored


def stored_workers(meta: Mapping[str, Any], run_dir: Path, asked: int | None = None) -> int:
    """The worker count a run was started with (1 for runs from before --workers). A resumed run
    keeps it: its payload is in one shard per worker."""
    workers = meta.get("workers", 1)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise RunDirError(
            f"{run_dir}/lmpm.db has a damaged `workers` ({workers!r}); nothing was changed",
            code="D006",
        )
    if asked is not None and asked != workers:
        raise RunDirError(
            f"{run_dir} was started with --workers {workers}; this command gives {asked}. Its "
            "payload is split in one shard per worker; nothing was changed.",
            code="D011",
            hint="drop --workers (the driver may change: --driver process|ray)",
        )
    return workers


def check_bindings(
    front: Frontend,
    params: Mapping[str, int],
    bindings: Bindings,
    mapping: Mapping[str, Any] | None = None,
) -> None:
    """The checks `lmpm run` makes before epoch 0, also for the Python API: every static check,
    strictly against the names this run binds (CheckError, located), and no ``bindings=`` key the
    program does not use (a misspelled key would otherwise be ignored silently)."""
    used = sorted({c.func for c in front.ir.calls()})
    unknown = sorted(set(mapping or {}) - set(used))
    if unknown:
        raise BindError(
            f"bindings= names {', '.join(f'`{n}`' for n in unknown)}, which the program does "
            "not use",
            code="B021",
            hint="the program's call names: " + (", ".join(used) or "none"),
        )
    sink = DiagnosticSink()
    check(
        front.ir,
        sink,
        overrides=params,
        # names bound for this run, and commit policies registered at run time (@register)
        known_names=set(bindings.names()) | set(POLICIES),
        strict=True,
        tree=front.ast,
        bound_names=bindings.user_names(),
    )
    sink.raise_if_errors()
