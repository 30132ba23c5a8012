"""Internal invariants of a well-formed IR, run after every pass in tests."""

from __future__ import annotations

from lmpm.ir.nodes import DType, Program, ReadKind, RuleKind


def lint(program: Program) -> list[str]:
    """Internal invariants of a well-formed IR (run after every pass in tests)."""
    problems: list[str] = []
    names = [v.name for v in program.values]
    if len(set(names)) != len(names):
        problems.append("duplicate value names")
    values = {v.name: v for v in program.values}
    for s in program.stencils:
        if s.target not in values or s.source not in values:
            problems.append(f"stencil refers to an unknown value: {s.target} <- {s.source}")
            continue
        if len(s.vars) != len(values[s.target].dims):
            problems.append(f"stencil into {s.target} binds {len(s.vars)} vars")
        if sum(a.width for a in s.axes) != len(values[s.source].dims):
            problems.append(f"stencil from {s.source} has the wrong number of axes")
    for r in program.rules:
        if r.target not in values:
            problems.append(f"rule {r.name} targets an unknown value")
        for rd in r.reads:
            if rd.source not in values:
                problems.append(f"rule {r.name} reads an unknown value")
            elif rd.kind != ReadKind.VISIBLE and sum(a.width for a in rd.axes) != len(
                values[rd.source].dims
            ):
                problems.append(f"read {rd.name} of {r.name} has the wrong number of axes")
    for c in program.constraints:
        if c.access is not None and c.access.value not in values:
            problems.append(f"constraint {c.name} refers to an unknown value")
    params = {v.name for v in program.values if v.dtype == DType.PARAMS}
    for r in program.rules:
        if (r.kind == RuleKind.MINIMIZE) != (r.target in params):
            problems.append(f"rule {r.name}: minimize rules and Params targets go together")
    accesses = [c.access for c in program.constraints] + [cm.access for cm in program.commits]
    for a in accesses:
        if a is not None and a.value in params and len(a.axes) != 1:
            problems.append(f"an access of the Params value {a.value} has {len(a.axes)} axes")
    for w in program.workflows:
        if w.value not in values:
            problems.append(f"workflow {w.name} runs on an unknown value")
        zones = [z.name for z in w.zones]
        if len(set(zones)) != len(zones):
            problems.append(f"workflow {w.name} has duplicate zones")
        for z in w.zones:
            for x in z.exits:
                if x.target is not None and x.target not in zones:
                    problems.append(f"zone {z.name} of {w.name} jumps to an unknown zone")
            if (z.exits or z.capture is not None) and not z.generate:
                problems.append(f"zone {z.name} of {w.name} has exits but no generation")
    return problems
