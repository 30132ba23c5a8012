"""AST → Lamport IR: the driver of the lowerings. Resolves names and gives each expression its
meaning in its position.

Declarations come first, in order, so later statements may use any value; then each statement is
lowered by its sub-language's module over one shared :class:`~lmpm.ir.lower.scope.Scope`:
the core (:mod:`lmpm.ir.lower.core`), training values (:mod:`lmpm.ir.lower.train`) and workflows
(:mod:`lmpm.ir.lower.workflow`). Structural faults (unknown names, rank mismatches, misplaced
constructs) are collected as diagnostics, one per statement; semantic checks over the finished IR
live in :mod:`lmpm.ir.check`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from lmpm.errors import DiagnosticSink, Span
from lmpm.ir.lower import core, train, workflow
from lmpm.ir.lower.exprs import lower_expr
from lmpm.ir.lower.scope import TYPES, Declared, Lowered, Scope, Skip
from lmpm.ir.nodes import (
    IR_VERSION,
    Commit,
    Constraint,
    DType,
    Param,
    Program,
    Rule,
    Value,
)
from lmpm.lang import ast

MAX_DEPTH = 200  # deeper expressions are refused (E199): every later pass may recurse on them


def _too_deep(item: ast.Item) -> bool:
    """Whether any expression in ``item`` nests deeper than MAX_DEPTH (checked without recursion)."""
    stack: list[tuple[object, int]] = [(item, 0)]
    while stack:
        node, d = stack.pop()
        if d > MAX_DEPTH:
            return True
        span = getattr(node, "span", None)
        # Every level of nesting takes at least a character of source (an operator, a bracket, a
        # name), so a short one-line node cannot hide a deep subtree: skip it without walking.
        if (
            span is not None
            and span.line == span.end_line
            and span.end_col - span.col < MAX_DEPTH - d
        ):
            continue
        for name in getattr(node, "__slots__", ()):
            child = getattr(node, name)
            if isinstance(child, tuple):
                for c in child:
                    # a short one-line child cannot be deep (as above): not even pushed
                    sp = getattr(c, "span", None)
                    if not (
                        sp is not None
                        and sp.line == sp.end_line
                        and sp.end_col - sp.col < MAX_DEPTH - d - 1
                    ):
                        stack.append((c, d + 1))
            elif hasattr(child, "__slots__") and not isinstance(child, Span):
                stack.append((child, d + 1))
    return False


def build(prog: ast.Program, sink: DiagnosticSink | None = None) -> Program:
    """Lower an AST to IR; structural errors go to ``sink`` (raised if no sink is given)."""
    own = sink is None
    sink = sink if sink is not None else DiagnosticSink()
    scope = Scope(Declared(sink))
    deep: set[int] = set()  # items already reported as too deep
    # Declarations first, in order, so later statements may use any value (the seed declares
    # Coarse after a clause that reads it).
    for item in prog.items:
        _guarded(item, _declare, scope, deep)
    done = Lowered()
    for item in prog.items:
        if not isinstance(item, ast.Param | ast.Value):
            _guarded(item, lambda i, sc: _statement(i, sc, done), scope, deep)
    ir = Program(
        IR_VERSION,
        prog.file,
        tuple(scope.params.values()),
        tuple(scope.values.values()),
        tuple(done.stencils),
        tuple(done.rules),
        tuple(done.constraints),
        tuple(done.commits),
        tuple(done.workflows),
    )
    if own:
        sink.raise_if_errors()
    return ir


_I = TypeVar("_I", bound=ast.Item)


def _guarded(item: _I, fn: Callable[[_I, Scope], object], scope: Scope, deep: set[int]) -> None:
    """Lower one statement; a fault abandons it (the others are still lowered)."""
    if _too_deep(item):
        if id(item) not in deep:
            deep.add(id(item))
            scope.sink.error(
                "E199",
                f"an expression is nested more than {MAX_DEPTH} deep",
                item.span,
                "split the expression",
            )
        return
    try:
        fn(item, scope)
    except Skip:
        pass
    except RecursionError:
        scope.sink.error(
            "E199", "statement nested too deeply to compile", item.span, "split the expression"
        )


# ---- the sub-language of each statement --------------------------------------------------------
def _declare(item: ast.Item, scope: Scope) -> None:
    if isinstance(item, ast.Param):
        if item.name in scope.params and not scope.params[item.name].declared:
            raise scope.fail(
                "E102",
                f"param `{item.name}` is declared after its first use",
                item.span,
                "move the `param` line above the values that use it",
            )
        scope.claim(item.name, "param", item.span)
        default = lower_expr(item.default, scope.inner()) if item.default is not None else None
        scope.params[item.name] = Param(item.name, default, True, item.span)
    elif isinstance(item, ast.Value):
        scope.claim(item.name, "value", item.span)
        scope.values[item.name] = _value(item, scope)
    elif isinstance(item, ast.Rule | ast.Constraint | ast.Workflow):
        scope.claim(item.name, _KIND[type(item)], item.name_span)


_KIND: dict[type, str] = {ast.Rule: "rule", ast.Constraint: "constraint", ast.Workflow: "workflow"}


def _statement(item: ast.Item, scope: Scope, done: Lowered) -> None:
    """Lower one statement (not a declaration) into ``done``, by its sub-language."""
    match item:
        case ast.Visible():
            done.stencils.append(core.lower_visible(item, scope))
        case ast.Rule():
            done.rules.append(_rule(item, scope))
        case ast.Constraint():
            done.constraints.append(_constraint(item, scope))
        case ast.Commit():
            done.commits.append(_commit(item, scope))
        case ast.Workflow():
            done.workflows.append(workflow.lower_workflow(item, scope))


def _value(item: ast.Value, scope: Scope) -> Value:
    if TYPES.get(item.type.name) == DType.PARAMS:
        return train.lower_params_value(item, scope)
    return core.lower_value(item, scope)


def _rule(item: ast.Rule, scope: Scope) -> Rule:
    parts = core.rule_parts(item, scope)
    if parts.target.dtype == DType.PARAMS:
        return train.lower_minimize_rule(item, parts, scope)
    return core.lower_rule(item, parts, scope)


def _constraint(item: ast.Constraint, scope: Scope) -> Constraint:
    priority = core.lower_priority(item, scope)
    if (p := train.params_predicate(item.pred, scope)) is not None:
        core.refuse_hard(item, scope)
        return train.lower_params_constraint(item, scope, p, priority)
    return core.harden(item, core.lower_constraint(item, priority, scope), scope)


def _commit(item: ast.Commit, scope: Scope) -> Commit:
    access = core.commit_access(item, scope)
    if scope.values[access.value].dtype == DType.PARAMS:
        return Commit(access, train.lower_params_policy(item.policy, scope), item.span)
    return core.lower_commit(item, access, scope)
