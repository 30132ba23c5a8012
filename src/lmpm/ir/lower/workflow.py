"""Lowering of workflows (the token-stream VM's language): a workflow's zones, each with its
feeds, its generation, its exits (`until ... jump`), its capture and its tool call."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmpm.errors import Span
from lmpm.ir.eval import EvalError, evaluate
from lmpm.ir.lower.exprs import lower_bound_call, lower_expr, lower_set_literal
from lmpm.ir.lower.scope import Scope, describe, suggest
from lmpm.ir.nodes import ArgKind, Call, DType, Exit, Expr, Feed, ShapeKind, Workflow, Zone
from lmpm.lang import ast


def lower_workflow(item: ast.Workflow, scope: Scope) -> Workflow:
    value = scope.lookup_value(item.value, item.value_span)
    if value.dtype != DType.TOKEN or value.shape not in (ShapeKind.SEQ, ShapeKind.GRID2D):
        raise scope.fail(
            "E140",
            f"workflow `{item.name}` runs on `{value.name}`, a {value.dtype.value} "
            f"{value.shape.value} value; workflows run on token streams",
            item.value_span,
            "declare `value Txt : Token[Byte] shape Grid2D(B, N)` (B streams of N tokens)",
        )
    names: dict[str, Span] = {}
    for z in item.zones:
        if z.name in names:
            raise scope.fail(
                "E141",
                f"zone `{z.name}` is already declared at line {names[z.name].line}",
                z.name_span,
                "zone names are unique within a workflow",
            )
        names[z.name] = z.name_span
    captures = {st.name for z in item.zones for st in z.body if isinstance(st, ast.Capture)}
    zones = tuple(lower_zone(z, scope, list(names), captures) for z in item.zones)
    return Workflow(item.name, value.name, zones, item.span)


@dataclass(slots=True)
class _Body:
    """A zone's statements, sorted by kind (generate, capture and the tool call at most once)."""

    feeds: list[Feed] = field(default_factory=list)
    exits: list[Exit] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    gen: ast.Generate | None = None
    capture: ast.Capture | None = None
    tool: ast.ToolCall | None = None


def lower_zone(z: ast.Zone, scope: Scope, zones: list[str], captures: set[str]) -> Zone:
    body = _body(z, zones, scope)
    _complete(z, body, scope)
    gen = body.gen
    allowed: Call | None = None
    max_tokens: Expr | None = None
    if gen is not None:
        if gen.max is not None:
            max_tokens = lower_count(gen.max, scope, "max")
        if gen.allowed is not None:
            if not (isinstance(gen.allowed, ast.Call) and gen.allowed.func == "Set"):
                raise scope.fail(
                    "E116",
                    f"`generate in` takes a `Set(...)` literal, got {describe(gen.allowed)}",
                    gen.allowed.span,
                )
            allowed = lower_set_literal(gen.allowed, scope)
    call = _tool(body.tool, captures, scope) if body.tool is not None else None
    return Zone(
        z.name,
        tuple(body.feeds),
        gen is not None,
        max_tokens,
        allowed,
        tuple(body.exits),
        body.capture.name if body.capture is not None else None,
        call,
        tuple(body.tags),
        z.span,
    )


def _body(z: ast.Zone, zones: list[str], scope: Scope) -> _Body:
    out = _Body()
    for st in z.body:
        match st:
            case ast.Feed(value=ast.Str(value=text)):
                out.feeds.append(Feed(text, None, st.span))
            case ast.Feed(value=ast.Name(id=name)):
                out.feeds.append(Feed(None, name, st.span))
            case ast.Feed(value=v):
                raise scope.fail(
                    "E142",
                    f"`feed` takes a string or the name of an input, got {describe(v)}",
                    v.span,
                    'write `feed "text"` or `feed question` (an input given per stream)',
                )
            case ast.Generate():
                if out.gen is not None:
                    raise scope.fail("E143", "a zone generates once", st.span)
                out.gen = st
            case ast.Until():
                out.exits.append(_exit(st, zones, scope))
            case ast.Capture():
                if out.capture is not None:
                    raise scope.fail("E143", "a zone captures once", st.span)
                out.capture = st
            case ast.ToolCall():
                if out.tool is not None:
                    raise scope.fail("E143", "a zone calls one tool", st.span)
                out.tool = st
            case ast.Tag(name=name):
                out.tags.append(name)
    return out


def _exit(st: ast.Until, zones: list[str], scope: Scope) -> Exit:
    """`until "pattern" [jump zone [limit K]]`."""
    pat = st.pattern
    if not isinstance(pat, ast.Str) or not pat.value:
        raise scope.fail(
            "E144",
            f"`until` takes a non-empty string pattern, got {describe(pat)}",
            pat.span,
            'write `until "."` or `until "no" jump ask`',
        )
    if st.jump is not None and st.jump not in zones:
        raise scope.fail(
            "E145",
            f"unknown zone `{st.jump}`",
            st.span,
            suggest(st.jump, zones) or "jump to a zone of this workflow",
        )
    limit = lower_count(st.limit, scope, "limit") if st.limit is not None else None
    return Exit(pat.value, st.jump, limit, st.span)


def _complete(z: ast.Zone, body: _Body, scope: Scope) -> None:
    """A zone feeds or generates, and a generation can end."""
    gen = body.gen
    if gen is None and (body.exits or body.capture is not None):
        raise scope.fail(
            "E146",
            f"zone `{z.name}` has `until` or `capture` but no `generate`",
            z.name_span,
            "add `generate` (triggers and captures watch generated tokens)",
        )
    if gen is not None and gen.max is None and not body.exits:
        raise scope.fail(
            "E146",
            f"zone `{z.name}` can generate forever: no `max` and no `until`",
            gen.span,
            'add `max N` or `until "pattern"`',
        )
    if gen is None and not body.feeds:
        raise scope.fail(
            "E146",
            f"zone `{z.name}` neither feeds nor generates",
            z.name_span,
            'add `feed "..."` or `generate`',
        )


def _tool(tool: ast.ToolCall, captures: set[str], scope: Scope) -> Call:
    """A zone's tool call: its arguments are captures, strings and integers."""
    call = lower_bound_call(tool.call, "tool", (), scope.inner())
    for a in call.args:
        if a.kind == ArgKind.NAME and a.value not in captures:
            raise scope.fail(
                "E147",
                f"`{a.value}` is not captured by any zone of this workflow",
                tool.call.span,
                suggest(str(a.value), sorted(captures))
                or "tools take captures (`capture NAME`), strings and integers",
            )
        if a.kind not in (ArgKind.NAME, ArgKind.STR, ArgKind.INT):
            raise scope.fail(
                "E147",
                "tools take captures (`capture NAME`), strings and integers",
                tool.call.span,
            )
    return call


def lower_count(e: ast.Expr, scope: Scope, what: str) -> Expr:
    """A positive count (`max`, `limit`): an integer or a parameter expression."""
    out = lower_expr(e, scope.inner())
    try:
        n = evaluate(out, scope.param_defaults())
    except EvalError:
        return out  # decided by the checker once parameters are bound
    if n < 1:
        raise scope.fail("E148", f"`{what}` must be at least 1, got {n}", e.span)
    return out
