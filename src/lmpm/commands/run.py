"""`lmpm run FILE`: run a program epoch by epoch and write its committed values.

Every epoch is appended to RUN_DIR/lmpm.db (the commit log and constraint trace, see
docs/trace.md); `lmpm run --resume RUN_DIR` continues a killed run from its last complete epoch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmpm.commands._common import add_set, parse_sets, print_diagnostics, program_path
from lmpm.commands.check import unknown_params
from lmpm.errors import RunDirError, UsageError

if TYPE_CHECKING:
    from lmpm.runtime.session import Run

DEFAULT_CHECKPOINT_EVERY = 20  # mirrors lmpm.runtime.commitlog (not imported: keeps --help light)

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
        help="initial committed cells of a value (.npy, .pt, .json, or text)",
    )
    p.add_argument("--seed", type=int, help="RNG seed (default 0)")
    p.add_argument("--epochs", type=int, help="run this many epochs")
    p.add_argument("--until", choices=["stable"], help="stop at the first epoch with no commit")
    p.add_argument("--backend", help="worker backend (cpu, cuda; default cpu)")
    p.add_argument("--out", metavar="RUN_DIR", help="write outputs here (default runs/<program>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last complete epoch (settings come from RUN_DIR)",
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
        "--checkpoint-every",
        type=int,
        metavar="K",
        help=f"payload checkpoint every K epochs (default {DEFAULT_CHECKPOINT_EVERY})",
    )


def _inputs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--input expects NAME=PATH, got {item!r}", code="U021")
        out[name.strip()] = path.strip()
    return out


def _bind_specs(items: list[str]) -> tuple[str, ...]:
    from lmpm.runtime.session import bind_specs

    return bind_specs(items)


def _close(session: Run) -> list[Path]:
    if session.log is not None:
        session.log.close()
    return []


def _checkpoint_every(value: int | None) -> int:
    if value is not None and value < 1:
        raise UsageError("--checkpoint-every must be at least 1", code="U024")
    return value or DEFAULT_CHECKPOINT_EVERY


def run(args: argparse.Namespace) -> int:
    if args.epochs is not None and args.epochs < 1:
        raise UsageError("--epochs must be at least 1", code="U022")
    if args.resume:
        return _resume(args)
    if args.file is None:
        raise UsageError("give the .lmpm program to run, or --resume RUN_DIR", code="U023")

    from lmpm.ir import compile_file
    from lmpm.runtime.commitlog import holds_run, refuse_existing
    from lmpm.runtime.session import Run

    path = program_path(args.file)
    params = parse_sets(args.set)
    level = args.trace or "summary"
    if args.trace_region and level != "cells":
        raise UsageError("--trace-region needs --trace cells", code="U025")
    every = _checkpoint_every(args.checkpoint_every)
    out_dir = Path(args.out) if args.out else Path("runs") / path.stem
    if holds_run(out_dir) and not args.force:
        refuse_existing(out_dir)
    front = compile_file(path, overrides=params, raise_errors=False)
    unknown_params(front)  # an unknown --set name is a usage error (exit 2), listing the params
    print_diagnostics([d for d in front.diagnostics if d.severity == "error"], False)
    if front.errors:
        return 1
    inputs = _inputs(args.input)
    # Run() makes the strict checks against the names this run binds (CheckError, located)
    # before anything is written and before epoch 0.
    session = Run(
        front,
        params=params,
        bind=args.bind,
        inputs=inputs,
        seed=args.seed if args.seed is not None else 0,
        backend=args.backend or "cpu",
        epochs=args.epochs,
        keep_records=False,
    )
    session.log_to(
        out_dir,
        source=path.read_text(encoding="utf-8"),
        program_file=str(path),
        trace=level,
        trace_region=args.trace_region,
        checkpoint_every=every,
        until=args.until,
        force=args.force,
        argv=sys.argv[1:],
    )
    return _execute(session, args, out_dir, args.epochs, args.until, quiet=0, note="")


def _resume(args: argparse.Namespace) -> int:
    from lmpm.runtime.commitlog import file_sha256
    from lmpm.runtime.session import resume
    from lmpm.runtime.trace import parse_region

    run_dir = Path(args.resume)
    if args.force:
        raise UsageError("--resume continues a run and --force deletes it; give one", code="U026")
    if args.out and Path(args.out).resolve() != run_dir.resolve():
        raise UsageError(f"--out {args.out} differs from --resume {args.resume}", code="U027")
    if args.input:
        raise UsageError(
            "--input is not needed with --resume: the inputs are in RUN_DIR's first checkpoint",
            code="U028",
        )

    def check_meta(meta: dict[str, Any]) -> None:
        asked: dict[str, tuple[str, Any]] = {
            "params": ("--set", parse_sets(args.set) if args.set else None),
            "seed": ("--seed", args.seed),
            "bind": ("--bind", list(_bind_specs(args.bind)) if args.bind else None),
            "trace": ("--trace", args.trace),
            "checkpoint_every": ("--checkpoint-every", args.checkpoint_every),
        }
        for key, (flag, value) in asked.items():
            stored = meta.get(key)
            if value is not None and value != stored:
                raise RunDirError(
                    f"{run_dir} was started with {flag} {stored!r}; this command gives "
                    f"{value!r}. A resumed run keeps its settings; nothing was changed.",
                    code="D011",
                    hint=f"drop {flag}, or start a new run with another --out",
                )
        if args.trace_region:
            from lmpm.ir import compile_source
            from lmpm.ir.eval import bind_params, evaluate

            ir = compile_source(meta["source"], meta["program_file"]).ir
            env = bind_params(ir, meta["params"])
            dims = {v.name: [evaluate(d, env) for d in v.dims] for v in ir.values if v.dims}
            mine = parse_region(args.trace_region, dims)
            if str(mine) != meta.get("trace_region"):
                raise RunDirError(
                    f"{run_dir} was started with --trace-region {meta.get('trace_region')!r}; "
                    f"this command gives {str(mine)!r}; nothing was changed",
                    code="D011",
                )
        for spec, sha in dict(meta.get("bind_sha256", {})).items():
            if Path(spec).is_file() and file_sha256(spec) != sha:
                sys.stderr.write(
                    f"note: {spec} changed since this run started; results may differ\n"
                )

    session = resume(
        run_dir,
        file=program_path(args.file) if args.file is not None else None,
        epochs=args.epochs,
        until=args.until,
        backend=args.backend,
        argv=sys.argv[1:],
        check_meta=check_meta,
    )
    restored = session.restored
    assert restored is not None
    note = (
        f"resumed at epoch {restored.epoch} (checkpoint {restored.checkpoint} + "
        f"{restored.replayed} commit rows); "
    )
    return _execute(
        session, args, run_dir, session.epochs, session.until, quiet=restored.quiet, note=note
    )


def _execute(
    session: Run,
    args: argparse.Namespace,
    out_dir: Path,
    epochs: int | None,
    until: str | None,
    *,
    quiet: int,
    note: str,
) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    try:
        with Progress(
            TextColumn("[bold]epoch {task.completed}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            disable=args.quiet or not console.is_terminal,
            transient=False,
        ) as bar:
            task = bar.add_task("run", total=epochs, completed=session.engine.epoch, info="")

            def progress(rec: object) -> None:
                from lmpm.runtime.engine import EpochRecord

                assert isinstance(rec, EpochRecord)
                rate = rec.attempts / rec.seconds if rec.seconds > 0 else 0.0
                bar.update(
                    task,
                    advance=1,
                    info=f"open {rec.open_cells}  commits {rec.commits}  "
                    f"violations {rec.violations}  {rate:,.0f} attempts/s",
                )

            res = session.run(
                epochs, until_stable=until == "stable", progress=progress, quiet=quiet
            )
    except BaseException:
        _close(session)  # the log stays resumable; no outputs are written
        raise
    files = session.finish()
    state = "stable" if res.stable else "stopped"
    sys.stderr.write(
        f"{note}{res.epochs} epochs ({state}), {res.commits} commits, "
        f"{res.attempts / max(res.seconds, 1e-9):,.0f} attempts/s; wrote "
        f"{len(files)} files to {out_dir} (log: lmpm trace {out_dir})\n"
    )
    return 0
