"""Argument helpers shared by subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmpm.errors import Diagnostic, LmpmError, UsageError


def parse_sets(items: list[str] | None) -> dict[str, int]:
    """`--set K=V` pairs (V an integer)."""
    out: dict[str, int] = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set expects NAME=INTEGER, got {item!r}", code="U002")
        try:
            out[key.strip()] = int(val.strip(), 0)
        except ValueError:
            raise UsageError(
                f"--set {key.strip()}: {val.strip()!r} is not an integer", code="U002"
            ) from None
    return out


def parse_inputs(items: list[str]) -> dict[str, str]:
    """`--input NAME=PATH` pairs, each value named once."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UsageError(f"--input expects NAME=PATH, got {item!r}", code="U021")
        if name.strip() in out:
            raise UsageError(
                f"--input {name.strip()} is given twice ({out[name.strip()]} and {path.strip()}); "
                "give each value one input file",
                code="U029",
            )
        out[name.strip()] = path.strip()
    return out


def parse_tokenizers(items: list[str] | None) -> dict[str, str]:
    """`--tokenizer NAME=PATH` pairs, each vocabulary bound once (B092 otherwise)."""
    from lmpm.errors import BindError

    out: dict[str, str] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise UsageError(
                f"--tokenizer expects NAME=PATH, got {item!r}",
                code="U021",
                hint="NAME is the vocabulary of `Token[NAME]`, PATH a tokenizer.json or a "
                "transformers model directory",
            )
        if name in out:
            raise BindError(
                f"vocabulary `{name}` is bound twice: --tokenizer {name}={out[name]} and "
                f"--tokenizer {name}={path}",
                code="B092",
                hint="give each vocabulary one tokenizer",
            )
        out[name] = path
    return out


def add_tokenizer(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="bind the vocabulary NAME of `Token[NAME]` to a tokenizer (a tokenizer.json or a "
        "transformers model directory): it sizes the vocabulary, encodes text inputs and writes "
        "text outputs (repeatable)",
    )


def add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        metavar="NAME=VALUE",
        default=[],
        help="bind a parameter (repeatable), e.g. --set N=64",
    )


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def memory_size(text: str) -> int:
    """``--max-memory``: bytes, or a number with K, M, G or T (powers of 1024), e.g. ``8G``."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = raw[-1:] if raw[-1:] in _UNITS else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        value = -1.0
    if not value > 0 or value * _UNITS[unit] > 2**62:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8G, 512M, 1000000)")
    return int(value * _UNITS[unit])


MSG_NOT_REGULAR = (
    "{path} is not a regular file (a FIFO, a device or a socket); a program is read from a "
    "regular file"
)


def program_path(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"no such file: {path}", code="U003")
    if p.is_dir():
        raise UsageError(f"{path} is a directory, not a .lmpm program", code="U003")
    if not p.is_file():  # a FIFO would hang the read, /dev/zero would fill the memory
        raise UsageError(MSG_NOT_REGULAR.format(path=path), code="U003")
    return p


def print_diagnostics(diags: list[Diagnostic] | tuple[Diagnostic, ...], as_json: bool) -> None:
    if as_json:
        for d in diags:
            sys.stdout.write(json.dumps(d.to_json()) + "\n")
        return
    for d in diags:
        sys.stderr.write(d.render() + "\n")


def fail_json(e: LmpmError) -> int:
    for d in e.diagnostics:
        sys.stdout.write(json.dumps(d.to_json()) + "\n")
    return 1
