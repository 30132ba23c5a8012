"""The Lamport IR: a small set of frozen, slotted dataclasses with tuple children.

Change a node with :func:`dataclasses.replace`. Integer index arithmetic, guards and predicates share
one node, :class:`Expr`, with one opcode enum. A program is values (cells with Lamport clocks),
stencils (the visibility clauses), rules (proposals), constraints (the inductive bias) and commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lmpm.errors import Span

IR_VERSION = 1


class Op(StrEnum):
    """Opcodes of :class:`Expr`. Integer ops are exact; booleans are ints 0/1."""

    CONST = "const"  # value: an int literal
    VAR = "var"  # value: an index variable, a binder variable, or the epoch `e`
    PARAM = "param"  # value: a program parameter (symbolic dim or region parameter)
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"  # floor division, as Python `//`
    MOD = "mod"  # Python `%` (sign of the divisor)
    NEG = "neg"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    AND = "and"
    OR = "or"
    NOT = "not"


BINARY_OPS = {
    "+": Op.ADD,
    "-": Op.SUB,
    "*": Op.MUL,
    "/": Op.DIV,
    "%": Op.MOD,
    "<": Op.LT,
    "<=": Op.LE,
    ">": Op.GT,
    ">=": Op.GE,
    "==": Op.EQ,
    "!=": Op.NE,
}
SYMBOL = {v: k for k, v in BINARY_OPS.items()} | {Op.AND: "and", Op.OR: "or"}


@dataclass(frozen=True, slots=True)
class Expr:
    op: Op
    args: tuple[Expr, ...] = ()
    value: int | str | None = None

    @staticmethod
    def const(v: int) -> Expr:
        return Expr(Op.CONST, (), v)

    @staticmethod
    def var(name: str) -> Expr:
        return Expr(Op.VAR, (), name)

    @staticmethod
    def param(name: str) -> Expr:
        return Expr(Op.PARAM, (), name)


TRUE = Expr.const(1)

# Offsets of each named neighbourhood, centre excluded; the number of axes it spans is len(offset).
NEIGHBORHOODS: dict[str, tuple[tuple[int, ...], ...]] = {
    "N2": ((-1,), (1,)),
    "N4": ((-1, 0), (1, 0), (0, -1), (0, 1)),
    "N8": tuple((dx, dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1) if (dx, dy) != (0, 0)),
    "N6": ((-1, 0, 0), (1, 0, 0), (0, -1, 0), (0, 1, 0), (0, 0, -1), (0, 0, 1)),
    "N26": tuple(
        (a, b, c)
        for a in (-1, 0, 1)
        for b in (-1, 0, 1)
        for c in (-1, 0, 1)
        if (a, b, c) != (0, 0, 0)
    ),
}


class AxisKind(StrEnum):
    AT = "at"  # one index: lo
    RANGE = "range"  # lo..hi inclusive
    ALL = "all"  # the whole axis
    REGION = "region"  # a bound call selecting cells over `width` axes (e.g. region("sky"))
    GLOB = (
        "glob"  # Params values: the cells whose names match `pattern` (fnmatch), `Theta["pos.*"]`
    )


@dataclass(frozen=True, slots=True)
class Axis:
    kind: AxisKind
    lo: Expr | None = None
    hi: Expr | None = None
    call: Call | None = None
    width: int = 1  # axes covered (REGION may cover several)
    pattern: str | None = None  # GLOB: an fnmatch pattern over cell names (`blocks.*`)


@dataclass(frozen=True, slots=True)
class Binder:
    """`(dx,dy) in N8` or `d in -2..2`: variables ranging over offsets."""

    vars: tuple[str, ...]
    neighborhood: str | None = None  # N4 N8 (2-D), N6 N26 (3-D), N2 (1-D)
    lo: Expr | None = None  # for a range domain
    hi: Expr | None = None


class ArgKind(StrEnum):
    READ = "read"  # value: the name of a rule read
    INT = "int"  # value: int
    FLOAT = "float"  # value: float (a decimal literal, e.g. temperature=0.7)
    STR = "str"  # value: str
    NAME = "name"  # value: a bare identifier (e.g. a policy option) or an unbound name
    EXPR = "expr"  # expr: integer expression (may use the epoch `e`)
    CALL = "call"  # call: a nested call
    ACCESS = "access"  # access: a cell pattern
    FORWARD = "forward"  # `...`: the rule's reads and proposal
    OF = "of"  # parts: (count, total), each an INT or EXPR arg: `k of n` (quorum(2 of 3, ...))


@dataclass(frozen=True, slots=True)
class Arg:
    kind: ArgKind
    key: str | None = None  # keyword name; None when positional
    value: int | float | str | None = None
    expr: Expr | None = None
    call: Call | None = None
    access: Access | None = None
    parts: tuple[Arg, ...] = ()  # OF: (count, total)


@dataclass(frozen=True, slots=True)
class Call:
    """A call to a name bound at run time (a model, a predicate, a region, a policy...)."""

    func: str
    args: tuple[Arg, ...]
    role: str  # model | score | predicate | region | set | policy | schedule
    span: Span


@dataclass(frozen=True, slots=True)
class Access:
    """Cells of a value selected per axis, e.g. `Vid[t, x1..x2, y1..y2]`."""

    value: str
    axes: tuple[Axis, ...]
    span: Span


class DType(StrEnum):
    TOKEN = "token"
    EVENT = "event"
    RULE = "rule"
    FLOAT = "float"
    TENSOR = "tensor"
    PARAMS = "params"  # the parameters of a bound module (training programs); `module` names it


class ShapeKind(StrEnum):
    SEQ = "Seq"
    GRID2D = "Grid2D"
    GRID3D = "Grid3D"
    SET = "Set"
    TENSORS = "Tensors"  # Params: one cell per parameter tensor (named `blocks.0.attn.weight`)
    BLOCKS = "Blocks"  # Params: one cell per top-level child module (named `blocks`, `pos`)


RANK = {
    ShapeKind.SEQ: 1,
    ShapeKind.GRID2D: 2,
    ShapeKind.GRID3D: 3,
    ShapeKind.SET: 0,
    ShapeKind.TENSORS: 0,  # the cell count is known once the module is built: no grid dims
    ShapeKind.BLOCKS: 0,
}
PARAMS_SHAPES = (ShapeKind.TENSORS, ShapeKind.BLOCKS)


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    default: Expr | None
    declared: bool  # False: used but not declared (a free dim or region parameter)
    span: Span


@dataclass(frozen=True, slots=True)
class Value:
    name: str
    dtype: DType
    vocab: Expr | None  # tokens only: vocabulary size
    vocab_name: str | None  # as written, e.g. "VQ", "Byte"
    shape: ShapeKind
    dims: tuple[Expr, ...]  # one per axis; empty for Set
    axis_names: tuple[str, ...]  # canonical axis names for messages: t x y / i
    clock: str  # "Lamport"
    span: Span
    module: str | None = None  # PARAMS only: the module binding (`Params[ByteLM]` → "ByteLM")


@dataclass(frozen=True, slots=True)
class Stencil:
    """One `visible` clause: target cell `target[vars]` may read `source[axes]` where guard holds."""

    target: str
    vars: tuple[str, ...]
    source: str
    axes: tuple[Axis, ...]
    binders: tuple[Binder, ...]
    guard: Expr
    span: Span


class ReadKind(StrEnum):
    NEIGHBORS = "neighbors"  # `name in N8`: the target's own value at neighbourhood offsets
    PREV = "prev"  # `prev_frame`: the target's own value one step back on the first axis
    INDEX = "index"  # an explicit access, e.g. `Txt[*]` or `ctx = Txt[0..t-1]`
    VISIBLE = "visible"  # a bare value name: every cell of it visible to the target


@dataclass(frozen=True, slots=True)
class Read:
    name: str  # the name model arguments bind to
    kind: ReadKind
    source: str
    axes: tuple[Axis, ...]  # empty for VISIBLE
    binders: tuple[Binder, ...]
    optional: bool  # `X?`: the source may have no committed cell at all
    span: Span


class RuleKind(StrEnum):
    LOCAL = "local"  # proposes payload for cells of a Seq/Grid value
    SCHEDULE = "schedule"  # proposes events for a Set value (the open set, MaskPlan)
    MINIMIZE = "minimize"  # proposes new parameters of a Params value: `minimize(Loss(P, data))`


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    kind: RuleKind
    target: str
    vars: tuple[str, ...]
    trigger: Expr  # the `on ... when` guard (TRUE when absent)
    reads: tuple[Read, ...]
    proposal: Call
    score: Call | None
    span: Span


class PredKind(StrEnum):
    CHANGE = "change"  # change(A): the candidate differs from the committed payload on A
    READ_FUTURE = "read_future"  # read_future(A): A can read a later index on the time axis
    IN_SET = "in_set"  # A in S: the candidate's token is in the set S
    USER = "user"  # a bound predicate call


class Status(StrEnum):
    PROVED = "proved"  # holds for every candidate, decided from the IR; not evaluated at run time
    REFUTED = "refuted"  # violated by the program itself (a compile error for read_future)
    DYNAMIC = "dynamic"  # evaluated on candidates at run time


@dataclass(frozen=True, slots=True)
class Constraint:
    name: str
    kind: str  # "forbid" | "require"
    pred: PredKind
    access: Access | None  # the cells the predicate speaks about
    pattern_vars: tuple[str, ...]  # bare names in `access` that range over an axis
    set: Call | None  # IN_SET: Set(...) literal or a bound set call
    call: Call | None  # USER: the predicate call
    priority: int
    status: Status
    span: Span
    hard: bool = False  # `hard`: a candidate that violates it is never eligible (keep-current is)


@dataclass(frozen=True, slots=True)
class Commit:
    access: Access
    policy: Call
    span: Span


@dataclass(frozen=True, slots=True)
class Feed:
    """Teacher-forced text of a zone: a literal, or a per-stream input named ``input``."""

    text: str | None
    input: str | None
    span: Span


@dataclass(frozen=True, slots=True)
class Exit:
    """`until pattern [jump target [limit k]]`: the zone ends when the stream generates ``pattern``.

    ``target`` None advances to the next zone. A jump taken ``limit`` times by a stream advances
    instead (the loop bound)."""

    pattern: str
    target: str | None
    limit: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class Zone:
    """One instruction of a workflow: feed (teacher forcing), then generate until an exit fires."""

    name: str
    feeds: tuple[Feed, ...]
    generate: bool
    max_tokens: Expr | None  # generation ends (advance) after this many tokens
    allowed: Call | None  # `generate in Set(...)`: the tokens the model may write here
    exits: tuple[Exit, ...]
    capture: str | None  # the text generated in the zone (trigger included) is kept under this name
    tool: Call | None  # role "tool": a bound callable on captures; its result is fed back
    tags: tuple[str, ...]  # painted onto every token committed in the zone
    span: Span


@dataclass(frozen=True, slots=True)
class Workflow:
    """Zones run in order for every stream (the first axis of a Grid2D value; Seq: one stream)."""

    name: str
    value: str
    zones: tuple[Zone, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Program:
    version: int
    file: str
    params: tuple[Param, ...]
    values: tuple[Value, ...]
    stencils: tuple[Stencil, ...]
    rules: tuple[Rule, ...]
    constraints: tuple[Constraint, ...]
    commits: tuple[Commit, ...]
    workflows: tuple[Workflow, ...] = ()

    def value(self, name: str) -> Value:
        for v in self.values:
            if v.name == name:
                return v
        raise KeyError(name)

    def stencils_into(self, target: str) -> tuple[Stencil, ...]:
        return tuple(s for s in self.stencils if s.target == target)

    def calls(self) -> list[Call]:
        """Every bound-name call in the program, in source order."""
        out: list[Call] = []

        def walk(c: Call | None) -> None:
            if c is None:
                return
            out.append(c)
            for a in c.args:
                walk(a.call)
                if a.access is not None:
                    for ax in a.access.axes:
                        walk(ax.call)

        def walk_axes(axes: tuple[Axis, ...]) -> None:
            for ax in axes:
                walk(ax.call)

        for s in self.stencils:
            walk_axes(s.axes)
        for r in self.rules:
            for rd in r.reads:
                walk_axes(rd.axes)
            walk(r.proposal)
            walk(r.score)
        for c in self.constraints:
            if c.access is not None:
                walk_axes(c.access.axes)
            walk(c.set)
            walk(c.call)
        for cm in self.commits:
            walk(cm.policy)
        for w in self.workflows:
            for z in w.zones:
                walk(z.allowed)
                walk(z.tool)
        return out
