"""`lmpm check FILE`: parse and check a program; print diagnostics."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lmpm.commands.common import (
    add_set,
    add_tokenizer,
    fail_json,
    memory_size,
    parse_sets,
    parse_tokenizers,
    print_diagnostics,
    program_path,
)
from lmpm.errors import BindError, Diagnostic, LmpmError, UsageError

if TYPE_CHECKING:
    from lmpm.bindings import Bindings
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
    p.add_argument(
        "--device",
        choices=["cuda"],
        help="also run the program a few epochs on this device (simulated on a machine without "
        "one) and report what would fail or wait for it there: errors name the program's call "
        'and your module\'s line (docs/runtime.md, "Devices")',
    )
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="with --device: initial committed cells of a value, as `lmpm run` takes them",
    )
    p.add_argument("--epochs", type=int, default=3, help="with --device: epochs to run (default 3)")
    add_tokenizer(p)
    p.add_argument(
        "--max-memory",
        type=memory_size,
        metavar="BYTES",
        help="the memory the bytes `lmpm run` would allocate for the values and gather tables "
        "may take (e.g. 8G; default: this machine's memory), as `lmpm run --max-memory`; past "
        "it, U043 or U049 with the number",
    )


def run(args: argparse.Namespace) -> int:
    from lmpm.ir import compile_file

    path = program_path(args.file)
    overrides = parse_sets(args.set)
    tokenizers = parse_tokenizers(args.tokenizer)
    if tokenizers:  # their sizes bind the vocabularies' parameters (lmpm.runtime.vocab)
        try:
            overrides = _sized(path, tokenizers, overrides)
        except BindError as e:
            if args.json:
                return fail_json(e)
            raise
    known = None
    bound: set[str] = set()
    bindings = None
    if args.strict or args.bind:  # (loading a module may import torch; a plain check does not)
        from lmpm.bindings import BUILTINS, Bindings

        bindings = Bindings(args.bind)
        bound = bindings.user_names()
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
    diagnostics = list(front.diagnostics)
    if args.bind and bindings is not None and not front.errors:
        diagnostics += _link(front, bindings, overrides)
    print_diagnostics(diagnostics, args.json)
    if front.errors or any(d.severity == "error" for d in diagnostics):
        return 1
    try:
        _budget(front, overrides, args.max_memory)
    except LmpmError as e:
        if args.json:
            return fail_json(e)
        raise
    if args.device:
        return _device_check(args, path, overrides, tokenizers)
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


def _budget(front: Frontend, overrides: dict[str, int], limit: int | None) -> None:
    """Refuse, as `lmpm run` would before any work, a plan whose cells and gather tables do not
    fit in ``limit`` bytes (default: this machine's memory): U043, U049. Imports torch only for a
    plan whose bound from the cell counts does not fit (lmpm.resolve.budget)."""
    from lmpm.ir.eval import EvalError, bind_params
    from lmpm.resolve.budget import check_memory

    env = bind_params(front.ir, overrides)
    try:
        check_memory(front.ir, env, limit)
    except EvalError:  # a parameter without a value: the sizes are not known until --set
        pass


def _sized(path: Path, tokenizers: dict[str, str], overrides: dict[str, int]) -> dict[str, int]:
    """``overrides`` with each tokenizer's vocabulary size (B090-B094 as diagnostics)."""
    from lmpm.ir import compile_file
    from lmpm.runtime.vocab import bind_vocabularies

    front = compile_file(path, overrides=overrides, raise_errors=False)
    return bind_vocabularies(front.ir, tokenizers, overrides)[1]


def _link(front: Frontend, bindings: Bindings, overrides: dict[str, int]) -> list[Diagnostic]:
    """The run's link step over the checked program (``lmpm.ir.link``; a workflow's as the VM
    links it), without importing the built-ins: its first fault as a diagnostic."""
    from lmpm.ir.eval import bind_params
    from lmpm.ir.link import link, link_workflow

    try:
        link(front.ir, bindings, bind_params(front.ir, overrides), load=False, lenient=True)
        for w in front.ir.workflows:
            link_workflow(front.ir, w, bindings, load=False)
    except BindError as e:
        return list(e.diagnostics)
    return []


def _device_check(
    args: argparse.Namespace, path: Path, overrides: dict[str, int], tokenizers: dict[str, str]
) -> int:
    """`--device cuda`: run the program there (or on the simulated device) and report."""
    from lmpm.commands.common import parse_inputs
    from lmpm.runtime.devcheck import check_device

    if args.epochs < 1:
        raise UsageError("--epochs must be at least 1", code="U024")
    report = check_device(
        path,
        device=args.device,
        params=overrides,
        bind=args.bind,
        inputs=parse_inputs(args.input),
        epochs=args.epochs,
        tokenizers=tokenizers,
    )
    print_diagnostics(report.diagnostics, args.json)
    if args.json:
        return 1 if report.errors else 0
    if report.not_exercised:
        sys.stderr.write(
            f"note: in {report.epochs} epochs no cell fired rule "
            + ", ".join(f"`{r}`" for r in report.not_exercised)
            + ": its model was not run (give inputs with --input, or more --epochs)\n"
        )
    if report.errors:
        n = len(report.errors)
        sys.stderr.write(f"{path}: not ready for {args.device} ({n} error{'s' * (n != 1)})\n")
        return 1
    n = len(report.warnings)
    extra = f" ({n} warning{'s' * (n != 1)})" if n else ""
    sys.stderr.write(f"{path}: ready for {args.device} ({report.device}){extra}\n")
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
