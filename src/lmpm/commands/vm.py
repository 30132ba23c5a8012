"""`lmpm vm`: run a program's workflow on the token-stream VM, and show its streams.

lmpm vm run examples/vm.lmpm --bind examples/vm/tools.py --out runs/vm
lmpm vm status runs/vm                 # every stream: status, zone path, captures
lmpm vm status runs/vm --stream 0      # one stream token by token: zone, token_num, triggers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lmpm.commands.common import add_set, parse_sets, print_diagnostics, program_path
from lmpm.errors import BackendUnavailable, UsageError

HELP = "run a workflow on the token-stream VM (run), or show a run's streams (status)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    r = sub.add_parser("run", help="run the program's workflow over all its streams")
    r.add_argument("file", help="the .lmpm program")
    add_set(r)
    r.add_argument("--workflow", help="which workflow (default: the first)")
    r.add_argument("--bind", action="append", default=[], metavar="MODULE", help="tools, models")
    r.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a per-stream input: one line per stream (a single line: every stream)",
    )
    r.add_argument("--seed", type=int, default=0, help="the counter-based RNG's seed")
    r.add_argument("--out", metavar="RUN_DIR", help="write the commit log and VM status here")
    r.add_argument("--force", action="store_true", help="replace a run already in --out")
    r.add_argument(
        "--compile",
        action="store_true",
        help="run the VM step as one compiled graph (commits the same; compiles first)",
    )
    r.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the streams, the VM step and the model run (cuda + --compile: one CUDA graph)",
    )
    r.add_argument("--show", type=int, default=4, metavar="K", help="print the first K streams")
    r.add_argument("--json", action="store_true", help="streams and stats as JSON on stdout")
    s = sub.add_parser("status", help="per-stream status of a finished `lmpm vm run`")
    s.add_argument("run_dir", metavar="RUN_DIR")
    s.add_argument("--stream", type=int, help="one stream, token by token")
    s.add_argument("--json", action="store_true", help="as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    if args.action == "run":
        return _run(args)
    if args.action == "status":
        from lmpm.runtime.received import interpreting
        from lmpm.runtime.rundir import db_path

        with interpreting(db_path(args.run_dir)):  # the report and its lines read the log's values
            return _status(args)
    raise UsageError("lmpm vm needs an action: run or status", code="U000")


def _inputs(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            raise UsageError(f"--input expects NAME=FILE, got {item!r}", code="U002")
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"--input {name}: no such file: {path}", code="U003")
        out[name] = p.read_text(encoding="utf-8").splitlines()
    return out


def _run(args: argparse.Namespace) -> int:
    from lmpm.bindings import Bindings
    from lmpm.ir import compile_file
    from lmpm.runtime.lock import RunLock
    from lmpm.runtime.rundir import remove_run
    from lmpm.vm import WorkflowRun

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailable(
                f"--device cuda: this machine has no CUDA device (torch {torch.__version__})",
                code="E000",
                hint="run with --device cpu, or on a machine with an NVIDIA GPU and a CUDA build "
                "of torch (lmpm check FILE --device cuda tells whether the workflow is ready)",
            )
    path = program_path(args.file)
    overrides = parse_sets(args.set)
    bindings = Bindings(args.bind)  # its names are bound: no W210 for a tool it binds
    front = compile_file(
        path, overrides=overrides, raise_errors=False, bound_names=bindings.user_names()
    )
    print_diagnostics(front.diagnostics, False)
    if front.errors:
        return 1
    if args.out and args.force:  # an LMPM run only (D034 for a folder of other files)
        with RunLock(args.out, what="delete (--force)"):
            remove_run(args.out)
    run = WorkflowRun(
        front.ir,
        workflow=args.workflow,
        overrides=overrides,
        inputs=_inputs(args.input),
        bindings=bindings,
        seed=args.seed,
        run_dir=args.out,
        source=path.read_text(encoding="utf-8"),
        compile=args.compile,
        device=args.device,
    )
    if args.compile and not args.json:
        sys.stderr.write(f"compiling the VM step ({run.vm.core.B} streams)...\n")
    vm = run.run()
    st = run.stats
    streams = _streams(vm)
    if args.json:
        sys.stdout.write(json.dumps({"stats": st.to_dict(), "streams": streams}) + "\n")
        return 0
    total = st.committed
    sys.stdout.write(
        f"workflow {run.ins.workflow.name}: {vm.core.B} streams, {st.steps} steps, "
        f"{total} tokens committed, {st.forced} forced without the model "
        f"({100 * st.forced / max(total, 1):.0f}%), {st.model_calls} model calls "
        f"({st.steps_all_forced} steps needed none); VM {st.vm_seconds:.3f}s, "
        f"model {st.model_seconds:.3f}s\n"
    )
    if vm.compiled is not None:
        c = vm.compiled
        sys.stdout.write(
            f"compiled: {c.compiles} graph{'s' if c.compiles != 1 else ''} "
            f"in {c.compile_seconds:.1f}s, {c.steps} compiled steps\n"
        )
    for s in streams[: args.show]:
        sys.stdout.write(_stream_line(s))
    if args.out:
        sys.stdout.write(f"log: {args.out}/lmpm.db   (lmpm vm status {args.out} --stream 0)\n")
    return 0


def _streams(vm: Any) -> list[dict[str, Any]]:
    text, caps, dec, status = (
        vm.generative_sequence(),
        vm.extract(),
        vm.decisions(),
        vm.stream_status(),
    )
    return [
        {
            "stream": b,
            "status": status[b],
            "decisions": dec[b],
            "captures": caps[b],
            "text": text[b],
        }
        for b in range(len(text))
    ]


def _stream_line(s: dict[str, Any]) -> str:
    return (
        f"[{s['stream']}] {s['status']}: {s['text']!r}\n"
        f"    path: {' -> '.join(s['decisions'])}\n"
        f"    captures: {json.dumps(s['captures'], ensure_ascii=False)}\n"
    )


def _status(args: argparse.Namespace) -> int:
    from lmpm.printable import printable_tree
    from lmpm.runtime.received import interpreting
    from lmpm.runtime.rundir import connect, db_path
    from lmpm.vm.log import stream_report

    conn = connect(args.run_dir, readonly=True)
    try:
        has_vm = conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'vm_streams'"
        ).fetchone()[0]
        if not has_vm:
            raise UsageError(f"{args.run_dir} is not a workflow run (`lmpm vm run`)", code="U003")
        with interpreting(db_path(args.run_dir)):
            rep = printable_tree(stream_report(conn, args.stream))  # the log's strings: no escapes
    finally:
        conn.close()
    if args.json:
        sys.stdout.write(json.dumps(rep, indent=1) + "\n")
        return 0
    if args.stream is not None:
        if not any(s["stream"] == args.stream for s in rep["streams"]):
            raise UsageError(f"no stream {args.stream} in {args.run_dir}", code="U003")
        sys.stdout.write(_stream_line(rep["streams"][args.stream]))
        sys.stdout.write("  pos  char  kind       zone        num  triggers\n")
        for t in rep["tokens"]:
            sys.stdout.write(
                f"  {t['pos']:>3}  {t['char']!r:<5} {t['kind']:<10} {t['zone']:<11} "
                f"{t['token_num']:>3}  {t['triggers']:#x}\n"
            )
        return 0
    counts: dict[str, int] = {}
    for s in rep["streams"]:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    sys.stdout.write(
        f"workflow {rep['workflow']}: {len(rep['streams'])} streams "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + "\n"
    )
    for s in rep["streams"]:
        sys.stdout.write(
            f"[{s['stream']}] {s['status']:<9} {' -> '.join(s['decisions'])}  "
            f"{json.dumps(s['captures'], ensure_ascii=False)}\n"
        )
    return 0
