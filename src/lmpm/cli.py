"""The `lmpm` command line. Each subcommand lives in `lmpm/commands/<name>.py` (found by name).

A command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``,
and imports anything heavy (torch) inside ``run`` so ``lmpm check`` stays instant.

Exit codes: 0 success (warnings allowed), 1 errors in the program or the run, 2 usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from lmpm import commands
from lmpm.errors import LmpmError, UsageError
from lmpm.printable import escape_markup, printable_lines


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message, code="U000")


# Modules of lmpm.commands that are shared by the commands, not commands themselves.
_SHARED = frozenset({"common"})


def _command_names() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.iter_modules(commands.__path__)
        if not m.name.startswith("_") and m.name not in _SHARED
    )


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="lmpm", description="LMPM: consensual programming over PyTorch")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in _command_names():
        if only is not None and name != only:
            # Other commands get a cheap placeholder so `lmpm --help` lists them without imports.
            sub.add_parser(name.replace("_", "-"))
            continue
        mod = importlib.import_module(f"lmpm.commands.{name}")
        p = sub.add_parser(name.replace("_", "-"), help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
    return parser


class _Stderr:
    """A rich console on stderr, created on first use: a clean `lmpm check` never imports rich."""

    def print(self, text: str, *, markup: bool) -> None:
        from rich.console import Console

        Console(stderr=True, highlight=False, soft_wrap=True).print(text, markup=markup)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    err = _Stderr()
    try:
        wanted = next((a for a in argv if not a.startswith("-")), None)
        only = (
            wanted.replace("-", "_")
            if wanted and wanted.replace("-", "_") in _command_names()
            else None
        )
        parser = build_parser(only)
        if not argv or argv[0] in ("-h", "--help") or only is None:
            if argv and argv[0] not in ("-h", "--help"):
                raise UsageError(
                    f"unknown command {argv[0]!r}; commands: "
                    + ", ".join(n.replace("_", "-") for n in _command_names()),
                    code="U001",
                )
            build_parser().print_help()
            return 0 if argv else 2
        args = parser.parse_args(argv)
        return int(importlib.import_module(f"lmpm.commands.{only}").run(args))
    except UsageError as e:
        if e.span is not None:  # a command that does not fit the program: point at the line
            err.print(printable_lines(e.render()), markup=False)
            return 2
        err.print(
            f"[bold red]usage error[/]: {escape_markup(printable_lines(e.message))}", markup=True
        )
        if e.hint:
            err.print(f"  hint: {printable_lines(e.hint)}", markup=False)
        return 2
    except LmpmError as e:  # messages may quote a received log or input: printable only
        err.print(printable_lines(e.render()), markup=False)
        return 1
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug in LMPM itself: say so plainly, no traceback unless asked
        if os.environ.get("LMPM_DEBUG"):
            raise
        err.print(
            f"internal error: {type(e).__name__}: {printable_lines(str(e))}\n(this is a bug in LMPM; rerun with "
            "LMPM_DEBUG=1 for the traceback)",
            markup=False,
        )
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
