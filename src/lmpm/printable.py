"""Text from a run directory, a program or an input file, made safe to show on a terminal.

A received run directory is data (``docs/security.md``): a constraint name, a ``program_file`` or a
VM decision read from its log may hold terminal escapes (``ESC[2J`` clears the screen, OSC 52
writes the clipboard) or rich markup (``[link=...]``). Every string LMPM shows from such a source
goes through :func:`printable` (one string) or :func:`printable_tree` (a report: dicts, lists,
tuples), for tables and ``--json`` alike. Control and format characters are written as Python
escapes; printable Unicode is kept. Imports nothing from LMPM (a leaf: the error printer uses it), and rich only to escape markup.

>>> printable("ok \\x1b[2J é")
'ok \\\\x1b[2J é'
>>> printable("a\\u202eb")
'a\\\\u202eb'
>>> printable_tree({"name\\x07": ["[bold]x", 3]}, markup=True)
{'name\\\\x07': ['\\\\[bold]x', 3]}
"""

from __future__ import annotations

from typing import Any


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every non-printable character (C0/C1 controls, DEL, newlines, tabs, bidi and
    other format characters, unassigned code points) replaced by its Python escape."""
    if text.isprintable():  # the common case, one C loop
        return text
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


def printable_lines(text: str) -> str:
    """:func:`printable` per line, keeping the line breaks (a multi-line message)."""
    return "\n".join(printable(line) for line in text.split("\n"))


def escape_markup(text: str) -> str:
    """``text`` with rich markup escaped (``[bold]`` shows as written). Imports rich on first use:
    ``lmpm check`` never does."""
    from rich.markup import escape

    return escape(text)


def printable_tree(obj: Any, *, markup: bool = False) -> Any:
    """``obj`` with :func:`printable` applied to every string in it (dict keys included);
    ``markup``: rich markup in the strings is escaped too (for text printed by a rich console)."""
    if isinstance(obj, str):
        out = printable(obj)
        return escape_markup(out) if markup else out
    if isinstance(obj, dict):
        return {
            printable_tree(k, markup=markup): printable_tree(v, markup=markup)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [printable_tree(v, markup=markup) for v in obj]
    if isinstance(obj, tuple):
        return tuple(printable_tree(v, markup=markup) for v in obj)
    return obj
