"""Text → AST. The language is defined by the lark grammar ``lmpm.lark`` (LALR(1) with an
indentation post-lexer, :mod:`lmpm.lang.larkparse`); a hand-written parser
(:mod:`lmpm.lang.fast`) produces the same AST several times faster and hands every text it does not
accept — every syntax error included — to lark, which reports it.

>>> from lmpm.lang.parser import parse
>>> prog = parse("value Txt : Token[Byte] shape Seq(8)\\nvisible Txt[t] <- Txt[0..t-1] when t > 0\\n")
>>> [type(item).__name__ for item in prog.items]
['Value', 'Visible']
"""

from __future__ import annotations

from pathlib import Path

from lmpm.errors import ParseError, Span, UsageError, register_source
from lmpm.lang import ast, fast

MAX_NESTING = fast.MAX_NESTING  # brackets deeper than this are refused (P004)


def parse(text: str, file: str = "<input>") -> ast.Program:
    """Parse LMPM source; raises :class:`~lmpm.errors.ParseError` with a span on bad input."""
    register_source(file, text)
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        col = text.index("\x00") - (text.rfind("\n", 0, text.index("\x00")) + 1) + 1
        raise ParseError(
            "the file contains a NUL byte",
            span=Span(file, line, col, line, col + 1),
            code="P006",
            hint="LMPM programs are UTF-8 text",
        )
    if not text.endswith("\n"):
        text += "\n"
    try:
        return ast.Program(file, tuple(fast.parse_items(text, file)))
    except fast.Fallback:
        pass
    return parse_lark(text, file)


def parse_lark(text: str, file: str = "<input>") -> ast.Program:
    """Parse with the lark grammar only (the reference parser; ``text`` ends with a newline)."""
    from lmpm.lang import larkparse

    return larkparse.parse(text, file)


def parse_file(path: str | Path) -> ast.Program:
    """Read and parse a file; bytes that are not UTF-8 are a ParseError pointing at them."""
    p = Path(path)
    if p.exists() and not p.is_file():  # a FIFO would hang the read, /dev/zero fill the memory
        raise UsageError(
            f"{path} is not a regular file (a FIFO, a device, a socket or a folder); a program is "
            "read from a regular file",
            code="U003",
        )
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        register_source(str(path), data.decode("utf-8", "replace"))
        raise ParseError(
            "the file is not valid UTF-8",
            span=Span(str(path), line, col, line, col + 1),
            code="P007",
            hint="save the program as UTF-8",
        ) from None
    return parse(text, str(path))
