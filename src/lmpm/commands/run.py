"""`lmpm run FILE`: run a program epoch by epoch and write its committed values.

Every epoch is appended to RUN_DIR/lmpm.db (the commit log and constraint trace, see
docs/trace.md); `lmpm run --resume RUN_DIR` continues a killed run from its last complete epoch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from lmpm.commands.check import unknown_params
from lmpm.commands.common import (
    add_set,
    add_tokenizer,
    memory_size,
    parse_inputs,
    parse_sets,
    parse_tokenizers,
    print_diagnostics,
    program_path,
)
from lmpm.errors import CheckError, UsageError
from lmpm.runtime.config import DEFAULT_CHECKPOINT_EVERY, ResumeRequest, RunConfig

if TYPE_CHECKING:
    from rich.console import Console

    from lmpm.runtime.records import EpochRecord, RunResult
    from lmpm.runtime.session import Run


HELP = "run a program: epochs of compute → propose → check → agree → commit"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="the .lmpm program (optional with --resume)")
    add_set(p)
    p.add_argument(
        "--bind",
        action="append",
        default=[],
        metavar="MODULE",
        help="Python module or .py file binding names (Model, Palette, ...)",
    )
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="initial committed cells of a value (.npy, .pt, .json, or text: bytes for "
        "Token[Byte], encoded with the value's --tokenizer otherwise); a token value's input "
        "shorter than the value (a prompt) fills its first cells",
    )
    add_tokenizer(p)
    p.add_argument("--seed", type=int, help="RNG seed (default 0)")
    p.add_argument("--epochs", type=int, help="run this many epochs")
    p.add_argument("--until", choices=["stable"], help="stop at the first epoch with no commit")
    p.add_argument("--backend", help="worker backend (cpu, cuda; default cpu)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="run each value's epoch after its model as one compiled step (torch.compile; the "
        "first epochs compile, later runs reuse the cache; commits are identical). Environment: "
        "LMPM_VALIDATE=eager also decides each epoch eagerly and stops at the first cell where "
        "the two differ (R085)",
    )
    p.add_argument(
        "--epochs-per-replay",
        type=int,
        default=1,
        metavar="K",
        help="with --compile --backend cuda: replay K epochs (a power of two) per CUDA graph where "
        "every model is capturable and the schedule needs no host decision between epochs; the "
        "summary says why a run replays one (docs/runtime.md)",
    )
    p.add_argument("--out", metavar="RUN_DIR", help="write outputs here (default runs/<program>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last complete epoch (settings come from RUN_DIR)",
    )
    p.add_argument(
        "--enable",
        metavar="CONSTRAINT",
        action="append",
        dest="ruleset",
        type=lambda name: ("add", name),
        help="with --resume: the constraint counts again from the resumed epoch on (RuleSet)",
    )
    p.add_argument(
        "--disable",
        metavar="CONSTRAINT",
        action="append",
        dest="ruleset",
        type=lambda name: ("remove", name),
        help="with --resume: the constraint stops counting from the resumed epoch on (RuleSet)",
    )
    p.add_argument(
        "--trust-bind",
        action="store_true",
        help="with --resume: import the --bind modules recorded in RUN_DIR without naming them",
    )
    p.add_argument(
        "--max-memory",
        type=memory_size,
        metavar="BYTES",
        help="refuse, before any work, a plan whose values and gather tables need more "
        "(e.g. 8G, 512M; default: this machine's memory)",
    )
    p.add_argument(
        "--durable",
        action="store_true",
        help="fsync the log at every epoch (SQLite synchronous=FULL) and every checkpoint: no "
        "epoch lost to a power cut",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="start over in an --out directory that already holds a run (deletes its log)",
    )
    p.add_argument(
        "--trace",
        choices=["off", "summary", "cells"],
        help="constraint trace in RUN_DIR/lmpm.db: off, summary (default; per epoch × constraint "
        "× rule) or cells (also every candidate of every cell)",
    )
    p.add_argument(
        "--trace-region",
        metavar="REGION",
        help="with --trace cells: only these cells, e.g. 'Vid[0, 0..15, 0..15]'",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="split the payload over N workers (default 1; N > 1 runs each as a Ray actor, "
        "see --driver)",
    )
    p.add_argument(
        "--driver",
        choices=["single", "process", "ray"],
        help="how workers run: single (one, in this process), process (N partitioned workers in "
        "this process), ray (one Ray actor per worker; the default for N > 1)",
    )
    p.add_argument(
        "--cluster",
        metavar="ADDRESS",
        help="run the workers on a running Ray cluster (ray start --head) at ADDRESS",
    )
    p.add_argument(
        "--worker-timeout",
        type=float,
        metavar="S",
        help="seconds a worker may take for one phase of an epoch before it is replaced "
        "(default 120)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="K",
        help=f"payload checkpoint every K epochs (default {DEFAULT_CHECKPOINT_EVERY})",
    )


def config(args: argparse.Namespace, out_dir: Path | None) -> RunConfig:
    """The run's config from the command's flags (validated once, in RunConfig)."""
    return RunConfig(
        params=parse_sets(args.set),
        bind=tuple(args.bind),
        inputs=parse_inputs(args.input),
        tokenizers=parse_tokenizers(args.tokenizer),
        seed=0 if args.seed is None else args.seed,
        backend=args.backend or "cpu",
        epochs=args.epochs,
        until=args.until,
        workers=1 if args.workers is None else args.workers,
        driver=args.driver,
        cluster=args.cluster,
        worker_timeout=args.worker_timeout,
        checkpoint_every=_every(args.checkpoint_every),
        durable=args.durable,
        trace=args.trace or "summary",
        trace_region=args.trace_region,
        compile=args.compile,
        epochs_per_replay=args.epochs_per_replay,
        max_memory=args.max_memory,
        keep_records=False,  # the commit log keeps them; a long run must not hold them all
        out=out_dir,
        force=args.force,
    )


def _every(k: int | None) -> int:
    return DEFAULT_CHECKPOINT_EVERY if k is None else k


def run(args: argparse.Namespace) -> int:
    if args.trust_bind and not args.resume:
        raise UsageError("--trust-bind only applies to --resume", code="U041")
    if args.ruleset and not args.resume:
        raise UsageError(
            "--enable/--disable change the RuleSet of a run between epochs: they apply to --resume",
            code="U076",
            hint="a new run starts with every constraint enabled",
        )
    if args.resume:
        if args.epochs_per_replay != 1:
            raise UsageError(
                "--epochs-per-replay applies to a new run; a resumed run replays one epoch at a time",
                code="U109",
            )
        # the flags' values are checked as a new run's are (U022, U042, U024)
        RunConfig(
            epochs=args.epochs,
            seed=0 if args.seed is None else args.seed,
            checkpoint_every=_every(args.checkpoint_every),
        )
        return _resume(args)
    if args.file is None:
        raise UsageError("give the .lmpm program to run, or --resume RUN_DIR", code="U023")

    from lmpm.bindings import Bindings
    from lmpm.ir import compile_file
    from lmpm.runtime.session import Run, check_out

    path = program_path(args.file)
    cfg = config(args, Path(args.out) if args.out else Path("runs") / path.stem)
    assert cfg.out is not None
    check_out(cfg.out, cfg.force)  # before any work: a folder of other files, a run there
    # the --bind modules are loaded once, first: the program is checked against the names they
    # bind (one of them may override a built-in), as `lmpm check --bind` checks it
    loaded = Bindings(cfg.bind)
    front = compile_file(
        path, overrides=dict(cfg.params), raise_errors=False, bound_names=loaded.user_names()
    )
    unknown_params(front)  # an unknown --set name is a usage error (exit 2), listing the params
    print_diagnostics([d for d in front.diagnostics if d.severity == "error"], False)
    if front.errors:
        return 1
    from lmpm.train.frontend import is_training, train_spec

    if is_training(front.ir):
        from lmpm.train.cli import run_training

        spec = train_spec(front.ir, dict(cfg.params))
        assert spec is not None
        return run_training(args, spec, path.read_text(encoding="utf-8"), dict(cfg.params), cfg.out)
    session = Run(front, cfg.replace(bindings=loaded))
    try:
        session.log_to(
            source=path.read_text(encoding="utf-8"),
            program_file=str(path),
            argv=sys.argv[1:],
            quiet=args.quiet,
            cli=True,
        )
    except BaseException:
        session.close()
        raise
    return _execute(session, args, quiet=0, note="")


def _resume(args: argparse.Namespace) -> int:
    from lmpm.runtime.rundir import connect

    run_dir = Path(args.resume)
    if args.force:
        raise UsageError("--resume continues a run and --force deletes it; give one", code="U026")
    if args.out and Path(args.out).resolve() != run_dir.resolve():
        raise UsageError(f"--out {args.out} differs from --resume {args.resume}", code="U027")
    if not run_dir.is_dir():
        connect(run_dir)  # raises the RunDirError for a missing run
    from lmpm.train.log import holds_training

    if holds_training(run_dir):
        from lmpm.train.cli import resume_training

        return resume_training(args, run_dir)
    if args.tokenizer:
        raise UsageError(
            "--tokenizer is not needed with --resume: RUN_DIR keeps the run's tokenizers",
            code="U028",
        )
    if args.input:
        raise UsageError(
            "--input is not needed with --resume: the inputs are in RUN_DIR's first checkpoint",
            code="U028",
        )
    from lmpm.runtime import session as sessions

    request = ResumeRequest(
        file=program_path(args.file) if args.file is not None else None,
        epochs=args.epochs,
        until=args.until,
        backend=args.backend,
        durable=args.durable,
        trace_region=args.trace_region,
        params=parse_sets(args.set) if args.set else None,
        seed=args.seed,
        trace=args.trace,
        checkpoint_every=args.checkpoint_every,
        workers=args.workers,
        driver=args.driver,
        cluster=args.cluster,
        worker_timeout=args.worker_timeout,
        compile=args.compile,
        keep_records=False,
        bind=tuple(args.bind),
        trust_bind=args.trust_bind,
        ruleset=tuple(args.ruleset or ()),
        argv=tuple(sys.argv[1:]),
        cli=True,
    )
    try:
        session = sessions.resume(run_dir, request=request)
    except CheckError as e:
        print_diagnostics(e.diagnostics, False)
        return 1
    restored = session.restored
    assert restored is not None
    if args.epochs is None and session.epochs is not None and restored.epoch >= session.epochs:
        _at_the_limit(session, run_dir, restored.epoch, args.ruleset or ())
    note = (
        f"resumed at epoch {restored.epoch} (checkpoint {restored.checkpoint} + "
        f"{restored.replayed} commit rows"
        + (f", {restored.skipped} damaged newer checkpoint(s) skipped" if restored.skipped else "")
        + "); "
    )
    return _execute(session, args, quiet=restored.quiet, note=note)


def _at_the_limit(
    session: Run, run_dir: Path, epoch: int, ruleset: Sequence[tuple[str, str]]
) -> None:
    """A resume without --epochs of a run that reached its epoch limit runs no epoch: with a
    RuleSet change that would never take effect, it is refused (nothing changed); otherwise a
    note says so. Both suggest --epochs."""
    more = f"give --epochs N with N > {epoch} to run on"
    if ruleset:
        changes = " ".join(f"--{'enable' if op == 'add' else 'disable'} {n}" for op, n in ruleset)
        session.close()
        raise UsageError(
            f"{run_dir} had reached its limit of {epoch} epochs: {changes} would change the "
            "RuleSet of epochs that do not run; nothing was changed",
            code="U077",
            hint=more,
        )
    sys.stderr.write(f"note: {run_dir} had reached its limit of {epoch} epochs: {more}\n")


def _execute(session: Run, args: argparse.Namespace, *, quiet: int, note: str) -> int:
    """Run ``session``'s epochs with a progress bar, then end it (:meth:`Run.finish`; a failure:
    :meth:`Run.failed`, the API's end of a run too) and print what it did."""
    from rich.console import Console

    console = Console(stderr=True)
    with session:  # a failure is marked in the log (Run.failed), the run closed
        res, epoch_seconds = _epochs(session, console, quiet=quiet, bar_off=args.quiet)
        files = session.finish()
    out_dir = session.run_dir
    state = res.stop.message(detail=False) if res.stop is not None else "stopped"
    faults = getattr(session.dataplane, "faults", [])
    if faults:
        note += f"{len(faults)} worker fault(s) survived (lmpm trace {out_dir}); "
    compiled = session.engine.compiled
    rate = f"{res.attempts / max(res.seconds, 1e-9):,.0f} attempts/s"
    cost = None
    if compiled is not None:
        note += compiled.summary() + "; "
        if session.dataplane.validator is not None:  # LMPM_VALIDATE=eager
            note += session.dataplane.validator.summary() + "; "
        if session.engine.windows is not None:
            note += session.engine.windows.summary() + "; "
        st = compiled.stats
        cost = compile_cost(epoch_seconds, st.compile_seconds, st.compiles, st.cache_hits)
        rate = f"{res.attempts / max(cost.run_seconds, 1e-9):,.0f} attempts/s after compiling"
    sys.stderr.write(
        f"{note}{res.epochs} epochs ({state}), {res.commits} commits, {rate}; wrote "
        f"{len(files)} files to {out_dir} (log: lmpm trace {out_dir})\n"
    )
    if cost is not None and cost.not_worth_it and not args.quiet:
        sys.stderr.write(cost.note() + "\n")
    if res.stop is not None and res.stop.total_unset:
        console.print(_unset_note(res.stop.total_unset, res.stop.unset), highlight=False)
    return 0


def _epochs(
    session: Run, console: Console, *, quiet: int, bar_off: bool
) -> tuple[RunResult, list[float]]:
    """Run the session's epochs under a progress bar (``bar_off``: none); the result and each
    epoch's wall time (compiling shows as outliers). ``quiet``: the trailing epochs without a
    commit a resumed run had (for the stability test)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]epoch {task.completed}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=bar_off or not console.is_terminal,
        transient=False,
    ) as bar:
        task = bar.add_task("run", total=session.epochs, completed=session.engine.epoch, info="")
        epoch_seconds: list[float] = []
        compiled = session.engine.compiled
        if compiled is not None and not bar_off:
            # compiling a step takes seconds (more on a cold cache): say why the epoch waits
            compiled.on_compile = lambda value, n: bar.console.print(
                compiling_note(value, n), highlight=False, markup=False
            )

        def progress(rec: EpochRecord) -> None:
            epoch_seconds.append(rec.seconds)
            rate = rec.attempts / rec.seconds if rec.seconds > 0 else 0.0
            halo = ""
            if rec.control_bytes or rec.halo_bytes:  # several workers: what crossed
                halo = f"  control {rec.control_bytes:,} B  halo {rec.halo_bytes:,} B"
            faults = f"  [yellow]{len(rec.faults)} worker fault(s)[/]" if rec.faults else ""
            bar.update(
                task,
                advance=1,
                info=f"open {rec.open_cells}  commits {rec.commits}  "
                f"violations {rec.violations}  {rate:,.0f} attempts/s{halo}{faults}",
            )

        until = session.until == "stable"
        res = session.run(session.epochs, until_stable=until, progress=progress, quiet=quiet)
    return res, epoch_seconds


MSG_COMPILE_COST = (
    "note: the epochs that compiled took {compile_seconds:.1f} s beyond the steady epoch time "
    "({graph_seconds:.1f} s of it building the step's graphs{cached}; the rest compiling and "
    "warming up the models), more than the {epochs} epochs it served ({run_seconds:.1f} s after "
    "compiling): this run is quicker without --compile. Compiling pays for runs of many epochs or "
    "large values{again} (docs/runtime.md, the compiled epoch step)"
)


class CompileCost(NamedTuple):
    """What compiling cost a ``--compile`` run, from its epochs' wall times."""

    compile_seconds: float  # the epochs' time beyond the steady epoch time: compiling, loading
    run_seconds: float  # the epochs' time without it (``epochs`` × the median epoch)
    epochs: int
    graph_seconds: float = 0.0  # of compile_seconds, building or loading the step's graphs
    graphs: int = 0  # graphs the run compiled or loaded
    cache_hits: int = 0  # of those, loaded from the cache an earlier run filled

    @property
    def not_worth_it(self) -> bool:
        """Compiling took longer than the whole run after it: to pay, the eager epochs would have
        to be more than twice as slow, past what the compiled step saves (benchmarks/compile.py)."""
        return self.compile_seconds > max(self.run_seconds, 1.0)

    def note(self) -> str:
        """The ``note:`` line of a run that compiling did not pay for. Its one time is the
        epochs' excess; the summary's graph time is named as a part of it, and a run that found
        every graph in the cache is not told that a second run would."""
        all_cached = self.graphs > 0 and self.cache_hits == self.graphs
        cached = ", every graph from the cache" if all_cached else ""
        again = "" if all_cached else "; a second run loads the step's graphs from the cache"
        return MSG_COMPILE_COST.format(**self._asdict(), cached=cached, again=again)


def compile_cost(
    epoch_seconds: list[float], graph_seconds: float = 0.0, graphs: int = 0, cache_hits: int = 0
) -> CompileCost:
    """Split a compiled run's epoch times into compiling (the excess over the median epoch, which
    falls on the epochs that compiled a step or a model's shape) and running; ``graph_seconds``,
    ``graphs`` and ``cache_hits`` are the compiled step's own account (CompileStats)."""
    if not epoch_seconds:
        return CompileCost(0.0, 0.0, 0, graph_seconds, graphs, cache_hits)
    steady = statistics.median(epoch_seconds)
    extra = sum(max(s - steady, 0.0) for s in epoch_seconds)
    # the graphs were built inside those epochs: the excess is never less than their own time
    extra = max(extra, min(graph_seconds, sum(epoch_seconds)))
    run = sum(epoch_seconds) - extra
    return CompileCost(extra, run, len(epoch_seconds), graph_seconds, graphs, cache_hits)


def compiling_note(value: str, n: int) -> str:
    """The line `lmpm run --compile` prints before a step compiles (``n``: its open-cell bucket)."""
    cells = "1 open cell" if n == 1 else f"up to {n:,} open cells"
    return f"compiling the epoch step of {value} ({cells})…"


def _unset_note(total: int, unset: dict[str, dict[str, int]]) -> str:
    """The warning printed (and shown by `lmpm trace`) when a run ends with unset cells."""
    lines = [f"[bold yellow]warning[/]: {total} cell{'s' if total != 1 else ''} left unset:"]
    for name, reasons in unset.items():
        for why, count in reasons.items():
            lines.append(f"  {name}: {count} {why}")
    return "\n".join(lines)
