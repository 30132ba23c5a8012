"""Lowering static set constraints into a vocabulary mask: constraints before choosing.

Choosing k candidates and then checking them is the general semantics of a rule. Where a value's
live constraints on a proposed cell are static set memberships (``require Txt[t] in Set(...)``,
palettes, ``forbid ... in ...``), the same result comes from masking the model's logits first: the
worker keeps, of each cell's tokens, those the commit policy would rank first
(:func:`lmpm.workers.choose.allowed`), and the greedy choice among them (``pick="top"``, k=1) is
what the policy commits out of all V candidates. That is a choice of the resolver, not of the
language; it is made only where it is exact:

- the value holds tokens and is committed by ``satisfy(max_constraints_then_score)`` (any other
  policy may prefer a candidate the mask would drop; ``quorum`` counts replicas' votes);
- every live constraint on the value is a set membership, or ``forbid change(...)``: a token other
  than the committed one violates it exactly when every other token does, and keep-current always
  satisfies it, so it never separates the tokens the mask ranks (a user predicate or ``require
  change`` does: nothing is lowered on such a value);
- a rule with its own ``score`` ranks its candidates by that score, not by the model's logits: its
  models get no mask (the other rules of the value do).

The keep-current candidate competes with the chosen token as it would with all V: the worker
scores the committed token afresh too (:func:`lmpm.workers.choose.keep_column`). The constraints
stay in the plan and are checked on every candidate as before; the trace attributes decisions to
them as before (a token the mask dropped never was a candidate).

>>> from lmpm.ir import compile_source
>>> prog = compile_source('''
... value T : Token[Byte] shape Seq(4) clock Lamport
... rule R:
...   on T[t]
...   emit proposal T[t] := Gen(k=1)
... constraint Low:
...   require T[t] in Set(97..122) priority 10
... commit T[*] using satisfy(max_constraints_then_score)
... ''', raise_errors=False).ir
>>> lowering_of(prog)["T"].lowered
('Low',)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmpm.ir.link import DEFAULT_POLICY
from lmpm.ir.nodes import DType, PredKind, Program, RuleKind, ShapeKind, Status
from lmpm.ir.printer import call_str

if TYPE_CHECKING:
    from lmpm.ir.nodes import Constraint, Rule
    from lmpm.resolve.plan import Plan
    from lmpm.workers.base import MaskSets

__all__ = ["Lowering", "ValueMask", "lower", "lowering_of"]

POLICY = "satisfy(max_constraints_then_score)"  # the policy a mask is exact for
EXACT_FOR = frozenset((POLICY, "satisfy()"))  # the same policy as written (its mode defaulted)


@dataclass(frozen=True, slots=True)
class Lowering:
    """What the resolver lowers of one value's constraints, and why not the rest (`lmpm show`)."""

    value: str
    lowered: tuple[str, ...]  # the set constraints lowered into the mask (program order)
    rules: tuple[str, ...]  # the rules whose models' logits get the mask
    why_not: tuple[tuple[str, str], ...]  # (constraint or rule name, why it is not lowered/masked)

    def lines(self) -> list[str]:
        """One line per constraint and rule concerned, for people."""
        out = []
        if self.lowered:
            out.append(
                f"{self.value}: {', '.join(self.lowered)} lowered into a vocabulary mask on the "
                f'logits of {", ".join(self.rules)} (k=1 with pick="top" commits what k=V would)'
            )
        out += [f"{self.value}: {name} {why}" for name, why in self.why_not]
        return out


@dataclass(frozen=True, slots=True)
class ValueMask:
    """A value's lowered mask, as the workers apply it."""

    lowering: Lowering
    sets: MaskSets  # (S, V) tokens satisfying each lowered constraint, its levels and hard ones
    constraints: tuple[int, ...]  # (S,) ids into plan.constraints of the lowered constraints
    rules: frozenset[int]  # ids of the rules whose models' logits get the mask


def _live(c: Constraint) -> bool:
    return c.status != Status.PROVED and c.pred != PredKind.READ_FUTURE


def _what(c: Constraint) -> str:
    if c.pred == PredKind.USER and c.call is not None:
        return f"{c.kind} {call_str(c.call)}"
    return f"{c.kind} {c.pred.value}(...)"


def decide(
    value: str,
    tokens: bool,
    policy: str,
    constraints: Sequence[Constraint],
    rules: Sequence[Rule],
) -> Lowering | None:
    """The lowering of one proposed value's live ``constraints`` (None: it has no set constraint,
    nothing to say). ``policy``: the commit policy as written; ``rules``: the rules proposing it."""
    sets = [c for c in constraints if c.pred == PredKind.IN_SET]
    if not sets:
        return None
    if not tokens:
        return Lowering(
            value,
            (),
            (),
            tuple(
                (c.name, "is checked on the candidates: the value holds no tokens") for c in sets
            ),
        )
    if policy not in EXACT_FOR:
        why = (
            f"is checked on the candidates: the commit policy {policy} is not {POLICY}, so a "
            "mask could drop the candidate it commits"
        )
        return Lowering(value, (), (), tuple((c.name, why) for c in sets))
    why_not: list[tuple[str, str]] = []
    blockers = []
    for c in constraints:
        if c.pred == PredKind.IN_SET:
            continue
        if c.pred == PredKind.CHANGE and c.kind == "forbid":
            why_not.append(
                (
                    c.name,
                    "is checked on the candidates (keep-current always satisfies it and "
                    "every other token alike: the mask stays exact beside it)",
                )
            )
            continue
        blockers.append(c)
        why_not.append(
            (
                c.name,
                f"is checked on the candidates: {_what(c)} depends on more than the proposed token",
            )
        )
    if blockers:
        names = ", ".join(b.name for b in blockers)
        why = (
            f"is checked on the candidates: {names} on {value} cannot be a mask, and a mask "
            "could drop the candidate it would prefer"
        )
        return Lowering(value, (), (), tuple((c.name, why) for c in sets) + tuple(why_not))
    masked = []
    for r in rules:
        if r.score is not None:
            why_not.append(
                (
                    f"rule {r.name}",
                    f"gets no mask: it ranks its candidates by its own score "
                    f"({call_str(r.score)}), not by the model's logits",
                )
            )
        else:
            masked.append(r.name)
    if not masked:
        why = "is checked on the candidates: every rule proposing the value has its own score"
        return Lowering(value, (), (), tuple((c.name, why) for c in sets) + tuple(why_not))
    return Lowering(value, tuple(c.name for c in sets), tuple(masked), tuple(why_not))


def lowering_of(program: Program) -> dict[str, Lowering]:
    """Per proposed value with set constraints: what is lowered (from the program alone)."""
    policies = {cm.access.value: call_str(cm.policy) for cm in program.commits}
    out: dict[str, Lowering] = {}
    for v in program.values:
        if v.shape == ShapeKind.SET:
            continue
        rules = [r for r in program.rules if r.kind != RuleKind.SCHEDULE and r.target == v.name]
        if not rules:
            continue
        live = [c for c in program.constraints if c.access is not None and c.access.value == v.name]
        got = decide(
            v.name,
            v.dtype == DType.TOKEN,
            policies.get(v.name, call_str(DEFAULT_POLICY)),
            [c for c in live if _live(c)],
            rules,
        )
        if got is not None:
            out[v.name] = got
    return out


def lower(plan: Plan) -> dict[str, ValueMask]:
    """Per value whose set constraints are lowered: the mask its workers apply."""
    # (imported here: `lmpm show` reads the lowering from the program alone, without torch)
    import torch

    from lmpm.workers.base import MaskSets

    out: dict[str, ValueMask] = {}
    for name, rps in plan.rules_by_target.items():
        vp = plan.values[name]
        cps = plan.live_constraints.get(name, [])
        low = decide(
            name,
            vp.vocab is not None and not vp.cell_shape,
            vp.policy_text,
            [cp.ir for cp in cps],
            [rp.ir for rp in rps],
        )
        if low is None or not low.lowered:
            continue
        lowered = [cp for cp in cps if cp.pred == PredKind.IN_SET]
        ok = []
        for cp in lowered:
            assert cp.table is not None
            ok.append(cp.table if cp.kind == "require" else ~cp.table)
        soft = sorted({cp.priority for cp in lowered if not cp.ir.hard}, reverse=True)
        levels = tuple(
            tuple(s for s, cp in enumerate(lowered) if cp.priority == p and not cp.ir.hard)
            for p in soft
        )
        hard = tuple(s for s, cp in enumerate(lowered) if cp.ir.hard)
        out[name] = ValueMask(
            low,
            MaskSets(torch.stack(ok), levels, hard),
            tuple(cp.id for cp in lowered),
            frozenset(rp.id for rp in rps if rp.name in low.rules),
        )
    return out
