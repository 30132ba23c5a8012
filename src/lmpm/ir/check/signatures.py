"""Built-in signatures: commit policies (E210, E211), schedules (E212), models and scores
(E213) and the literal arguments of predicates, sets and regions (E215) are held to what
:mod:`lmpm.signatures` declares, with the caret on the argument; a rule on the RuleSet (E214) has
no schedule to hold to."""

from __future__ import annotations

import sys

from lmpm.bindings import BUILTINS
from lmpm.ir.check.facts import Facts, name_span, suggest
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.nodes import Arg, ArgKind, AxisKind, Call, DType, Expr, Rule, RuleKind, Value
from lmpm.lang import ast
from lmpm.signatures import POLICIES, SIGNATURES, Signature
from lmpm.signatures import Param as SigParam


def check_signatures(f: Facts) -> None:
    for cm in f.p.commits:
        v = f.values.get(cm.access.value)
        if v is not None and v.dtype == DType.PARAMS:
            continue  # checked when built (diloco, average, satisfy)
        _policy(f, cm.policy, v)
    for r in f.p.rules:
        if r.kind == RuleKind.MINIMIZE:
            continue  # checked when built (lmpm.train.spec.MinimizeSpec's options)
        if r.kind == RuleKind.SCHEDULE:
            if not _ruleset_rule(f, r):
                _schedule(f, r.proposal)
        else:
            _model(f, r, r.proposal)
            if r.score is not None:
                _model(f, r, r.score)
    for call in f.p.calls():
        if call.role in ("predicate", "set", "region"):
            _literals(f, call)


def _user_bound(f: Facts, name: str) -> bool:
    return f.is_user_bound(name, BUILTINS)


def _policy(f: Facts, call: Call, v: Value | None) -> None:
    sig = SIGNATURES.get(call.func)
    if sig is None or sig.role != "policy":
        if _user_bound(f, call.func) or _registered_policy(call.func):
            return
        near = suggest(call.func, list(POLICIES))
        f.sink.error(
            "E210",
            f"unknown commit policy `{call.func}`",
            name_span(call),
            (near + "; " if near else "") + "policies: " + ", ".join(POLICIES),
        )
        return
    if sig.dtypes and v is not None and v.dtype.value not in sig.dtypes:
        f.sink.error(
            "E211",
            f"`{call.func}` needs a value of type {' or '.join(sig.dtypes)}; `{v.name}` holds "
            f"{v.dtype.value}s",
            name_span(call),
            "for tokens use satisfy(max_constraints_then_score) or winner_takes_all",
        )
    if len(call.args) > len(sig.params):
        f.sink.error(
            "E210",
            f"`{call.func}` takes {len(sig.params)} argument"
            f"{'s' if len(sig.params) != 1 else ''}; got {len(call.args)}",
            f.arg_span(call, len(sig.params)),
            f"write {sig.doc}",
        )
        return
    for i, (a, prm) in enumerate(zip(call.args, sig.params)):
        if a.key is not None:
            f.sink.error(
                "E210",
                f"`{call.func}` takes positional arguments; got `{a.key}=`",
                f.arg_span(call, i),
                f"write {sig.doc}",
            )
            continue
        if a.kind == ArgKind.OF and "of" in prm.kinds:
            _count_of(f, call, i, a)
            continue
        if prm.name == "inner":
            if a.kind == ArgKind.CALL and a.call is not None:
                _policy(f, a.call, v)
            elif a.kind in (ArgKind.NAME, ArgKind.STR):
                _policy(f, Call(str(a.value), (), "policy", f.arg_span(call, i)), v)
            else:
                _arg_error(f, "E210", call, i, a, prm, sig)
            continue
        _check_arg(f, "E210", call, i, a, prm, sig)


def _count_of(f: Facts, call: Call, i: int, a: Arg) -> None:
    """`k of n` (quorum): integers with 1 <= k <= n, the caret on the side that is wrong."""
    node = f.ast_calls.get(call.span)
    of = node.args[i].value if node is not None and i < len(node.args) else None
    spans = (of.count.span, of.total.span) if isinstance(of, ast.Of) else (call.span,) * 2
    got: list[int | None] = []
    for part in a.parts:
        value: int | None = None
        if part.kind == ArgKind.INT:
            value = int(part.value)  # type: ignore[arg-type]
        elif part.kind == ArgKind.EXPR and part.expr is not None:
            try:
                value = int(evaluate(part.expr, f.env))
            except EvalError:
                value = None  # an unbound param: decided when it is given
        got.append(value)
    k, n = got
    if n is not None and n < 1:
        f.sink.error(
            "E210",
            f"`{call.func}`: {k if k is not None else 'k'} of {n} needs at least 1 replica",
            spans[1],
            "write e.g. quorum(2 of 3, satisfy)",
        )
    elif k is not None and (k < 1 or (n is not None and k > n)):
        bound = f"between 1 and {n}" if n is not None else "at least 1"
        f.sink.error(
            "E210",
            f"`{call.func}`: {k} of {n if n is not None else 'n'} asks for {k} agreeing "
            f"replicas; k must be {bound}",
            spans[0],
            "write e.g. quorum(2 of 3, satisfy)",
        )


def _ruleset_rule(f: Facts, r: Rule) -> bool:
    """No rule proposes to a `Rule` Set (the seed's RuleSet): the active constraints change
    between epochs through enable/disable, which a rule cannot call (E214). True: reported."""
    v = f.values.get(r.target)
    if v is None or v.dtype != DType.RULE:
        return False
    f.sink.error(
        "E214",
        f"`{r.target}` is a Set of Rules, the RuleSet (the active constraints): no rule "
        "proposes to it",
        r.span,
        "switch constraints between epochs with `lmpm run --resume DIR --disable NAME` "
        "(or --enable), or run.disable(NAME) in Python; remove this rule",
    )
    return True


def _schedule(f: Facts, call: Call) -> None:
    sig = SIGNATURES.get(call.func)
    if sig is not None and sig.role != "schedule" and not _user_bound(f, call.func):
        f.sink.error(
            "E212",
            f"`{call.func}` is a {sig.role}, not a schedule: a rule on a Set value proposes "
            "the open set",
            name_span(call),
            'write e.g. SampleTiles(strategy="red-black", epoch=e)',
        )
        return
    if sig is None or sig.role != "schedule" or _user_bound(f, call.func):
        return
    for i, a in enumerate(call.args):
        if a.key is None:
            f.sink.error(
                "E212",
                f"`{call.func}` takes keyword arguments; this one has no name",
                f.arg_span(call, i),
                f"write {sig.doc}",
            )
            continue
        _keyword(f, "E212", call, i, a, sig)
    _frontier(f, call)


def _frontier(f: Facts, call: Call) -> None:
    """`SampleTiles(strategy="frontier")` generates each value's rows (every axis but the last)
    side by side, each along its last axis: `steps` is not its (E212), and a value whose cells
    read their own value along a leading axis with the last one fixed (`Txt[t, b] <-
    Txt[0..t-1, b]`: the sequence is the first axis) would open cells whose context is not
    generated yet (E212: put the sequence axis last, or use raster)."""
    keys = {a.key: (i, a) for i, a in enumerate(call.args) if a.key is not None}
    hit = keys.get("strategy")
    if hit is None or hit[1].value != "frontier":
        return
    if "steps" in keys:
        f.sink.error(
            "E212",
            "`SampleTiles`: `steps` is the confidence schedule's; frontier opens the next `k` "
            "cells of every row each epoch",
            f.arg_span(call, keys["steps"][0]),
            'remove it: SampleTiles(strategy="frontier", k=1)',
        )
    for s in f.p.stencils:
        if s.target != s.source or s.target not in f.proposed or len(s.axes) < 2:
            continue
        last = s.axes[-1]
        own = s.vars[-1] if s.vars else None
        fixed_last = last.kind == AxisKind.AT and last.lo == Expr.var(own) if own else False
        along_lead = any(
            a.kind != AxisKind.AT or a.lo != Expr.var(v) for a, v in zip(s.axes, s.vars)
        )
        if fixed_last and along_lead:
            f.sink.error(
                "E212",
                f"the frontier schedule generates the rows of `{s.target}` side by side along "
                f"its last axis, but its cells read along a leading axis with the last one "
                "fixed: a cell would open before the cells it reads are generated",
                f.arg_span(call, hit[0], value=True),
                f"put the sequence axis last (`{s.target}[b, t] <- {s.target}[b, 0..t-1]` on "
                'Grid2D(B, N)), or use strategy="raster"',
            )
            return


def _model(f: Facts, r: Rule, call: Call) -> None:
    sig = SIGNATURES.get(call.func)
    if sig is None or sig.role not in ("model", "score") or _user_bound(f, call.func):
        return
    names = _input_names(r, call)
    missing = [n for n in sig.reads if n not in names]
    if missing:
        have = ", ".join(f"`{n}`" for n in sorted(names)) or "none"
        need = missing[0]
        first = next((rd.name for rd in r.reads), None)
        fix = f"name a read `{need}` (`read {{{need} = ...}}`)" + (
            f" or pass it by keyword: `{call.func}({need}={first})`" if first else ""
        )
        f.sink.error(
            "E213",
            f"`{call.func}` needs an input named `{need}`; rule `{r.name}` gives it {have}",
            name_span(call),
            fix,
        )
    v = f.values.get(r.target)
    if sig.role == "model" and v is not None:
        _proposes(f, call, sig, v)
    for i, a in enumerate(call.args):
        if a.kind in (ArgKind.READ, ArgKind.FORWARD):
            continue
        if a.key is None:
            continue  # a positional literal: passed as argN, ignored by the built-ins
        _keyword(f, "E213", call, i, a, sig)


def _literals(f: Facts, call: Call) -> None:
    """A built-in predicate, set or region: its literal arguments (accesses aside), positional in
    the declared order or by keyword, of the kinds it declares (E215). A string where a number
    goes (``NormAtMost(Z[x, y], "2.5")``) or a bare name that is no parameter is refused here,
    not by a worker at run time."""
    sig = SIGNATURES.get(call.func)
    if sig is None or sig.role != call.role or not sig.params or _user_bound(f, call.func):
        return  # (`Set(...)` takes any literals; a bound name is held to its own signature)
    position = 0
    for i, a in enumerate(call.args):
        if a.kind == ArgKind.ACCESS:
            continue
        if a.key is not None:
            _keyword(f, "E215", call, i, a, sig)
            continue
        if position >= len(sig.params):
            n = len(sig.params)
            f.sink.error(
                "E215",
                f"`{call.func}` takes {n} argument{'s' if n != 1 else ''} besides its accesses; "
                f"this is one more",
                f.arg_span(call, i),
                f"write {sig.doc}",
            )
            return
        _check_arg(f, "E215", call, i, a, sig.params[position], sig)
        position += 1


def _proposes(f: Facts, call: Call, sig: Signature, v: Value) -> None:
    """A built-in model proposes what the value holds: its type and its vocabulary."""
    if sig.dtypes and v.dtype.value not in sig.dtypes:
        f.sink.error(
            "E213",
            f"`{call.func}` proposes {' or '.join(sig.dtypes)}s; `{v.name}` holds {v.dtype.value}s",
            name_span(call),
            _override(call.func),
        )
    elif sig.vocab is not None and v.vocab is not None and f.bound(v.vocab):
        try:
            vocab = evaluate(v.vocab, f.env)
        except EvalError:
            vocab = sig.vocab
        if vocab != sig.vocab:
            f.sink.error(
                "E213",
                f"`{call.func}` proposes tokens of a vocabulary of {sig.vocab}; "
                f"`{v.name}` has {vocab}",
                name_span(call),
                f"declare `{v.name}` with Token[{sig.vocab}], or bind another model",
            )


def _keyword(f: Facts, code: str, call: Call, i: int, a: Arg, sig: Signature) -> None:
    """A keyword argument of a built-in: one it declares, of a kind and value it accepts."""
    assert a.key is not None
    prm = sig.param(a.key)
    if prm is None:
        near = suggest(a.key, [p.name for p in sig.params])
        f.sink.error(
            code,
            f"`{call.func}` has no argument `{a.key}`",
            f.arg_span(call, i),
            (near + "; " if near else "")
            + (
                "arguments: " + ", ".join(p.name for p in sig.params)
                if sig.params
                else f"`{call.func}` takes reads only"
            )
            + "; "
            + _override(call.func),
        )
        return
    _check_arg(f, code, call, i, a, prm, sig)


def _override(name: str) -> str:
    """How to use one's own model of a built-in's name (the check then holds it to its own
    Python signature): the hint of the errors a binding of the name would answer."""
    return (
        f"a binding of your own named `{name}` overrides the built-in (--bind MODULE; in "
        f'Python lmpm.compile(path, bindings={{"{name}": ...}}))'
    )


def _check_arg(
    f: Facts, code: str, call: Call, i: int, a: Arg, prm: SigParam, sig: Signature
) -> None:
    if a.kind.value not in prm.kinds:
        _arg_error(f, code, call, i, a, prm, sig)
        return
    if prm.choices and a.kind in (ArgKind.STR, ArgKind.NAME) and a.value not in prm.choices:
        near = suggest(str(a.value), list(prm.choices))
        f.sink.error(
            code,
            f"`{call.func}`: {prm.name} `{a.value}` is not one of " + ", ".join(prm.choices),
            f.arg_span(call, i, value=True),
            near or f"write {sig.doc}",
        )
        return
    value: float | None = None
    if a.kind in (ArgKind.INT, ArgKind.FLOAT):
        value = float(a.value)  # type: ignore[arg-type]
    elif a.kind == ArgKind.EXPR and a.expr is not None:
        try:
            value = evaluate(a.expr, f.env)
        except EvalError:
            value = None  # uses the epoch or a variable: decided at run time
    if value is None:
        return
    if (prm.minimum is not None and value < prm.minimum) or (prm.positive and value <= 0):
        bound = f"at least {prm.minimum:g}" if prm.minimum is not None else "above 0"
        f.sink.error(
            code,
            f"`{call.func}`: {prm.name} must be {bound}, got {value:g}",
            f.arg_span(call, i, value=True),
        )


def _arg_error(
    f: Facts, code: str, call: Call, i: int, a: Arg, prm: SigParam, sig: Signature
) -> None:
    words = [_KIND_WORDS.get(k, k) for k in prm.kinds]
    kinds = ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
    got = _KIND_WORDS.get(a.kind.value, a.kind.value)
    if a.kind in (ArgKind.STR, ArgKind.NAME):
        got += f" `{a.value}`" if a.kind == ArgKind.NAME else f' "{a.value}"'
    hint = f"write {sig.doc}"
    if a.kind == ArgKind.STR and "float" in prm.kinds and _number(str(a.value)):
        hint = f"write the number without quotes: {a.value}"
    elif a.kind == ArgKind.NAME and "expr" in prm.kinds:
        hint = f"`{a.value}` is no parameter: declare `param {a.value} = ...`, or {hint}"
    f.sink.error(
        code,
        f"`{call.func}`: {prm.name} must be {kinds}, got {got}",
        f.arg_span(call, i, value=True),
        hint,
    )


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_KIND_WORDS = {
    "int": "an integer",
    "float": "a decimal",
    "expr": "an integer expression",
    "str": "a string",
    "name": "a name",
    "call": "a call",
    "read": "a read",
    "access": "an access",
    "forward": "`...`",
    "of": "`k of n`",
}


def _input_names(r: Rule, call: Call) -> set[str]:
    """The input names ``call`` sees in rule ``r`` (as lmpm.resolve.plan passes them): a model
    sees each read under the keyword(s) of the arguments naming it, else under its own name; a
    score sees the reads its arguments name, or with `...` what the model sees."""
    if call is r.score and not any(a.kind == ArgKind.FORWARD for a in call.args):
        return {str(a.value) for a in call.args if a.kind == ArgKind.READ}
    keyed: dict[str, list[str]] = {}
    for a in r.proposal.args:
        if a.kind == ArgKind.READ:
            keyed.setdefault(str(a.value), []).append(a.key or str(a.value))
    names: set[str] = set()
    for rd in r.reads:
        names.update(keyed.get(rd.name, [rd.name]))
    return names


def _registered_policy(name: str) -> bool:
    """A commit policy registered in this process with ``lmpm.resolve.policies.register`` (looked
    up only if that module is already loaded: the checker never imports torch)."""
    policies = sys.modules.get("lmpm.resolve.policies")
    return policies is not None and name in getattr(policies, "POLICIES", {})
