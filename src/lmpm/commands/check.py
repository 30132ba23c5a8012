"""`lmpm check FILE`: parse and check a program; print diagnostics."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from lmpm.commands._common import add_set, fail_json, parse_sets, print_diagnostics, program_path
from lmpm.errors import LmpmError, UsageError

if TYPE_CHECKING:
    from lmpm.ir import Frontend

HELP = "check a program: syntax, names, shapes, bounds, visibility of reads, read_future"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .lmpm program")
    add_set(p)
    p.add_argument("--json", action="store_true", help="diagnostics as JSON lines on stdout")
    p.add_argument(
        "--strict",
        action="store_true",
        help="call names not bound (built-ins or --bind) are errors",
    )
    p.add_argument(
        "--bind",
        action="append",
        default=[],
        metavar="MODULE",
        help="a Python module or file whose bindings count as bound (no W210 warning, and "
        "no E207 error with --strict)",
    )
    p.add_argument("--emit-ir", choices=["json", "text"], help="print the checked IR on stdout")


def run(args: argparse.Namespace) -> int:
    from lmpm.ir import compile_file

    path = program_path(args.file)
    overrides = parse_sets(args.set)
    known = None
    bound: set[str] = set()
    if args.strict or args.bind:  # (loading a module may import torch; a plain check does not)
        from lmpm.bindings import BUILTINS, user_names

        bound = user_names(args.bind)
        if args.strict:
            known = set(BUILTINS) | bound
    try:
        front = compile_file(
            path,
            overrides=overrides,
            strict=args.strict,
            known_names=known,
            raise_errors=False,
            bound_names=bound,
        )
    except LmpmError as e:
        if args.json:
            return fail_json(e)
        raise
    unknown_params(front)
    print_diagnostics(front.diagnostics, args.json)
    if front.errors:
        return 1
    if args.emit_ir == "json":
        from lmpm.ir.serialize import to_json

        sys.stdout.write(to_json(front.ir, indent=1) + "\n")
    elif args.emit_ir == "text":
        from lmpm.ir.printer import print_ir

        sys.stdout.write(print_ir(front.ir))
    elif not args.json:
        n = len(front.warnings)
        sys.stderr.write(
            f"{path}: ok" + (f" ({n} warning{'s' if n != 1 else ''})" if n else "") + "\n"
        )
    return 0


def unknown_params(front: Frontend) -> None:
    """`--set NAME=...` for a name the program does not have is a usage error (exit 2), not a
    diagnostic about the program: the message lists the parameters there are."""
    for d in front.diagnostics:
        if d.code == "B001":
            raise UsageError(
                d.message,
                hint="parameters are declared with `param NAME` or used as dims",
                code="U005",
            )
