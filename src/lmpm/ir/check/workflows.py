"""Workflows: a model proposes the stream (E243), counts are positive (E148), every zone is
reachable (E241), every trigger can match what the stream may hold (E242), and a jump without a
limit is a warning (W240)."""

from __future__ import annotations

from lmpm.ir.check.facts import Facts, set_members
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.nodes import PredKind, Workflow, Zone


def check_workflow(f: Facts, w: Workflow) -> None:
    if w.value not in f.proposed:
        f.sink.error(
            "E243",
            f"workflow `{w.name}` needs a model: no rule proposes `{w.value}`",
            w.span,
            f"add a rule that emits proposals for `{w.value}` (its model writes the streams)",
        )
    for z in w.zones:
        _counts(f, z)
    for z, ok in zip(w.zones, workflow_reachable(w)):
        if not ok:
            f.sink.error(
                "E241",
                f"zone `{z.name}` is unreachable: no zone advances or jumps into it",
                z.span,
                "give the zone before it a way to advance (`max N` or an `until` without "
                "`jump`), jump to it, or remove it",
            )
    vocab = f.vocab_of(w.value)
    value_allowed = _value_allowed(f, w.value, vocab)
    for z in w.zones:
        _triggers(f, z, value_allowed, vocab)


def _counts(f: Facts, z: Zone) -> None:
    """`max N` and each `limit K` of zone ``z``: at least 1 with the parameters bound."""
    for what, e, span in [("max", z.max_tokens, z.span)] + [
        ("limit", x.limit, x.span) for x in z.exits
    ]:
        if e is None:
            continue
        try:
            n = evaluate(e, f.env)
        except EvalError as err:
            f.sink.error("E148", f"`{what}` of zone `{z.name}`: {err}", span)
            continue
        if n < 1:
            f.sink.error("E148", f"`{what}` of zone `{z.name}` must be at least 1", span)


def _triggers(f: Facts, z: Zone, value_allowed: set[int], vocab: int) -> None:
    allowed = value_allowed
    if z.allowed is not None:
        allowed = allowed & set_members(z.allowed, f.env)
    for x in z.exits:
        bad = [b for b in x.pattern.encode("utf-8") if b not in allowed]
        if bad:
            why = (
                f"byte {bad[0]} is outside the vocabulary (size {vocab})"
                if bad[0] >= vocab
                else f"{bytes([bad[0]])!r} is never allowed in zone `{z.name}`"
            )
            f.sink.error(
                "E242",
                f"trigger {x.pattern!r} can never match: {why}",
                x.span,
                "use a pattern made of tokens the zone may generate",
            )
    for x in z.exits:
        if x.target is not None and x.limit is None:
            f.sink.warning(
                "W240",
                f"`jump {x.target}` has no limit: a stream may loop until it is full",
                x.span,
                "add `limit K` (after K jumps the zone advances instead)",
            )


def _value_allowed(f: Facts, value: str, vocab: int) -> set[int]:
    """Tokens the program's `in Set(...)` constraints over ``value`` let a stream hold."""
    allowed = set(range(vocab))
    for c in f.p.constraints:
        if c.pred != PredKind.IN_SET or c.access is None or c.access.value != value:
            continue
        assert c.set is not None
        if c.set.func != "Set":
            continue
        members = set_members(c.set, f.env)
        allowed = allowed & members if c.kind == "require" else allowed - members
    return allowed


def workflow_reachable(w: Workflow) -> list[bool]:
    """Which zones a stream can enter, starting in the first one."""
    index = {z.name: i for i, z in enumerate(w.zones)}
    seen = [False] * len(w.zones)
    stack = [0] if w.zones else []
    while stack:
        i = stack.pop()
        if i >= len(w.zones) or seen[i]:
            continue
        seen[i] = True
        z = w.zones[i]
        advances = (
            not z.generate
            or z.max_tokens is not None
            or any(x.target is None or x.limit is not None for x in z.exits)
        )
        if advances:
            stack.append(i + 1)
        stack.extend(index[x.target] for x in z.exits if x.target is not None)
    return seen
