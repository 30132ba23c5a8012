"""What ``--compile`` covers in a program: per value, compiled or an eager island and why; and the
eager islands between the compiled parts (the models, bound Python predicates and scores).

The rule the runtime holds to (issue 45): every proposed value's decision compiles (several rules,
quorum replicas, every shipped policy, `hard` constraints, quotas), except where user Python code
must run on the candidates (a bound Python predicate, a policy the user registered); the models
(and their scores) run outside the step anyway, between compiled parts. :func:`coverage` reads it from the
plan through :func:`lmpm.runtime.data.compiled.eligibility`, whatever that allows; ``lmpm show
--compiled`` prints it, ``benchmarks/compile_coverage.py`` counts it over the examples and random
programs, tests/runtime/test_compile_coverage.py asserts the rule.

Example:
    >>> from lmpm.ir import compile_source
    >>> from lmpm.resolve.plan import resolve
    >>> program = compile_source('''
    ... value Prompt : Token[8] shape Seq(4)
    ... value Out : Token[8] shape Seq(4)
    ... visible Out[t] <- Prompt[t]
    ... rule Echo:
    ...   on Out[t]
    ...   read {p = Prompt[t]}
    ...   emit proposal Out[t] := Uniform(p, k=2)
    ... constraint NoZero: forbid Out[t] in Set(0) priority 1
    ... commit Out[*] using satisfy
    ... ''')
    >>> cov = coverage(resolve(program.ir))
    >>> cov.summary(), cov.values[0].status(), cov.inputs
    ('1 of 1 value compiled', 'compiled', ('Prompt',))
    >>> [island.text() for island in cov.islands]
    ['model Uniform (rule Echo, proposes Out)']
"""

from __future__ import annotations

from dataclasses import dataclass

from lmpm.bindings import COMPILE_ATTR
from lmpm.ir.nodes import PredKind
from lmpm.resolve.plan import Plan
from lmpm.runtime.data.compiled import eligibility, user_policy
from lmpm.runtime.data.owner import schedule_of

COMPILED = "compiled"


@dataclass(frozen=True, slots=True)
class Island:
    """User or model code that runs eagerly, outside the compiled step."""

    kind: str  # model | score | predicate | policy
    name: str  # the called name, as the program spells it
    where: str  # "rule R" or "constraint C"
    value: str  # the value it proposes or checks
    own_compile: bool  # a model or score compiled by its own ``lmpm_compile`` (still outside)

    def text(self) -> str:
        verb = {"predicate": "checks", "policy": "decides"}.get(self.kind, "proposes")
        own = ", compiled by its own lmpm_compile" if self.own_compile else ""
        return f"{self.kind} {self.name} ({self.where}, {verb} {self.value}{own})"


@dataclass(frozen=True, slots=True)
class ValueCoverage:
    """One proposed value under ``--compile``."""

    value: str
    why: str | None  # why its decision runs eagerly (None: it compiles)
    # the bound Python predicates on it that ``why`` names: an eager island the rule allows
    predicates: tuple[str, ...]
    # the user's own commit policy (registered Python code) deciding it: an eager island too
    policy: str | None = None

    @property
    def compiled(self) -> bool:
        return self.why is None

    @property
    def allowed(self) -> bool:
        """Compiled, or eager only because user Python code decides it: a bound predicate or
        the user's own policy (the coverage rule)."""
        if self.why is None or self.policy is not None:
            return True
        return any(f"`{p}`" in self.why for p in self.predicates)

    def status(self) -> str:
        """``compiled`` or ``eager island: <why>``."""
        return COMPILED if self.why is None else f"eager island: {self.why}"


@dataclass(frozen=True, slots=True)
class Coverage:
    """A program's ``--compile`` coverage."""

    values: tuple[ValueCoverage, ...]  # the proposed values, in program order
    inputs: tuple[str, ...]  # values no rule proposes (given as input: no decision to compile)
    islands: tuple[Island, ...]

    @property
    def compiled(self) -> int:
        return sum(v.compiled for v in self.values)

    @property
    def total(self) -> int:
        return len(self.values)

    @property
    def holds(self) -> bool:
        """Every value compiles, or is eager only for user Python code (a bound predicate, a
        user policy)."""
        return all(v.allowed for v in self.values)

    def summary(self) -> str:
        return f"{self.compiled} of {self.total} value{'s' if self.total != 1 else ''} compiled"


def coverage(plan: Plan, *, seed: int = 0) -> Coverage:
    """What ``--compile`` makes of ``plan`` (``seed``: the run's, which picks its schedule)."""
    quota = schedule_of(plan, seed).has_quota
    live = plan.live_constraints
    values = []
    for name in plan.rules_by_target:
        bound = tuple(cp.name for cp in live.get(name, []) if cp.pred == PredKind.USER)
        why = eligibility(plan, name, quota=quota)
        values.append(ValueCoverage(name, why, bound, user_policy(plan, name)))
    proposed = set(plan.rules_by_target)
    inputs = tuple(name for name in plan.values if name not in proposed)
    return Coverage(tuple(values), inputs, tuple(_islands(plan)))


def _islands(plan: Plan) -> list[Island]:
    out = []
    for name, rules in plan.rules_by_target.items():
        for rp in rules:
            where = f"rule {rp.name}"
            out.append(
                Island("model", rp.ir.proposal.func, where, name, hasattr(rp.model, COMPILE_ATTR))
            )
            if rp.score is not None and rp.ir.score is not None:
                own = hasattr(rp.score, COMPILE_ATTR)
                out.append(Island("score", rp.ir.score.func, where, name, own))
        policy = user_policy(plan, name)
        if policy is not None:
            out.append(Island("policy", policy, f"commit {name}", name, False))
        for cp in plan.live_constraints.get(name, []):
            if cp.pred == PredKind.USER and cp.ir.call is not None:
                where = f"constraint {cp.name}"
                out.append(Island("predicate", cp.ir.call.func, where, name, False))
    return out
