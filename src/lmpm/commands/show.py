"""`lmpm show FILE`: the program as a graph (text, DOT, SVG, Mermaid) or its IR; with --compiled,
what `lmpm run --compile` makes of each proposed value (lmpm.commands._compiled_view)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from typing import Any

from lmpm.commands.check import unknown_params
from lmpm.commands.common import add_set, parse_sets, print_diagnostics, program_path
from lmpm.errors import LmpmError, UsageError

HELP = "show a program as a graph: values, visibility, rules, constraints, commits"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .lmpm program")
    add_set(p)
    p.add_argument(
        "--format",
        choices=["text", "dot", "svg", "mermaid", "ir"],
        default="text",
        help="text outline (default), Graphviz dot, svg (Graphviz when installed, else a built-in layout), mermaid, or IR text",
    )
    p.add_argument("--plan", action="store_true", help="show the resolved execution plan")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="with --plan: partition the values over N workers and print the routes",
    )
    p.add_argument(
        "--bind",
        action="append",
        default=[],
        metavar="MODULE",
        help="bindings module: its names count as bound (and --plan --workers, --compiled "
        "resolve with it)",
    )
    p.add_argument("--vm", action="store_true", help="show workflows as VM instruction tensors")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="what `lmpm run --compile` does with each proposed value: compiled or eager and "
        "why, what its graph bakes in, and the traced graph's ops (nothing is compiled)",
    )
    p.add_argument(
        "--graph",
        "-v",
        action="store_true",
        help="with --compiled: also print each traced graph's code",
    )
    p.add_argument("-o", "--output", help="write to this file instead of stdout")


def _topology(front: Any, overrides: dict[str, int], workers: int, bind: list[str]) -> str:
    """The partition over ``workers`` workers, the halo sizes and the routes (needs the plan's
    gather tables, so the program is resolved with its bindings)."""
    from lmpm.bindings import Bindings
    from lmpm.resolve.plan import resolve
    from lmpm.resolve.topology import partition, topology_text

    if workers < 1:
        raise LmpmError(f"--workers must be at least 1, not {workers}", code="U080")
    plan = resolve(front.ir, overrides, Bindings(tuple(bind), {}))
    return topology_text(plan, partition(plan, workers))


def _check_compiled(args: argparse.Namespace) -> None:
    """--compiled prints a text report of its own: the other views do not combine with it."""
    if args.graph and not args.compiled:
        raise UsageError(
            "--graph prints the traced graphs of --compiled",
            code="U110",
            hint="lmpm show FILE --compiled --graph",
        )
    if not args.compiled:
        return
    for given, flag in (
        (args.format != "text", f"--format {args.format}"),
        (args.plan, "--plan"),
        (args.workers is not None, "--workers"),
        (args.vm, "--vm"),
    ):
        if given:
            raise UsageError(
                f"--compiled prints a text report; it does not combine with {flag}",
                code="U110",
                hint="drop " + flag.split()[0],
            )


def run(args: argparse.Namespace) -> int:
    from lmpm.ir import compile_file
    from lmpm.ir import graph as g

    _check_compiled(args)
    path = program_path(args.file)
    overrides = parse_sets(args.set)
    bound: set[str] = set()
    if args.bind:  # its names are bound: no W210 for them (as with `lmpm check --bind`)
        from lmpm.bindings import user_names

        bound = user_names(args.bind)
    front = compile_file(path, overrides=overrides, raise_errors=False, bound_names=bound)
    unknown_params(front)
    print_diagnostics(front.diagnostics, False)
    if front.errors:
        return 1
    if args.compiled:
        from lmpm.commands._compiled_view import compiled_text

        out = compiled_text(front, overrides, args.bind, graph=args.graph)
    elif args.vm:
        from lmpm.vm import compile_workflow, instructions_text

        if not front.ir.workflows:
            raise LmpmError(f"{path} has no workflow", code="U011", hint="add `workflow`")
        out = "\n".join(
            instructions_text(compile_workflow(front.ir, w.name, overrides))
            for w in front.ir.workflows
        )
    elif args.plan:
        from lmpm.resolve.plan import plan_text

        out = plan_text(front.ir, overrides)
        if args.workers is not None:
            out += _topology(front, overrides, args.workers, args.bind)
    elif args.format == "ir":
        from lmpm.ir.printer import print_ir

        out = print_ir(front.ir)
    elif args.format == "dot":
        out = g.to_dot(front.ir)
    elif args.format == "mermaid":
        out = g.to_mermaid(front.ir)
    elif args.format == "svg":
        dot = g.to_dot(front.ir)
        exe = shutil.which("dot")
        if exe is None:  # no Graphviz: LMPM's own layout (install graphviz for dot's)
            out = g.to_svg(front.ir)
        else:
            res = subprocess.run(
                [exe, "-Tsvg"], input=dot, capture_output=True, text=True, check=False
            )
            if res.returncode != 0:
                raise LmpmError(f"graphviz failed: {res.stderr.strip()}", code="U010")
            out = res.stdout
    else:
        from lmpm.resolve.masks import lowering_of

        out = g.to_text(front.ir)
        lines = [line for low in lowering_of(front.ir).values() for line in low.lines()]
        if lines:  # constraints before choosing (docs/runtime.md, "Candidates and constraints")
            out += "masks:\n" + "".join(f"  {line}\n" for line in lines)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(out)
    else:
        sys.stdout.write(out)
    return 0
