"""Tools for examples/vm.lmpm, bound by name: `lmpm vm run ... --bind examples/vm/tools.py`.

A tool gets one argument list per ready stream (here: the capture `thing`) and returns one string
per stream, which the VM teacher-forces into that stream.
"""

from __future__ import annotations

import lmpm


@lmpm.bind("Count")
def count(calls: list[list[str]]) -> list[str]:
    return [f" ({len(args[0].split())} words)" for args in calls]
