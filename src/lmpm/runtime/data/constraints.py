"""Built-in predicates and sets for constraints (bound by name, see :mod:`lmpm.bindings`).

A user-bound predicate is ``fn(ctx: PredicateInput) -> bool tensor (n, C)``: for each open cell and
each of its candidates, whether the predicate *holds*. ``forbid P`` is violated where P holds,
``require P`` where it does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from lmpm.runtime.records import PredicateInput


def clash(ctx: PredicateInput) -> Tensor:
    """`clash(A[x,y], B[...])`: the candidate equals a committed cell of B other than the cell itself.

    With `forbid` it is the all-different constraint of a row, a column or a box.
    """
    if not ctx.accesses:
        raise ValueError("clash(A, B) needs a second access B: the cells that must differ")
    payload, mask, index = ctx.accesses[0]  # (n, K) each
    others = mask & (index != ctx.cells[:, None])
    same = payload[:, None, :] == ctx.candidates[:, :, None]  # (n, C, K)
    return (same & others[:, None, :]).any(dim=2)


def set_literal(*members: int | str | Iterable[int]) -> set[int]:
    """`Set(...)`: integers, ranges and strings (their UTF-8 bytes), as a Python set."""
    out: set[int] = set()
    for m in members:
        if isinstance(m, str):
            out.update(m.encode("utf-8"))
        elif isinstance(m, int):
            out.add(m)
        else:
            out.update(int(x) for x in m)
    return out


def inputs_region(*_: object, **__: object) -> None:
    """`Value[inputs()]`: the cells committed from input files (the givens). Evaluated by the
    runtime from provenance; this function only documents the built-in name."""
    raise RuntimeError("inputs() is evaluated by the runtime, not called")
