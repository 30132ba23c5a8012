"""Constraints that can decide nothing: about a value no rule proposes (W206), or a `Set(...)`
holding tokens outside the value's vocabulary (W208)."""

from __future__ import annotations

from lmpm.ir.check.facts import Facts, set_members
from lmpm.ir.eval import EvalError
from lmpm.ir.nodes import Constraint, PredKind


def check_constraint(f: Facts, c: Constraint) -> None:
    if c.access is not None and c.access.value not in f.proposed:
        f.sink.warning(
            "W206",
            f"constraint `{c.name}` speaks about `{c.access.value}`, which "
            "no rule proposes; it can never decide anything",
            c.span,
            f"add a rule with `on {c.access.value}[...]`, or remove the constraint",
        )
    if c.pred == PredKind.IN_SET and c.access is not None:
        _set_in_vocab(f, c)


def _set_in_vocab(f: Facts, c: Constraint) -> None:
    """W208: a `Set(...)` literal holding tokens the value's vocabulary does not have (they
    can never be proposed, so they neither satisfy a `require` nor trip a `forbid`)."""
    assert c.access is not None and c.set is not None
    v = f.values.get(c.access.value)
    if v is None or v.vocab is None or c.set.func != "Set" or not f.bound(v.vocab):
        return  # (an unsized vocabulary has only a probe size: W209 says so)
    vocab = f.vocab_of(v.name)
    try:
        outside = sorted(t for t in set_members(c.set, f.env) if not 0 <= t < vocab)
    except EvalError:
        return
    if outside:
        shown = ", ".join(map(str, outside[:6])) + (", …" if len(outside) > 6 else "")
        f.sink.warning(
            "W208",
            f"`Set(...)` of constraint `{c.name}` holds {len(outside)} token"
            f"{'s' if len(outside) > 1 else ''} outside the vocabulary of `{v.name}` "
            f"(0..{vocab - 1}): {shown}; no cell can hold them",
            c.set.span,
            f"keep the set within 0..{vocab - 1}",
        )
