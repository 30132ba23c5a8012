"""One error hierarchy for LMPM.

Every user-facing error is an :class:`LmpmError`. Source errors carry a :class:`Span` and render as
``file:line:col``, the source line, a caret and a hint; runtime errors carry a location (rule, cell,
worker, backend) instead. ``assert`` is kept for internal invariants only.

Source text for carets is looked up through :mod:`linecache`, which the parser fills for in-memory
programs, so a span is plain data (it round-trips through the IR's JSON) and still renders.
"""

from __future__ import annotations

import json
import linecache
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Severity = Literal["error", "warning", "note"]


# Not frozen, but never changed after construction and hashed by value: the parser makes one per
# token, and a frozen dataclass's __init__ (object.__setattr__ per field) is 4-5x slower.
@dataclass(slots=True, unsafe_hash=True)
class Span:
    """A region of a source file; lines and columns are 1-based, ``end_col`` is exclusive."""

    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def to_json(self) -> list[int]:
        return [self.line, self.col, self.end_line, self.end_col]

    @staticmethod
    def from_json(file: str, data: list[int]) -> Span:
        line, col, end_line, end_col = data
        return Span(file, line, col, end_line, end_col)


def register_source(name: str, text: str) -> None:
    """Make ``text`` the source of ``name`` for caret rendering (used for programs given as strings)."""
    # Split on "\n" only, as the parser counts lines (str.splitlines also breaks at U+2028, \f...).
    lines = [line + "\n" for line in text.split("\n")]
    linecache.cache[name] = (len(text), None, lines, name)


def user_frame(exc: BaseException) -> str:
    """`` (at FILE:LINE, in FUNC)``: where user code raised ``exc`` (the innermost frame of its
    traceback outside LMPM, torch and the standard library), or "" when no frame is the user's
    (LMPM's own models, or an error inside torch with no user code on the way)."""
    skip = [str(Path(__file__).resolve().parent), sysconfig.get_paths()["stdlib"]]
    torch = sys.modules.get("torch")
    if torch is not None and torch.__file__:
        skip.append(str(Path(torch.__file__).resolve().parent))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        file = str(Path(frame.filename).resolve())
        if frame.filename.startswith("<") or any(file.startswith(d) for d in skip):
            continue
        return f" (at {frame.filename}:{frame.lineno}, in {frame.name})"
    return ""


def source_line(span: Span) -> str:
    return linecache.getline(span.file, span.line).rstrip("\r\n")


def render_caret(span: Span) -> str:
    """The source line of ``span`` with a caret under it, or '' when the source is unavailable."""
    text = source_line(span)
    if not text:
        return ""
    # Keep huge lines readable: show a window around the caret.
    start = 0
    if len(text) > 120:
        start = max(0, span.col - 60)
        text = text[start : start + 120]
    col = max(span.col - 1 - start, 0)
    width = span.end_col - span.col if span.end_line == span.line else len(text) - col
    width = max(1, min(width, max(1, len(text) - col)))
    gutter = f"{span.line:>5} | "
    printable = "".join(
        ch if ch.isprintable() or ch == "\t" else "\N{REPLACEMENT CHARACTER}" for ch in text
    )
    return f"{gutter}{printable}\n{' ' * len(gutter)}{' ' * col}{'^' * width}"


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One finding of the parser or the checker."""

    code: str  # stable identifier, e.g. "E201"; documented in docs/language.md
    severity: Severity
    message: str
    span: Span | None = None
    hint: str | None = None

    def render(self) -> str:
        where = f"{self.span}: " if self.span else ""
        out = [f"{where}{self.severity}[{self.code}]: {self.message}"]
        if self.span is not None:
            caret = render_caret(self.span)
            if caret:
                out.append(caret)
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "hint": self.hint,
        }
        if self.span is not None:
            d.update(
                file=self.span.file,
                line=self.span.line,
                col=self.span.col,
                end_line=self.span.end_line,
                end_col=self.span.end_col,
            )
        return d


class LmpmError(Exception):
    """Root of every error LMPM raises on bad input or a runtime fault."""

    def __init__(
        self, message: str, *, span: Span | None = None, hint: str | None = None, code: str = "E000"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint
        self.code = code

    @property
    def diagnostics(self) -> list[Diagnostic]:
        return [Diagnostic(self.code, "error", self.message, self.span, self.hint)]

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)

    def to_json(self) -> str:
        return "\n".join(json.dumps(d.to_json()) for d in self.diagnostics)

    def __str__(self) -> str:
        return self.render()


class UsageError(LmpmError):
    """Bad command-line or API usage (unknown --set name, missing file, ...). CLI exit code 2."""


class SourceError(LmpmError):
    """Errors in a .lmpm program found before anything runs."""


class ParseError(SourceError):
    """The text is not a well-formed program."""


class CheckError(SourceError):
    """The static checker found errors; ``diagnostics`` holds all of them (warnings included)."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        errors = [d for d in diagnostics if d.severity == "error"]
        first = errors[0] if errors else diagnostics[0]
        super().__init__(first.message, span=first.span, hint=first.hint, code=first.code)
        self._diagnostics = list(diagnostics)

    @property
    def diagnostics(self) -> list[Diagnostic]:
        return self._diagnostics


class BindError(LmpmError):
    """A name in the program (param, model, predicate) could not be bound to a value or object."""


class RuntimeFault(LmpmError):
    """A fault while a program runs. ``where`` names the rule / constraint / cells / worker."""

    def __init__(
        self,
        message: str,
        *,
        where: dict[str, Any] | None = None,
        span: Span | None = None,
        hint: str | None = None,
        code: str = "R000",
    ) -> None:
        self.where = dict(where or {})
        loc = ", ".join(f"{k}={v}" for k, v in self.where.items())
        full = f"{message} ({loc})" if loc else message
        super().__init__(full, span=span, hint=hint, code=code)


class ModelError(RuntimeFault):
    """A bound model raised, or returned an invalid output (NaN/inf, shape, dtype, vocabulary)."""


class ConstraintEvalError(RuntimeFault):
    """A user-bound predicate raised or returned something that is not a boolean per candidate."""


class WorkflowError(RuntimeFault):
    """A workflow cannot run: a missing input, a tool that raised or returned the wrong thing."""


class InputError(RuntimeFault):
    """An input file does not fit the value it is bound to (shape, dtype, range, format)."""


class BackendUnavailable(LmpmError):
    """A worker backend cannot run on this machine (e.g. CUDA without a GPU)."""


class RunDirError(LmpmError):
    """A run directory is foreign, corrupt, or from a newer schema; nothing in it was overwritten."""


@dataclass
class DiagnosticSink:
    """Collects diagnostics during a pass; ``raise_if_errors`` turns them into a CheckError."""

    items: list[Diagnostic] = field(default_factory=list)

    def error(self, code: str, message: str, span: Span | None, hint: str | None = None) -> None:
        self.items.append(Diagnostic(code, "error", message, span, hint))

    def warning(self, code: str, message: str, span: Span | None, hint: str | None = None) -> None:
        self.items.append(Diagnostic(code, "warning", message, span, hint))

    @property
    def has_errors(self) -> bool:
        return any(d.severity == "error" for d in self.items)

    def raise_if_errors(self) -> None:
        if self.has_errors:
            raise CheckError(self.items)
