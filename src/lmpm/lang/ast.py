"""The LMPM abstract syntax tree: frozen, slotted dataclasses, a source span on every node.

Expressions are syntax only; the IR builder decides what each one means in its position.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmpm.errors import Span

# ---- expressions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Int:
    value: int
    span: Span


@dataclass(frozen=True, slots=True)
class Float:
    """A decimal literal (`0.7`, `1e-3`); `text` is the literal as written."""

    value: float
    text: str
    span: Span


@dataclass(frozen=True, slots=True)
class Str:
    value: str
    span: Span


@dataclass(frozen=True, slots=True)
class Name:
    id: str
    span: Span


@dataclass(frozen=True, slots=True)
class Star:
    """`*` in an index position: a whole axis (alone: the whole value)."""

    span: Span


@dataclass(frozen=True, slots=True)
class Dots:
    """`...` as a call argument: forward the rule's reads and its proposal."""

    span: Span


@dataclass(frozen=True, slots=True)
class Arg:
    name: str | None  # keyword name, or None for a positional argument
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Call:
    func: str
    args: tuple[Arg, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Subscript:
    base: Expr
    indices: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Optional:
    """`X?`: a read that may find no committed cell."""

    inner: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Tuple:
    items: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Range:
    """`lo..hi`, inclusive at both ends."""

    lo: Expr
    hi: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class BinOp:
    op: str  # one of + - * / %   (`/` is floor division)
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Neg:
    operand: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Cmp:
    op: str  # one of < <= > >= == !=
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class In:
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class And:
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Or:
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Not:
    operand: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Of:
    """`k of n` as a call argument: a count out of a total (`quorum(2 of 3, satisfy)`)."""

    count: Expr
    total: Expr
    span: Span


Expr = (
    Int
    | Float
    | Str
    | Name
    | Star
    | Dots
    | Call
    | Subscript
    | Optional
    | Tuple
    | Range
    | BinOp
    | Neg
    | Cmp
    | In
    | And
    | Or
    | Not
    | Of
)


def operands(e: Expr | None) -> tuple[Expr, ...]:
    """The operands of an arithmetic, comparison or boolean node (none for any other node)."""
    match e:
        case BinOp(lhs=lhs, rhs=rhs) | Cmp(lhs=lhs, rhs=rhs):
            return (lhs, rhs)
        case And(lhs=lhs, rhs=rhs) | Or(lhs=lhs, rhs=rhs):
            return (lhs, rhs)
        case Neg(operand=x) | Not(operand=x):
            return (x,)
    return ()


# ---- statements --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    default: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class TypeRef:
    name: str
    args: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class ShapeRef:
    kind: str
    dims: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Value:
    name: str
    type: TypeRef
    shape: ShapeRef
    clock: str | None
    span: Span


@dataclass(frozen=True, slots=True)
class Visible:
    target: Expr
    source: Expr
    guard: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class On:
    pattern: Expr
    guard: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class Read:
    items: tuple[Arg, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Emit:
    target: Expr
    call: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Score:
    call: Expr
    span: Span


RuleStmt = On | Read | Emit | Score


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    body: tuple[RuleStmt, ...]
    span: Span
    name_span: Span


@dataclass(frozen=True, slots=True)
class Constraint:
    name: str
    kind: str  # "forbid" | "require"
    pred: Expr
    priority: Expr
    span: Span
    name_span: Span
    hard: bool = False  # `... priority N hard`: a candidate that violates it never commits


@dataclass(frozen=True, slots=True)
class Commit:
    target: Expr
    policy: Expr
    span: Span


# ---- workflows (the token-stream VM, docs/vm.md) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Feed:
    """`feed "text"` or `feed name`: teacher-force a string literal or a per-stream input."""

    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Generate:
    """`generate [max N] [in Set(...)]`: let the model write freely."""

    max: Expr | None
    allowed: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class Until:
    """`until "pattern" [jump ZONE [limit K]]`: leave the zone when the pattern is generated."""

    pattern: Expr
    jump: str | None  # None: advance to the next zone
    limit: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class Capture:
    name: str
    span: Span


@dataclass(frozen=True, slots=True)
class ToolCall:
    """`call Tool(capture, ...)`: a bound tool on captures; its result is fed back."""

    call: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Tag:
    name: str
    span: Span


ZoneStmt = Feed | Generate | Until | Capture | ToolCall | Tag


@dataclass(frozen=True, slots=True)
class Zone:
    name: str
    body: tuple[ZoneStmt, ...]
    span: Span
    name_span: Span


@dataclass(frozen=True, slots=True)
class Workflow:
    name: str
    value: str
    zones: tuple[Zone, ...]
    span: Span
    name_span: Span
    value_span: Span


Item = Param | Value | Visible | Rule | Constraint | Commit | Workflow


@dataclass(frozen=True, slots=True)
class Program:
    file: str
    items: tuple[Item, ...]
