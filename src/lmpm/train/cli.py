"""`lmpm run` of a training program (one with a ``Params`` value): inputs, the run directory, the
progress line, fault injection, the closing line.

    lmpm run examples/train_bytelm.lmpm --input Corpus=examples/train/corpus.npy \\
        --input Held=examples/train/held.npy --epochs 20 --workers 4 --out runs/train
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from lmpm.errors import RunDirError, UsageError
from lmpm.train import log as tlog
from lmpm.train.spec import TrainSpec
from lmpm.train.units import UNIT, fmt

# `lmpm run` options that mean something only for cell programs
CELL_ONLY = {
    "until": "--until",
    "trace": "--trace",
    "trace_region": "--trace-region",
    "checkpoint_every": "--checkpoint-every",
    "backend": "--backend",
}


def refuse_cell_options(args: argparse.Namespace) -> None:
    for attr, flag in CELL_ONLY.items():
        if getattr(args, attr, None) is not None:
            raise UsageError(
                f"{flag} applies to cell programs; this is a training program (a Params value)",
                code="U092",
                hint="a training run checkpoints every epoch and logs to RUN_DIR/train.db "
                "(lmpm top RUN_DIR)",
            )
    if getattr(args, "bind", None):
        raise UsageError(
            "--bind does not reach training programs yet: their modules and losses are the "
            "built-in ones (lmpm.train.modules)",
            code="U092",
        )
    if getattr(args, "compile", False):
        raise UsageError(
            "--compile compiles the epoch step of cell programs; this is a training program "
            "(its inner loop is autograd on the worker)",
            code="U092",
            hint="drop --compile",
        )
    if getattr(args, "driver", None) == "process":
        raise UsageError(
            "--driver process: a training run runs on `single` (workers in this process) or "
            "`ray` (a process per worker)",
            code="U092",
        )


def load_data(spec: TrainSpec, inputs: dict[str, str]) -> tuple[dict[str, Any], Any]:
    """The data values' rows and the initial parameters (``--input P=FILE.safetensors``)."""
    from lmpm.train.run import load_init, load_rows

    needed = {d.name: d for d in (*spec.rule.data, *spec.rule.eval_data)}
    known = {*needed, spec.params.name}
    for name in inputs:
        if name not in known:
            raise UsageError(
                f"--input {name}: the program has no data value `{name}`",
                code="U093",
                hint=f"its inputs are {', '.join(sorted(known))}",
            )
    missing = [n for n in needed if n not in inputs]
    if missing:
        raise UsageError(
            f"a training run needs every data value: give --input "
            f"{' '.join(f'{n}=FILE' for n in missing)}",
            code="U093",
        )
    data = {n: load_rows(inputs[n], d) for n, d in needed.items()}
    init = None
    if spec.params.name in inputs:
        init = load_init(inputs[spec.params.name])
        check_init(spec, init, inputs[spec.params.name])
    return data, init


def check_init(spec: TrainSpec, init: dict[str, Any], file: str) -> None:
    """The initial parameters must be the module's: every parameter, each of its shape (InputError
    R004 naming what differs; buffers and extra keys are refused too)."""
    from lmpm.errors import InputError
    from lmpm.ir.link import link_training

    want = {k: tuple(v.shape) for k, v in link_training(spec).module().state_dict().items()}
    got = {k: tuple(v.shape) for k, v in init.items()}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    shapes = [
        f"{k} {list(got[k])} (not {list(want[k])})" for k in want if k in got and got[k] != want[k]
    ]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}")
        if extra:
            parts.append(
                f"not in {spec.params.module}: {', '.join(extra[:4])}"
                f"{' …' if len(extra) > 4 else ''}"
            )
        if shapes:
            parts.append(f"shapes differ: {'; '.join(shapes[:3])}")
        raise InputError(
            f"{file} does not hold the parameters of {spec.params.module}: {'; '.join(parts)}",
            where={"value": spec.params.name, "file": file},
            code="R004",
            hint=f"give weights saved from {spec.params.module} (its state_dict), or an LMPM "
            "training output or checkpoint",
        )


def run_training(
    args: argparse.Namespace, spec: TrainSpec, source: str, params: dict[str, int], out_dir: Path
) -> int:
    from lmpm.commands.common import parse_inputs
    from lmpm.runtime.lock import RunLock

    refuse_cell_options(args)
    if args.epochs is None:
        raise UsageError(
            "a training run needs --epochs N (outer steps; each runs the rule's `steps` inner "
            "steps on every worker)",
            code="U091",
        )
    if args.seed is not None:
        spec = dataclasses.replace(spec, rule=dataclasses.replace(spec.rule, seed=args.seed))
    workers = 1 if args.workers is None else args.workers
    if workers < 1:
        raise UsageError(f"--workers {workers}: must be at least 1", code="U080")
    inputs = parse_inputs(args.input)
    data, init = load_data(spec, inputs)
    with RunLock(out_dir, what="delete (--force)" if args.force else "write"):
        if tlog.holds_training(out_dir) or (out_dir / "lmpm.db").exists():
            if not args.force:
                raise RunDirError(
                    f"{out_dir} already holds a run",
                    code="D003",
                    hint="use another --out, or --force to start over (deletes it)",
                )
            _remove_runs(out_dir)
        meta = {
            "source": source,
            "params": params,
            "argv": sys.argv[1:],
            "inputs": {k: str(Path(v).resolve()) for k, v in inputs.items()},
            # checked on resume, which reads the inputs again: a log from elsewhere cannot make
            # the run read (and train on) another file of this machine
            "inputs_sha256": {k: _sha256(Path(v)) for k, v in inputs.items()},
            "seed": spec.rule.seed,
        }
        job = _Job(spec, data, init, out_dir, workers, args.epochs, meta, resume=False)
        return _train(args, job)


def resume_training(args: argparse.Namespace, run_dir: Path) -> int:
    """`lmpm run --resume RUN_DIR [--epochs N]` of a training run: from the last logged epoch's
    checkpoint (θ, the outer momentum, every worker's inner optimizer and schedule step) on; the
    rest of the run is what an uninterrupted one would have computed."""
    from lmpm.ir import compile_source
    from lmpm.runtime.lock import RunLock
    from lmpm.train.frontend import train_spec

    refuse_cell_options(args)
    for flag, given in (("--input", args.input), ("--set", args.set), ("--seed", args.seed)):
        if given:
            raise UsageError(
                f"{flag} with --resume: a resumed training run keeps its recorded settings",
                code="U094",
            )
    with RunLock(run_dir, what="resume", create_dir=False):
        h = tlog.read(run_dir)
        meta = h.meta
        workers = _meta(meta, "workers", int, run_dir)
        if args.workers is not None and args.workers != workers:
            raise UsageError(
                f"--workers {args.workers}: {run_dir} was trained on {workers} workers (each "
                "worker's data shard and inner optimizer belong to the run)",
                code="D011",
            )
        done = h.epochs[-1]["epoch"] if h.epochs else 0
        epochs = args.epochs if args.epochs is not None else _meta(meta, "epochs", int, run_dir)
        if epochs <= done:
            sys.stderr.write(f"{run_dir} has trained {done} of {epochs} epochs: nothing to do\n")
            return 0
        params = _meta(meta, "params", dict, run_dir)
        if not all(isinstance(k, str) and type(v) is int for k, v in params.items()):
            raise RunDirError(f"{run_dir}: the training log's `params` are damaged", code="D006")
        front = compile_source(
            _meta(meta, "source", str, run_dir),
            file=_meta(meta, "program", str, run_dir),
            overrides=params,
        )
        spec = train_spec(front.ir, params)
        assert spec is not None
        seed = _meta(meta, "seed", int, run_dir) if "seed" in meta else spec.rule.seed
        spec = dataclasses.replace(spec, rule=dataclasses.replace(spec.rule, seed=seed))
        data, init = load_data(spec, _recorded_inputs(meta, run_dir))
        if args.driver is None:
            args.driver = meta.get("driver")
        extra = {"argv": sys.argv[1:]}
        return _train(args, _Job(spec, data, init, run_dir, workers, epochs, extra, resume=True))


def _remove_runs(out_dir: Path) -> None:
    """``--force``: delete the run LMPM wrote in ``out_dir`` (a training run's log and checkpoint
    files, or a cell run's), the files LMPM names only: a user's other files stay."""
    from lmpm.runtime.rundir import remove_run
    from lmpm.runtime.runfiles import SQLITE_SUFFIXES, remove_files
    from lmpm.train.run import CHECKPOINT_NAME, CHECKPOINTS

    remove_run(out_dir)
    remove_files(out_dir, "", [f"{tlog.DB_NAME}{s}" for s in SQLITE_SUFFIXES])
    remove_files(out_dir, CHECKPOINTS, CHECKPOINT_NAME, drop_empty=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _recorded_inputs(meta: dict[str, Any], run_dir: Path) -> dict[str, str]:
    """The input files a training run started from, as its log names them, each checked against
    the sha256 recorded then (D036 when it differs: a log from elsewhere never makes a resume
    read another file; logs written before the sha256s were recorded are taken as they are)."""
    inputs = _meta(meta, "inputs", dict, run_dir) if "inputs" in meta else {}
    shas = meta.get("inputs_sha256")
    for name, path in inputs.items():
        if not isinstance(path, str):
            raise RunDirError(
                f"{run_dir}: the training log's input `{name}` is damaged", code="D006"
            )
        if not isinstance(shas, dict):
            continue
        p = Path(path)
        if not p.is_file() or shas.get(name) != _sha256(p):
            raise RunDirError(
                f"{run_dir}: the input `{name}` ({path}) is not the file the run started from "
                "(missing, or its sha256 differs from the one the log recorded); nothing was read "
                "into the run",
                code="D036",
                hint="restore the input file, or start a new run with --input",
            )
    return dict(inputs)


def _meta(meta: dict[str, Any], key: str, kind: type, run_dir: Path) -> Any:
    """``meta[key]`` of a training log, checked to be a ``kind`` (D006: a damaged or edited log)."""
    value = meta.get(key)
    if type(value) is not kind:
        want = {int: "an integer", str: "a string", dict: "an object"}.get(kind, kind.__name__)
        raise RunDirError(
            f"{run_dir}: the training log's `{key}` is {value!r:.80}, not {want}; nothing was "
            "changed",
            code="D006",
            hint="restore train.db from a copy",
        )
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    """A training run the CLI starts or resumes, as :class:`~lmpm.train.run.Trainer` takes it."""

    spec: TrainSpec
    data: dict[str, Any]  # each data value's (rows, length) tokens
    init: Any  # a state dict to start from (None: the module's seeded initialisation)
    run_dir: Path
    workers: int
    epochs: int
    meta: dict[str, Any]  # what the log records besides the trainer's own fields
    resume: bool  # continue the log in ``run_dir`` from its last checkpoint


def _train(args: argparse.Namespace, job: _Job) -> int:
    """Run the trainer under a progress bar; the closing line."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lmpm.train.driver import parse_fault
    from lmpm.train.run import EpochReport, Trainer

    fault = os.environ.get("LMPM_INJECT_FAULT")
    planned = parse_fault(fault, job.workers) if fault else None
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]epoch {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=args.quiet or not console.is_terminal,
    ) as bar:
        task = bar.add_task("train", total=job.epochs, info="starting workers")

        def progress(r: EpochReport) -> None:
            ev = "" if r.eval_loss is None else f"  held-out {_bits(r.eval_loss)}"
            rate = r.tokens / r.seconds if r.seconds > 0 else 0.0
            fl = f"  [yellow]{len(r.faults)} worker fault(s)[/]" if r.faults else ""
            bar.update(
                task,
                completed=r.epoch,
                info=f"loss {_bits(r.loss)}{ev}  {rate:,.0f} tokens/s  "
                f"{_human(r.bytes)} exchanged{fl}",
            )

        trainer = Trainer(
            job.spec,
            job.data,
            epochs=job.epochs,
            workers=job.workers,
            driver=args.driver,
            run_dir=job.run_dir,
            init=job.init,
            cluster=args.cluster,
            worker_timeout=args.worker_timeout,
            meta=job.meta,
            progress=progress,
            resume=job.resume,
        )
        bar.update(task, completed=trainer.first - 1)
        if planned is not None:
            w, phase, epoch, how = planned
            trainer.driver.inject(w, phase, epoch, how)
        res = trainer.run()
    ev = "" if res.eval_loss is None else f", held-out {_bits(res.eval_loss)}"
    fl = f"; {len(res.faults)} worker fault(s) survived" if res.faults else ""
    what = f"resumed at epoch {trainer.first}, " if job.resume else ""
    sys.stderr.write(
        f"{what}trained {len(res.epochs)} epochs × {job.spec.rule.steps} steps on {job.workers} "
        f"worker(s): loss {_bits(res.loss)}{ev}; {res.tokens:,} tokens, {_human(res.bytes)} "
        f"exchanged, {res.seconds:.1f} s{fl}; wrote {res.output} (watch: lmpm top {job.run_dir})\n"
    )
    return 0


def _bits(nats: float) -> str:
    return f"{fmt(nats)} {UNIT}"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
