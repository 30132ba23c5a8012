"""The training pass: what a training program may hold beyond its Params value (E161, E162), and
the names it binds (B080 a module, B081 a loss: the names :mod:`lmpm.train.modules` binds, read
torch-free from :mod:`lmpm.signatures`, so a run cannot fail on a name the check accepted).

A training program trains one Params value with one minimize rule, and says with a `commit` line
how its replicas agree; its other values are data the loss reads (rules, workflows, constraints
and commits on them: not yet). The statements themselves were refused while they were lowered
(:mod:`lmpm.ir.lower.train`, E150-E160); this pass reads the program they lowered to, and runs
even when some of them failed, so its faults come with theirs.
"""

from __future__ import annotations

from lmpm.errors import DiagnosticSink
from lmpm.ir.nodes import DType, Program, Value
from lmpm.signatures import TRAIN_LOSSES, TRAIN_MODULES


def check_training(program: Program, sink: DiagnosticSink) -> None:
    """E162 for a second Params value, a second minimize rule, a statement about a data value or
    no minimize rule; E161 for a Params value without a `commit` line."""
    params = [v for v in program.values if v.dtype == DType.PARAMS]
    if not params:
        return
    p = params[0]
    for extra in params[1:]:
        sink.error(
            "E162",
            f"a second Params value `{extra.name}` (`{p.name}` is at line {p.span.line}); "
            "one Params value per program is supported",
            extra.span,
            "train one module per program",
        )
    mins = [r for r in program.rules if r.target == p.name]
    for r in mins[1:]:
        sink.error(
            "E162",
            f"a second minimize rule on `{p.name}` (`{mins[0].name}` is at line "
            f"{mins[0].span.line}); one per Params value is supported",
            r.span,
            "merge them into one rule (a loss may read several data values)",
        )
    _on_data(p, program, sink)
    _names(p, program, sink)
    if sink.has_errors:
        return  # a statement about the Params value may have failed to lower: say no more
    if not mins:
        sink.error(
            "E162",
            f"no rule trains the Params value `{p.name}`",
            p.span,
            f"add `rule Fit:` with `on {p.name}[*]` and "
            f"`emit proposal {p.name}[*] := minimize(Loss({p.name}, data), steps=50, batch=8)`",
        )
    if not any(cm.access.value == p.name for cm in program.commits):
        sink.error(
            "E161",
            f"the Params value `{p.name}` has no `commit` line; a training program says how "
            "replicas agree",
            p.span,
            f"add `commit {p.name}[*] using diloco(outer_lr=0.7, momentum=0.9)` "
            "(or `average`, or `satisfy(max_constraints_then_score)`)",
        )


def _on_data(p: Value, program: Program, sink: DiagnosticSink) -> None:
    """E162 for every statement about a value other than the Params value ``p``."""
    soon = "not supported yet: in a training program the other values are data inputs"
    for r in program.rules:
        if r.target != p.name:
            sink.error("E162", f"rule `{r.name}` on `{r.target}` is {soon}", r.span, "remove it")
    for w in program.workflows:
        sink.error("E162", f"workflow `{w.name}` is {soon}", w.span, "remove it")
    for c in program.constraints:
        if c.access is None or c.access.value != p.name:
            sink.error(
                "E162",
                f"constraint `{c.name}` on "
                + (f"`{c.access.value}`" if c.access is not None else "a data value")
                + f" is {soon}",
                c.span,
                "constrain the parameters: `forbid change(P[...])`, `require NormAtMost(...)`",
            )
    for cm in program.commits:
        if cm.access.value != p.name:
            sink.error("E162", f"a commit of `{cm.access.value}` is {soon}", cm.span, "remove it")


def _names(p: Value, program: Program, sink: DiagnosticSink) -> None:
    """B080 for a module name and B081 for a loss name that nothing binds."""
    if p.module is not None and p.module not in TRAIN_MODULES:
        sink.error(
            "B080",
            f"no module is bound as `{p.module}` for a Params value",
            p.span,
            f"the modules are {', '.join(TRAIN_MODULES)}",
        )
    for r in program.rules:
        if r.target != p.name:
            continue
        calls = [a.call for a in r.proposal.args[:1] if a.call is not None] if r.proposal else []
        for call in calls + ([r.score] if r.score is not None else []):
            if call.func not in TRAIN_LOSSES:
                sink.error(
                    "B081",
                    f"no loss is bound as `{call.func}`",
                    call.span,
                    f"the losses are {', '.join(TRAIN_LOSSES)}",
                )
