"""`lmpm fmt FILE`: rewrite a program in canonical form (comments kept)."""

from __future__ import annotations

import argparse
import sys

from lmpm.commands.common import program_path

HELP = "format a program canonically (idempotent, keeps comments); --check only reports"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .lmpm program")
    p.add_argument("--check", action="store_true", help="exit 1 if the file is not formatted")
    p.add_argument("--stdout", action="store_true", help="print instead of rewriting the file")


def run(args: argparse.Namespace) -> int:
    from lmpm.lang.format import format_checked
    from lmpm.lang.parser import parse_file

    path = program_path(args.file)
    tree = parse_file(path)
    text = path.read_text(encoding="utf-8")
    out = format_checked(tree, text)
    if args.check:
        if out != text:
            sys.stderr.write(f"{path}: would be reformatted\n")
            return 1
        return 0
    if args.stdout:
        sys.stdout.write(out)
    elif out != text:
        # Write beside and rename: a crash never leaves a half-written program.
        tmp = path.with_name(path.name + ".lmpm-fmt.tmp")
        tmp.write_text(out, encoding="utf-8")
        tmp.replace(path)
        sys.stderr.write(f"{path}: formatted\n")
    return 0
