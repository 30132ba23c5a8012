"""The IR's text form: one line per declaration, rules indented. Golden-tested.

>>> from lmpm.ir import compile_source
>>> print(print_ir(compile_source("value Txt : Token[Byte] shape Seq(8)\\n").ir).splitlines()[1])
value Txt : Token[Byte=256] Seq(8) clock Lamport
"""

from __future__ import annotations

from lmpm.ir.nodes import (
    SYMBOL,
    Access,
    Arg,
    ArgKind,
    Axis,
    AxisKind,
    Binder,
    Call,
    Expr,
    Op,
    Program,
    Read,
    ReadKind,
    Workflow,
)

# Binding strength of each operator; higher binds tighter.
_PREC = {
    Op.OR: 1,
    Op.AND: 2,
    Op.NOT: 3,
    Op.LT: 4,
    Op.LE: 4,
    Op.GT: 4,
    Op.GE: 4,
    Op.EQ: 4,
    Op.NE: 4,
    Op.ADD: 5,
    Op.SUB: 5,
    Op.MUL: 6,
    Op.DIV: 6,
    Op.MOD: 6,
    Op.NEG: 7,
}


def expr_str(e: Expr, parent: int = 0) -> str:
    if e.op in (Op.CONST, Op.VAR, Op.PARAM):
        s = str(e.value)
        return f"({s})" if isinstance(e.value, int) and e.value < 0 and parent >= 5 else s
    prec = _PREC[e.op]
    if e.op == Op.NEG:
        s = "-" + expr_str(e.args[0], prec)
    elif e.op == Op.NOT:
        s = "not " + expr_str(e.args[0], prec)
    else:
        sym = SYMBOL[e.op]
        lhs = expr_str(e.args[0], prec)
        # Left-associative: a right operand of equal precedence needs parentheses.
        rhs = expr_str(e.args[1], prec + 1)
        s = f"{lhs} {sym} {rhs}" if prec <= 4 else f"{lhs}{sym}{rhs}"
    return f"({s})" if prec < parent else s


def axis_str(a: Axis) -> str:
    match a.kind:
        case AxisKind.ALL:
            return "*"
        case AxisKind.AT:
            assert a.lo is not None
            return expr_str(a.lo)
        case AxisKind.RANGE:
            assert a.lo is not None and a.hi is not None
            return f"{expr_str(a.lo, 5)}..{expr_str(a.hi, 5)}"
        case AxisKind.REGION:
            assert a.call is not None
            return call_str(a.call)
        case AxisKind.GLOB:
            assert a.pattern is not None
            return _quote(a.pattern)
    raise AssertionError(a.kind)


def access_str(a: Access) -> str:
    return f"{a.value}[{', '.join(axis_str(x) for x in a.axes)}]"


def binder_str(b: Binder) -> str:
    lhs = b.vars[0] if len(b.vars) == 1 else f"({','.join(b.vars)})"
    if b.neighborhood is not None:
        return f"{lhs} in {b.neighborhood}"
    assert b.lo is not None and b.hi is not None
    return f"{lhs} in {expr_str(b.lo, 5)}..{expr_str(b.hi, 5)}"


def arg_str(a: Arg) -> str:
    key = f"{a.key}=" if a.key else ""
    match a.kind:
        case ArgKind.READ | ArgKind.NAME | ArgKind.INT:
            body = str(a.value)
        case ArgKind.FLOAT:
            body = repr(float(a.value))  # type: ignore[arg-type]  # shortest round-trip form
        case ArgKind.STR:
            body = _quote(str(a.value))
        case ArgKind.EXPR:
            assert a.expr is not None
            body = expr_str(a.expr)
        case ArgKind.CALL:
            assert a.call is not None
            body = call_str(a.call)
        case ArgKind.ACCESS:
            assert a.access is not None
            body = access_str(a.access)
        case ArgKind.FORWARD:
            body = "..."
        case ArgKind.OF:
            body = " of ".join(arg_str(x) for x in a.parts)
    return key + body


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def call_str(c: Call) -> str:
    if c.func == "Set":
        parts: list[str] = []
        args = list(c.args)
        while args:
            a = args.pop(0)
            if a.key == "lo" and args and args[0].key == "hi":
                hi = args.pop(0)
                assert a.expr is not None and hi.expr is not None
                parts.append(f"{expr_str(a.expr, 5)}..{expr_str(hi.expr, 5)}")
            else:
                parts.append(arg_str(a))
        return f"Set({', '.join(parts)})"
    return f"{c.func}({', '.join(arg_str(a) for a in c.args)})"


def read_str(r: Read) -> str:
    if r.kind == ReadKind.VISIBLE:
        return r.source
    s = f"{r.source}[{', '.join(axis_str(a) for a in r.axes)}]"
    if r.binders:
        s += " for " + " and ".join(binder_str(b) for b in r.binders)
    return s


def print_ir(p: Program) -> str:
    out = [f"lamport-ir v{p.version} {p.file}"]
    for prm in p.params:
        default = f" = {expr_str(prm.default)}" if prm.default is not None else ""
        note = "" if prm.declared else "  // implicit: bind with --set"
        out.append(f"param {prm.name}{default}{note}")
    for v in p.values:
        if v.module is not None:
            dtype = f"Params[{v.module}]"
        elif v.vocab is not None:
            vocab = expr_str(v.vocab)
            shown = vocab if v.vocab_name in (None, vocab) else f"{v.vocab_name}={vocab}"
            dtype = f"{v.dtype.value.capitalize()}[{shown}]"
        else:
            dtype = v.dtype.value.capitalize()
        dims = ", ".join(expr_str(d) for d in v.dims)
        out.append(f"value {v.name} : {dtype} {v.shape.value}({dims}) clock {v.clock}")
    for s in p.stencils:
        line = f"visible {s.target}[{','.join(s.vars)}] <- {s.source}[{', '.join(axis_str(a) for a in s.axes)}]"
        if s.binders:
            line += " for " + " and ".join(binder_str(b) for b in s.binders)
        if s.guard != Expr.const(1):
            line += f" when {expr_str(s.guard)}"
        out.append(line)
    for r in p.rules:
        pattern = f"{r.target}[{','.join(r.vars)}]" if r.vars else r.target
        when = f" when {expr_str(r.trigger)}" if r.trigger != Expr.const(1) else ""
        out.append(f"rule {r.name} ({r.kind.value}) on {pattern}{when}")
        for rd in r.reads:
            opt = "?" if rd.optional else ""
            out.append(f"  read {rd.name}{opt} = {rd.kind.value} {read_str(rd)}")
        out.append(f"  propose {call_str(r.proposal)}")
        if r.score is not None:
            out.append(f"  score {call_str(r.score)}")
    for c in p.constraints:
        if c.pred == "in_set":
            assert c.access is not None and c.set is not None
            pred = f"{access_str(c.access)} in {call_str(c.set)}"
        elif c.pred == "user":
            assert c.call is not None
            pred = call_str(c.call)
        else:
            assert c.access is not None
            pred = f"{c.pred.value}({access_str(c.access)})"
        pv = f" over {','.join(c.pattern_vars)}" if c.pattern_vars else ""
        out.append(
            f"constraint {c.name}: {c.kind} {pred} priority {c.priority}"
            f"{' hard' if c.hard else ''}{pv} [{c.status.value}]"
        )
    for cm in p.commits:
        out.append(f"commit {access_str(cm.access)} using {call_str(cm.policy)}")
    for w in p.workflows:
        out.extend(workflow_lines(w))
    return "\n".join(out) + "\n"


def workflow_lines(w: Workflow) -> list[str]:
    """A workflow as text: one line per zone statement (``lmpm show`` and ``print_ir``)."""
    out = [f"workflow {w.name} on {w.value}"]
    for k, z in enumerate(w.zones):
        out.append(f"  zone {k} {z.name}")
        for f in z.feeds:
            out.append(f"    feed {f.input}" if f.input is not None else f"    feed {f.text!r}")
        if z.generate:
            gen = "    generate"
            if z.max_tokens is not None:
                gen += f" max {expr_str(z.max_tokens)}"
            if z.allowed is not None:
                gen += f" in {call_str(z.allowed)}"
            out.append(gen)
        for x in z.exits:
            go = "advance" if x.target is None else f"jump {x.target}"
            lim = f" limit {expr_str(x.limit)}" if x.limit is not None else ""
            out.append(f"    until {x.pattern!r} -> {go}{lim}")
        if z.capture is not None:
            out.append(f"    capture {z.capture}")
        if z.tool is not None:
            out.append(f"    call {call_str(z.tool)}")
        if z.tags:
            out.append(f"    tag {', '.join(z.tags)}")
    return out
