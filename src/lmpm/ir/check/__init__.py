"""The static checker: everything that can be decided before a tensor exists, as named passes.

Facts about index arithmetic (bounds, reads ⊆ visibility, `read_future`) are decided by probing each
clause at concrete *probe cells*: every cell near each boundary and a few interior ones, with the
program's parameters bound (declared defaults, ``--set``; unbound dimensions get a probe size). Index
expressions are affine (plus floor division), so a fact that holds at the edges and the interior
holds everywhere the clause is uniform; the edges are where clauses change behaviour.

The passes, in the order :func:`check` runs them (a pass's diagnostics come in program order):

=================  ==========================  ===============================================
pass               module                      codes
=================  ==========================  ===============================================
training           ``training``                E162 E161; then any error stops the check
shapes             ``shapes.check_shapes``     E203 E209 W209 (and a binding error); stops
commits            ``names.check_commits``     E208 W207
bounds             ``shapes.check_bounds``     W202, per `visible` clause
reads, firing      ``reads``, ``firing``       E201 then W205, per rule over cells
constraints        ``constraints``, ``future`` W206 W208 then E204, per constraint
workflows          ``workflows``               E243 E148 E241 E242 W240, per workflow
signatures         ``signatures``              E210 E211 E212 E213 E214
call names         ``names.check_call_names``  W210, or E207 with the run's names known
=================  ==========================  ===============================================

Each training statement is refused while it is lowered (``lmpm.ir.lower.train``: E150-E160, a
fault that leaves no IR to check); the training pass decides what the program holds as a whole.
The later passes skip minimize rules (they read whole data values) and the calls the training
runtime binds (:data:`~lmpm.ir.check.facts.TRAIN_ROLES`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from lmpm.errors import DiagnosticSink
from lmpm.ir import memo
from lmpm.ir.check import (
    constraints,
    firing,
    future,
    names,
    reads,
    shapes,
    signatures,
    training,
)
from lmpm.ir.check.facts import Facts, set_members
from lmpm.ir.check.lint import lint
from lmpm.ir.check.workflows import check_workflow, workflow_reachable
from lmpm.ir.nodes import Constraint, Program, Rule, RuleKind
from lmpm.lang import ast


def check(
    program: Program,
    sink: DiagnosticSink | None = None,
    *,
    overrides: Mapping[str, int] | None = None,
    known_names: Iterable[str] | None = None,
    strict: bool = False,
    tree: ast.Program | None = None,
    bound_names: Iterable[str] = (),
) -> Program:
    """Run every static check; returns the program with constraint statuses decided.

    ``known_names`` (the names a run binds) turns unknown call names into E207 with ``strict``;
    ``bound_names`` (the names the run's own modules/mappings bind) are not held to the signature
    of a built-in they override; ``tree`` (the AST the program was built from) lets diagnostics
    point at sub-expressions.

    Errors go to ``sink`` (raised as CheckError when no sink is given). The sink may hold the
    lowering's faults: the training pass still runs, then the check stops on any error.
    """
    own = sink is None
    sink = sink if sink is not None else DiagnosticSink()
    training.check_training(program, sink)
    out = program
    if not sink.has_errors:
        known = set(known_names) if known_names is not None else None
        f = Facts(program, sink, dict(overrides or {}), known, strict, set(bound_names), tree)
        out = _passes(f)
    if own:
        sink.raise_if_errors()
    return out


def _passes(f: Facts) -> Program:
    """The passes in their fixed order (the table in the module's docstring)."""
    if not shapes.check_shapes(f):
        return f.p
    names.check_commits(f)
    for s in f.p.stencils:
        shapes.check_bounds(f, s)
    for r in f.p.rules:
        if _over_cells(f, r):
            reads.check_reads(f, r)
            firing.check_firing(f, r)
    decided: list[Constraint] = []
    for c in f.p.constraints:
        constraints.check_constraint(f, c)
        decided.append(future.check_future(f, c))
    for w in f.p.workflows:
        check_workflow(f, w)
    signatures.check_signatures(f)
    names.check_call_names(f)
    return replace(f.p, constraints=tuple(decided))


def _over_cells(f: Facts, r: Rule) -> bool:
    """A rule that reads and fires per cell: not a schedule (it proposes the open set) nor a
    minimize rule (it reads whole data values), over a value whose dims are known."""
    return r.kind not in (RuleKind.SCHEDULE, RuleKind.MINIMIZE) and r.target in f.dims


def clear_caches() -> None:
    """Forget every probed fact (benchmarks use it to measure a cold check)."""
    memo.clear()


__all__ = ["Facts", "check", "clear_caches", "lint", "set_members", "workflow_reachable"]
