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
    DiagnosticSink,
    InputError,
    LmpmError,
    RunDirError,
    UsageError,
)
from lmpm.ir import Frontend, check, compile_file, compile_source
from lmpm.resolve.plan import Plan, resolve
from lmpm.resolve.policies import POLICIES
from lmpm.runtime.control.commitlog import (
    DEFAULT_CHECKPOINT_EVERY,
    MSG_FOREIGN,
    CommitLog,
    Restored,
    RunInfo,
    check_epochs,
    file_sha256,
    program_hash,
    refuse_existing,
    restore,
)
from lmpm.runtime.control.engine import Engine, Observer
from lmpm.runtime.control.trace import Tracer, parse_region
from lmpm.runtime.data import validate
from lmpm.runtime.data.group import WorkerGroup
from lmpm.runtime.data.raygroup import DEFAULT_TIMEOUT, RayGroup
from lmpm.runtime.io import load_input, output_array, write_outputs
from lmpm.runtime.lock import RunLock
from lmpm.runtime.received import interpreting
from lmpm.runtime.records import CHECKSUM_POLICIES, RunResult
from lmpm.runtime.rundir import connect, db_path, holds_run, read_meta, remove_run
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


class Run:
    """A program bound to parameters, bindings, inputs and a seed, ready to run epochs."""

    def __init__(
        self,
        front: Frontend,
        *,
        params: Mapping[str, int] | None = None,
        bind: Sequence[str] = (),
        bindings: Mapping[str, Any] | Bindings | None = None,
        inputs: Mapping[str, str | Path] | None = None,
        seed: int = 0,
        backend: str = "cpu",
        epochs: int | None = None,
        observers: Sequence[Observer] = (),
        guard: bool = False,
        keep_records: bool = True,
        workers: int = 1,
        driver: str | None = None,
        cluster: str | None = None,
        worker_timeout: float | None = None,
        topology: Any = None,
        compile: bool = False,
        tokenizers: Mapping[str, str | Path] | None = None,
        max_memory: int | None = None,
    ) -> None:
        refuse_workflows(front)
        self.front = front
        # a tokenizer sizes its vocabulary (the parameter NAME of Token[NAME]): lmpm.runtime.vocab
        self.vocabularies, self.params = bind_vocabularies(front.ir, tokenizers or {}, params or {})
        self.given_params = dict(params or {})  # what the caller set (a run's stored settings)
        require_sizes(front.ir, self.params)
        self.seed = seed
        self.backend = backend
        self.epochs = epochs
        # ``bindings``: a mapping, or the Bindings of ``bind`` and a mapping already loaded (the
        # program was checked against them: `lmpm run`, lmpm.compile, resume)
        if isinstance(bindings, Bindings):
            self.bindings = bindings.extended(bind) if bind else bindings
        else:
            self.bindings = Bindings(bind, dict(bindings or {}))
        self.bind = self.bindings.modules
        mapping = self.bindings.mapping
        check_bindings(front, self.params, self.bindings, mapping)
        # what the run directory records of the names this run binds itself (resume checks it)
        self.bound = bound_record(self.bindings, {c.func for c in front.ir.calls()})
        self.plan: Plan = resolve(
            front.ir, self.params, self.bindings, epochs=epochs, max_memory=max_memory
        )
        self.workers = workers
        self.driver = pick_driver(workers, driver, cluster)
        if worker_timeout is not None and not worker_timeout > 0:
            raise UsageError(
                f"worker timeout {worker_timeout}: give a positive number of seconds", code="U083"
            )
        group = None
        if self.driver != "single":
            if guard:
                raise UsageError("the payload guard checks one worker; use workers=1", code="U080")
            group = make_group(
                self.plan,
                workers,
                self.driver,
                backend=backend,
                seed=seed,
                cluster=cluster,
                timeout=worker_timeout,
                topology=topology,
                recipe=(front.ir, self.params, bind_specs(self.bind), mapping, epochs),
            )
        self.engine = Engine(
            self.plan,
            backend=backend,
            seed=seed,
            observers=observers,
            keep_records=keep_records,
            guard=guard,
            dataplane=group,
        )
        # the concrete data plane (the API edge reaches its workers; the engine only its port)
        self.dataplane: Any = self.engine.dataplane
        if compile:
            try:
                self.engine.compile()
                # LMPM_VALIDATE=eager: each compiled epoch decided eagerly too, and compared
                validate.install(self.dataplane)
            except BaseException:
                self.close()
                raise
        self.inputs = {name: str(path) for name, path in (inputs or {}).items()}
        self.restored: Restored | None = None  # set by resume()
        self.until: str | None = None
        try:
            for name, path in (inputs or {}).items():
                vp = self.plan.values.get(name)
                if vp is None:
                    raise UsageError(
                        f"--input {name}=...: the program has no value `{name}` with cells",
                        hint="values: " + ", ".join(self.plan.values),
                        code="U020",
                    )
                payload, mask = load_input(path, vp, self.value_vocabularies.get(name))
                self.set_input(name, payload, mask)
        except BaseException:
            self.close()  # worker processes started for this run
            raise

    @property
    def value_vocabularies(self) -> dict[str, Vocabulary]:
        """Value name -> the tokenizer of its vocabulary (values of a bound vocabulary only)."""
        return by_value(self.front.ir, self.vocabularies)

    def save_tokenizers(self, run_dir: str | Path) -> list[Path]:
        """Copy the run's tokenizers into RUN_DIR (read by `lmpm trace` and a resume)."""
        return save_tokenizers(run_dir, self.vocabularies)

    @classmethod
    def from_source(cls, text: str, file: str = "<input>", **kw: Any) -> Run:
        loaded = _loaded(kw)
        front = compile_source(
            text, file, overrides=kw.get("params"), bound_names=loaded.user_names()
        )
        return cls(front, bindings=loaded, **kw)

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> Run:
        loaded = _loaded(kw)
        front = compile_file(path, overrides=kw.get("params"), bound_names=loaded.user_names())
        return cls(front, bindings=loaded, **kw)

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

    def log_to(
        self,
        run_dir: str | Path,
        *,
        source: str,
        program_file: str | None = None,
        trace: str = "summary",
        trace_region: str | None = None,
        checkpoint_every: int | None = None,
        until: str | None = None,
        force: bool = False,
        argv: Sequence[str] = (),
    ) -> CommitLog:
        """Append every epoch to RUN_DIR/lmpm.db (commit log + constraint trace at ``trace``)."""
        if trace not in ("off", "summary", "cells"):
            raise UsageError(f"trace={trace!r}: use off, summary or cells", code="U025")
        if trace_region and trace != "cells":
            raise UsageError("a trace region needs trace level cells", code="U025")
        if checkpoint_every is not None and checkpoint_every < 1:
            raise UsageError("checkpoint_every must be at least 1", code="U024")
        out = Path(run_dir)
        # the directory's lock, as `lmpm run` takes it, held until finish()
        self._lock = RunLock(out, what="delete (force=True)" if force else "write").acquire()
        if holds_run(out) and not force:
            self._lock.release()
            refuse_existing(out)
        tracer, region = make_tracer(self, trace, trace_region)
        info = RunInfo(
            program_hash=program_hash(self.front.ir),
            program_file=program_file or self.front.ast.file,
            source=source,
            params=self.given_params,
            bind=bind_specs(self.bind),
            bound=self.bound,
            seed=self.seed,
            backend=self.backend,
            epochs=self.epochs,
            until=until,
            trace=trace,
            trace_region=region,
            checkpoint_every=checkpoint_every or DEFAULT_CHECKPOINT_EVERY,
            inputs={k: str(Path(v).resolve()) for k, v in self.inputs.items()},
            workers=self.workers,
            tokenizers=tokenizer_meta(self.front.ir, self.vocabularies),
        )
        if force:
            remove_run(out)
        log = self._attach(CommitLog(out, info, tracer=tracer, argv=list(argv)), out)
        self.save_tokenizers(out)
        return log

    def _attach(self, log: CommitLog, run_dir: Path) -> CommitLog:
        self.log, self.run_dir = log, run_dir
        self.engine.observers.append(log)
        return log

    def finish(self) -> list[Path]:
        """Write the outputs into the run directory and close its log (no-op without one), then
        release the workers (:meth:`close`)."""
        if self.log is None or self.run_dir is None:
            self.close()
            return []
        try:
            files = self.write(self.run_dir)
            self.log.finish(files)
        finally:
            self.log.close()
            lock = getattr(self, "_lock", None)
            if lock is not None:
                lock.release()
            self.close()
        return files

    def close(self) -> None:
        """Release the worker processes of a multi-worker run (the payload lives in them: read
        the outputs first) and, for a run with a directory that did not :meth:`finish`, its log
        and the directory's lock: every logged epoch stays, and `lmpm resume` goes on from it."""
        if self.log is not None:
            self.log.close()
            lock = getattr(self, "_lock", None)
            if lock is not None:
                lock.release()
        close = getattr(self.dataplane, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is not None and self.log is not None:  # the log says how the run ended
            err = exc.render() if isinstance(exc, LmpmError) else f"{type(exc).__name__}: {exc}"
            self.log.mark("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed", err)
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


def _loaded(kw: dict[str, Any]) -> Bindings:
    """The Bindings of a Run's ``bind=`` and ``bindings=`` keywords (taken out of ``kw``), loaded
    before the program is checked against them."""
    bindings = kw.pop("bindings", None)
    bind = kw.pop("bind", ())
    if isinstance(bindings, Bindings):
        return bindings.extended(bind) if bind else bindings
    return Bindings(bind, dict(bindings or {}))


DRIVERS = ("single", "process", "ray")


def pick_driver(workers: int, driver: str | None, cluster: str | None) -> str:
    """Which driver runs ``workers`` workers: ``single`` (one in-process worker, the default),
    ``process`` (W partitioned workers in this process) or ``ray`` (one Ray actor per worker; the
    default for W > 1 and with a cluster address)."""
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 4096:
        raise UsageError(f"workers={workers!r}: give a count from 1 to 4096", code="U080")
    if driver is not None and driver not in DRIVERS:
        raise UsageError(f"driver={driver!r}: one of {', '.join(DRIVERS)}", code="U084")
    if cluster and driver not in (None, "ray"):
        raise UsageError(f"a cluster address needs the ray driver, not {driver}", code="U084")
    if driver is None:
        return "ray" if workers > 1 or cluster else "single"
    if driver == "single" and workers > 1:
        raise UsageError(f"the single driver runs one worker, not {workers}", code="U084")
    return driver


def make_group(
    plan: Plan,
    workers: int,
    driver: str,
    *,
    backend: str,
    seed: int,
    cluster: str | None,
    timeout: float | None,
    recipe: tuple[Any, ...],
    topology: Any = None,
) -> Any:
    """The data plane of a multi-worker run: a WorkerGroup (``process``) or a RayGroup.
    ``topology``: the partition (default :func:`lmpm.resolve.topology.partition`)."""

    if driver == "process":
        return WorkerGroup(
            plan,
            workers,
            topology=topology,
            backend=backend,
            seed=seed,
            checksum_policies=CHECKSUM_POLICIES,
        )
    return RayGroup(
        plan,
        workers,
        backend=backend,
        seed=seed,
        topology=topology,
        checksum_policies=CHECKSUM_POLICIES,
        cluster=cluster,
        recipe=recipe,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
    )


def bind_specs(items: Sequence[str]) -> tuple[str, ...]:
    """--bind specs as stored in a run: files as absolute paths, dotted modules as given."""
    return tuple(
        str(Path(b).resolve()) if b.endswith(".py") or Path(b).exists() else b for b in items
    )


def make_tracer(run: Run, level: str, region_text: str | None) -> tuple[Any, str | None]:
    if level == "off":
        return None, None
    region = None
    if region_text:
        region = parse_region(region_text, {n: vp.dims for n, vp in run.plan.values.items()})
    return Tracer(run.plan, level, region), None if region is None else str(region)


# What resuming reads from the run's metadata, with the JSON type each must have.
_META_TYPES: dict[str, tuple[type, ...]] = {
    "params": (dict,),
    "source": (str,),
    "program_file": (str,),
    "program_hash": (str,),
    "bind": (list,),
    "seed": (int,),
    "backend": (str,),
    "trace": (str,),
    "checkpoint_every": (int,),
    "epochs": (int, type(None)),  # None: the run was started without --epochs
    "until": (str, type(None)),
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
    for key, types in _META_TYPES.items():
        if key not in meta:
            raise RunDirError(
                f"{run_dir}/lmpm.db lacks the run's `{key}` (meta table damaged); nothing was "
                "changed",
                code="D006",
            )
        if not isinstance(meta[key], types) or isinstance(meta[key], bool):
            raise RunDirError(
                f"{run_dir}/lmpm.db has a damaged `{key}` ({str(meta[key])[:40]!r}); nothing was "
                "changed",
                code="D006",
            )
    bad_params = [k for k, v in meta["params"].items() if not isinstance(v, int)]
    bad_bind = [b for b in meta["bind"] if not isinstance(b, str)]
    if bad_params or bad_bind or meta["checkpoint_every"] < 1:
        raise RunDirError(
            f"{run_dir}/lmpm.db has damaged run settings; nothing was changed", code="D006"
        )


def resume(
    run_dir: str | Path,
    *,
    file: str | Path | None = None,
    epochs: int | None = None,
    until: str | None = None,
    backend: str | None = None,
    bind: Sequence[str] | None = None,
    bindings: Mapping[str, Any] | None = None,
    trust_bind: bool = False,
    settings: Mapping[str, tuple[str, Any]] | None = None,
    workers: int | None = None,
    driver: str | None = None,
    cluster: str | None = None,
    worker_timeout: float | None = None,
    compile: bool = False,
    keep_records: bool = True,
    durable: bool = False,
    trace_region: str | None = None,
    ruleset: Sequence[tuple[str, str]] = (),
    argv: Sequence[str] = (),
    cli: bool = False,
) -> Run:
    """A :class:`Run` continuing RUN_DIR from its last complete epoch, with its stored settings:
    the one resume path of `lmpm run --resume` and :func:`lmpm.resume`. ``run.restored`` says where
    it resumed; ``run.epochs`` is the epoch count to run to; call ``run.run(run.epochs)`` then
    ``run.finish()``. The directory's lock is taken first and held until ``finish()``.

    Refused, with nothing changed: a damaged meta table (D006), another program (D010), a program
    with check errors (CheckError), a setting that differs from the stored one (``settings``:
    key -> (flag as the caller names it, value or None); ``bind`` is one of them, D011). A run
    started with bound modules imports them again only when ``bind`` names them (the stored ones,
    D011 otherwise) or ``trust_bind=True`` says to import what the run directory names (U040): a
    run directory received from someone else never executes code by itself. ``cli``: messages
    name the command's flags (``--bind``, ``--trust-bind``) rather than the keywords."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        connect(run_dir)  # raises the RunDirError for a missing run
    lock = RunLock(run_dir, what="resume", create_dir=False).acquire()
    try:
        run = _resume_locked(
            run_dir,
            file=file,
            epochs=epochs,
            until=until,
            backend=backend,
            bind=bind,
            bindings=bindings,
            trust_bind=trust_bind,
            settings=settings or {},
            workers=workers,
            driver=driver,
            cluster=cluster,
            worker_timeout=worker_timeout,
            compile=compile,
            keep_records=keep_records,
            durable=durable,
            trace_region=trace_region,
            ruleset=ruleset,
            argv=argv,
            cli=cli,
        )
    except BaseException:
        lock.release()
        raise
    run._lock = lock
    return run


def _resume_locked(
    run_dir: Path,
    *,
    file: str | Path | None,
    epochs: int | None,
    until: str | None,
    bind: Sequence[str] | None,
    bindings: Mapping[str, Any] | None,
    trust_bind: bool,
    settings: Mapping[str, tuple[str, Any]],
    cli: bool,
    **opts: Any,
) -> Run:
    conn = connect(run_dir, readonly=True, check=True)
    try:
        with interpreting(db_path(run_dir), "resume"):
            meta = read_meta(conn)
            check_epochs(conn, run_dir)
            check_meta(meta, run_dir)
    finally:
        conn.close()
    params = dict(meta["params"])
    front = _resumed_front(meta, file, params, ())
    given = program_hash(front.ir)  # the IR does not depend on --set: compare before checking
    if given != meta["program_hash"]:
        raise RunDirError(
            MSG_FOREIGN.format(dir=run_dir, stored=meta["program_hash"][:12], given=given[:12]),
            code="D010",
        )
    for key, (flag, value) in settings.items():
        stored = meta.get(key)
        if value is not None and value != stored:
            raise RunDirError(
                f"{run_dir} was started with {flag} {stored!r}; this command gives {value!r}. "
                "A resumed run keeps its settings; nothing was changed.",
                code="D011",
                hint=f"drop {flag}, or {_new_run(cli)}",
            )
    loaded = resume_bindings(meta, run_dir, bind, bindings, trust_bind=trust_bind, cli=cli)
    if loaded.user_names():  # checked against what the run binds, as it was started
        front = _resumed_front(meta, file, params, loaded.user_names())
    check_bound(meta, run_dir, loaded, {c.func for c in front.ir.calls()}, cli=cli)
    if front.errors:
        raise CheckError([d for d in front.diagnostics if d.severity == "error"])
    for spec, sha in dict(meta.get("bind_sha256", {})).items():
        if Path(spec).is_file() and file_sha256(spec) != sha:
            sys.stderr.write(f"note: {spec} changed since this run started; results may differ\n")
    epochs = epochs if epochs is not None else meta["epochs"]
    until = until or meta["until"]
    run, log, restored = open_resumed(
        front, meta, run_dir, loaded, epochs=epochs, until=until, **opts
    )
    run.restored = restored
    run.epochs, run.until = log.info.epochs, log.info.until
    run._attach(log, run_dir)
    return run


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
    *,
    epochs: int | None = None,
    until: str | None = None,
    backend: str | None = None,
    workers: int | None = None,
    driver: str | None = None,
    cluster: str | None = None,
    worker_timeout: float | None = None,
    compile: bool = False,
    keep_records: bool = True,
    durable: bool = False,
    trace_region: str | None = None,
    ruleset: Sequence[tuple[str, str]] = (),
    argv: Sequence[str] = (),
) -> tuple[Run, CommitLog, Restored]:
    """The Run continuing RUN_DIR (its program checked against the stored one, its lock held by
    the caller) restored to its last complete epoch, and its commit log open for the epochs to
    come, with the run's stored settings: what `lmpm run --resume` and :func:`resume` share.
    ``durable`` turns ``--durable`` on (a run started with it keeps it); ``trace_region`` must
    name the stored region; ``ruleset``: (enable|disable, constraint) changes from now on."""
    backend = backend or meta["backend"]
    saved = saved_tokenizers(run_dir)
    run = Run(
        front,
        params=dict(meta["params"]),
        bindings=loaded,
        tokenizers={name: saved[name] for name in meta.get("tokenizers", {}) if name in saved},
        seed=int(meta["seed"]),
        backend=backend,
        epochs=meta.get("plan_epochs", meta["epochs"]),
        keep_records=keep_records,
        workers=stored_workers(meta, run_dir, workers),
        driver=driver,
        cluster=cluster,
        worker_timeout=worker_timeout,
        compile=compile,
    )
    try:
        region_text = meta.get("trace_region")
        if trace_region:
            mine = parse_region(trace_region, {n: vp.dims for n, vp in run.plan.values.items()})
            if str(mine) != region_text:
                raise RunDirError(
                    f"{run_dir} was started with --trace-region {region_text!r}; this command "
                    f"gives {str(mine)!r}; nothing was changed",
                    code="D011",
                )
        tracer, region = make_tracer(run, meta["trace"], region_text)
        durable = bool(durable or meta.get("durable", False))
        conn = connect(run_dir, readonly=False, durable=durable)
    except BaseException:
        run.close()
        raise
    try:
        with interpreting(db_path(run_dir), "resume"):  # the log's rows and checkpoints
            restored = restore(run.engine, conn, run_dir)
        for op, name in ruleset:
            run.engine.change_ruleset(op, name, "cli")
    except BaseException:
        conn.close()
        run.close()
        raise
    info = RunInfo(
        program_hash=meta["program_hash"],
        program_file=meta["program_file"],
        source=meta["source"],
        params=dict(meta["params"]),
        bind=tuple(meta["bind"]),
        bound=_stored_bound(meta) if "bound" in meta else run.bound,
        seed=int(meta["seed"]),
        backend=backend,
        epochs=epochs if epochs is not None else meta["epochs"],
        until=until or meta["until"],
        trace=meta["trace"],
        trace_region=region,
        checkpoint_every=int(meta["checkpoint_every"]),
        inputs=dict(meta.get("inputs", {})),
        durable=durable,
        workers=run.workers,
        tokenizers=tokenizer_meta(front.ir, run.vocabularies),
    )
    return run, CommitLog(run_dir, info, tracer=tracer, conn=conn, argv=list(argv)), restored


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
