"""AST → Lamport IR. Resolves names and gives each expression its meaning in its position.

Structural faults (unknown names, rank mismatches, misplaced constructs) are collected as diagnostics;
semantic checks over the finished IR live in :mod:`lmpm.ir.check`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lmpm.errors import DiagnosticSink, Span
from lmpm.ir.eval import EvalError, evaluate, names_in
from lmpm.ir.nodes import (
    BINARY_OPS,
    IR_VERSION,
    NEIGHBORHOODS,
    PARAMS_SHAPES,
    RANK,
    TRUE,
    Access,
    Arg,
    ArgKind,
    Axis,
    AxisKind,
    Binder,
    Call,
    Commit,
    Constraint,
    DType,
    Exit,
    Expr,
    Feed,
    Op,
    Param,
    PredKind,
    Program,
    Read,
    ReadKind,
    Rule,
    RuleKind,
    ShapeKind,
    Status,
    Stencil,
    Value,
    Workflow,
    Zone,
)
from lmpm.ir.printer import read_str
from lmpm.lang import ast
from lmpm.train.spec import OPTIMIZERS, SCHEDULES

VOCABS = {"Byte": 256}  # built-in vocabularies
EPOCH_VAR = "e"  # the epoch number, usable in every rule's call arguments
PREV_READ = "prev_frame"  # the target's own value one step back on the first axis
AXIS_NAMES = {
    ShapeKind.SEQ: ("t",),
    ShapeKind.GRID2D: ("x", "y"),
    ShapeKind.GRID3D: ("t", "x", "y"),
    ShapeKind.SET: (),
}
TYPES = {
    "Token": DType.TOKEN,
    "Event": DType.EVENT,
    "Rule": DType.RULE,
    "Float": DType.FLOAT,
    "Tensor": DType.TENSOR,
    "Params": DType.PARAMS,
}
BUILTIN_PREDICATES = {"change": PredKind.CHANGE, "read_future": PredKind.READ_FUTURE}

# ---- training values: `minimize` options (lmpm.train.spec.MinimizeSpec) ----
MINIMIZE = "minimize"
NORM_PREDICATE = "NormAtMost"
# (kind, lower bound, lower bound excluded, upper bound excluded, choices); kind int|number|choice
_Opt = tuple[str, float | None, bool, float | None, tuple[str, ...]]
MINIMIZE_OPTIONS: dict[str, _Opt] = {
    "steps": ("int", 1, False, None, ()),  # inner optimizer steps per epoch (H)
    "batch": ("int", 1, False, None, ()),  # rows per inner step per worker
    "optimizer": ("choice", None, False, None, OPTIMIZERS),
    "lr": ("number", 0, True, None, ()),
    "weight_decay": ("number", 0, False, None, ()),
    "momentum": ("number", 0, False, 1, ()),  # sgd only
    "clip": ("number", 0, True, None, ()),  # global grad-norm clip
    "schedule": ("choice", None, False, None, SCHEDULES),
    "warmup": ("int", 0, False, None, ()),
    "seed": ("int", None, False, None, ()),
}
DILOCO_OPTIONS = ("outer_lr", "momentum", "nesterov")


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


class _Skip(Exception):
    """Abandon the current statement after a diagnostic was recorded."""


@dataclass
class _Scope:
    """Names an expression may use, and what each one means."""

    vars: set[str] = field(default_factory=set)  # index / binder / pattern variables
    allow_epoch: bool = False
    free_params: bool = False  # unknown names become implicit (region) parameters


class Builder:
    def __init__(self, file: str, sink: DiagnosticSink) -> None:
        self.file = file
        self.sink = sink
        self.params: dict[str, Param] = {}
        self.values: dict[str, Value] = {}
        self.names: dict[str, tuple[str, Span]] = {}  # top-level name -> (kind, span)
        self._defaults: dict[str, int] | None = None
        self._deep: set[int] = set()  # items already reported as too deep

    # ---- entry ---------------------------------------------------------------------------------
    def build(self, prog: ast.Program) -> Program:
        # Declarations first, in order, so later statements may use any value (the seed declares
        # Coarse after a clause that reads it).
        for item in prog.items:
            self._guarded(item, self._declare)
        stencils: list[Stencil] = []
        rules: list[Rule] = []
        constraints: list[Constraint] = []
        commits: list[Commit] = []
        workflows: list[Workflow] = []
        for item in prog.items:
            if isinstance(item, ast.Visible):
                self._guarded(item, lambda i: stencils.append(self._visible(i)))
            elif isinstance(item, ast.Rule):
                self._guarded(item, lambda i: rules.append(self._rule(i)))
            elif isinstance(item, ast.Constraint):
                self._guarded(
                    item, lambda i: constraints.append(self._hard(i, self._constraint(i)))
                )
            elif isinstance(item, ast.Commit):
                self._guarded(item, lambda i: commits.append(self._commit(i)))
            elif isinstance(item, ast.Workflow):
                self._guarded(item, lambda i: workflows.append(self._workflow(i)))
        self._training_scope(rules, constraints, commits, workflows)
        return Program(
            IR_VERSION,
            self.file,
            tuple(self.params.values()),
            tuple(self.values.values()),
            tuple(stencils),
            tuple(rules),
            tuple(constraints),
            tuple(commits),
            tuple(workflows),
        )

    def _guarded(self, item: ast.Item, fn: object) -> None:
        if _too_deep(item):
            if id(item) not in self._deep:
                self._deep.add(id(item))
                self.sink.error(
                    "E199",
                    f"an expression is nested more than {MAX_DEPTH} deep",
                    item.span,
                    "split the expression",
                )
            return
        try:
            fn(item)  # type: ignore[operator]
        except _Skip:
            pass
        except RecursionError:
            self.sink.error(
                "E199", "statement nested too deeply to compile", item.span, "split the expression"
            )

    def _fail(self, code: str, msg: str, span: Span, hint: str | None = None) -> _Skip:
        self.sink.error(code, msg, span, hint)
        return _Skip()

    # ---- declarations --------------------------------------------------------------------------
    def _claim(self, name: str, kind: str, span: Span) -> None:
        if name in self.names:
            prev_kind, prev = self.names[name]
            raise self._fail(
                "E102",
                f"`{name}` is already declared as a {prev_kind} at line {prev.line}",
                span,
                "pick another name",
            )
        self.names[name] = (kind, span)

    def _declare(self, item: ast.Item) -> None:
        if isinstance(item, ast.Param):
            if item.name in self.params and not self.params[item.name].declared:
                raise self._fail(
                    "E102",
                    f"param `{item.name}` is declared after its first use",
                    item.span,
                    "move the `param` line above the values that use it",
                )
            self._claim(item.name, "param", item.span)
            default = self._expr(item.default, _Scope()) if item.default is not None else None
            self.params[item.name] = Param(item.name, default, True, item.span)
        elif isinstance(item, ast.Value):
            self._claim(item.name, "value", item.span)
            self.values[item.name] = self._value(item)
        elif isinstance(item, ast.Rule):
            self._claim(item.name, "rule", item.name_span)
        elif isinstance(item, ast.Constraint):
            self._claim(item.name, "constraint", item.name_span)
        elif isinstance(item, ast.Workflow):
            self._claim(item.name, "workflow", item.name_span)

    def _declared_param(self, name: str) -> bool:
        # An implicit parameter (a free name elsewhere) does not stop a statement from using the
        # same name as its own index variable: variables are looked up before parameters.
        return name in self.params and self.params[name].declared

    def _implicit_param(self, name: str, span: Span) -> Expr:
        if name not in self.params:
            self.params[name] = Param(name, None, False, span)
        return Expr.param(name)

    def _value(self, v: ast.Value) -> Value:
        t = v.type
        if t.name not in TYPES:
            raise self._fail(
                "E105",
                f"unknown type `{t.name}`",
                t.span,
                "types are Token[V], Event, Rule, Float, Tensor[D], Params[Module]",
            )
        dtype = TYPES[t.name]
        if dtype == DType.PARAMS:
            return self._params_value(v)
        if v.shape.kind in {k.value for k in PARAMS_SHAPES}:
            raise self._fail(
                "E150",
                f"`{v.shape.kind}()` is the shape of a Params value; `{v.name}` holds "
                f"{dtype.value}s",
                v.shape.span,
                "write `value P : Params[Module] shape Tensors()` (or `Blocks()`)",
            )
        vocab: Expr | None = None
        vocab_name: str | None = None
        if dtype in (DType.TOKEN, DType.TENSOR):
            if len(t.args) != 1:
                raise self._fail(
                    "E105",
                    f"`{t.name}` takes one argument, got {len(t.args)}",
                    t.span,
                    f"write {t.name}[Byte], {t.name}[VQ] or {t.name}[16]",
                )
            a = t.args[0]
            if isinstance(a, ast.Name) and a.id in VOCABS and a.id not in self.params:
                vocab, vocab_name = Expr.const(VOCABS[a.id]), a.id
            elif isinstance(a, ast.Name):
                vocab, vocab_name = self._param_ref(a.id, a.span), a.id
            else:
                vocab = self._expr(a, _Scope())
        elif t.args:
            raise self._fail("E105", f"`{t.name}` takes no arguments", t.span)
        shape = v.shape
        kinds = {k.value: k for k in ShapeKind}
        if shape.kind not in kinds:
            raise self._fail(
                "E106",
                f"unknown shape `{shape.kind}`",
                shape.span,
                "shapes are Seq(N), Grid2D(W,H), Grid3D(T,W,H), Set(); Params values: "
                "Tensors(), Blocks()",
            )
        kind = kinds[shape.kind]
        if len(shape.dims) != RANK[kind]:
            raise self._fail(
                "E106",
                f"{kind.value} takes {RANK[kind]} dimension(s), got {len(shape.dims)}",
                shape.span,
            )
        dims = tuple(self._expr(d, _Scope(free_params=True)) for d in shape.dims)
        if v.clock is not None and v.clock != "Lamport":
            raise self._fail("E105", f"unknown clock `{v.clock}`", v.span, "the clock is `Lamport`")
        if kind == ShapeKind.SET and dtype not in (DType.EVENT, DType.RULE):
            self.sink.warning(
                "W105",
                f"Set value `{v.name}` holds {dtype.value}s; Set values are "
                "CRDT logs of events or rules",
                shape.span,
            )
        return Value(
            v.name, dtype, vocab, vocab_name, kind, dims, AXIS_NAMES[kind], "Lamport", v.span
        )

    def _param_ref(self, name: str, span: Span) -> Expr:
        if name in self.params:
            return Expr.param(name)
        if name in self.names:
            kind, _ = self.names[name]
            raise self._fail("E108", f"`{name}` is a {kind}, not a number", span)
        return self._implicit_param(name, span)

    # ---- expressions ---------------------------------------------------------------------------
    def _expr(self, e: ast.Expr, scope: _Scope) -> Expr:
        """An integer or boolean expression."""
        match e:
            case ast.Int(value=v):
                return Expr.const(v)
            case ast.Name(id=n, span=sp):
                if n in scope.vars:
                    return Expr.var(n)
                if n == EPOCH_VAR and scope.allow_epoch:
                    return Expr.var(n)
                if n in self.params:
                    return Expr.param(n)
                if n in self.names:
                    kind, _ = self.names[n]
                    raise self._fail("E108", f"`{n}` is a {kind}, not a number", sp)
                if scope.free_params:
                    return self._implicit_param(n, sp)
                known = sorted(scope.vars)
                raise self._fail(
                    "E110",
                    f"unknown name `{n}`",
                    sp,
                    (f"names here: {', '.join(known)}; " if known else "")
                    + f"declare a parameter with `param {n} = ...`",
                )
            case ast.BinOp(op=op, lhs=lhs, rhs=rhs):
                return Expr(BINARY_OPS[op], (self._expr(lhs, scope), self._expr(rhs, scope)))
            case ast.Neg(operand=x):
                inner = self._expr(x, scope)
                if inner.op == Op.CONST and isinstance(inner.value, int):
                    return Expr.const(-inner.value)
                return Expr(Op.NEG, (inner,))
            case ast.Cmp(op=op, lhs=lhs, rhs=rhs):
                return Expr(BINARY_OPS[op], (self._expr(lhs, scope), self._expr(rhs, scope)))
            case ast.And(lhs=lhs, rhs=rhs):
                return Expr(Op.AND, (self._expr(lhs, scope), self._expr(rhs, scope)))
            case ast.Or(lhs=lhs, rhs=rhs):
                return Expr(Op.OR, (self._expr(lhs, scope), self._expr(rhs, scope)))
            case ast.Not(operand=x):
                return Expr(Op.NOT, (self._expr(x, scope),))
            case ast.Float(text=t, span=sp):
                raise self._fail(
                    "E108",
                    f"the decimal `{t}` is not allowed here: sizes, indices, guards and "
                    "priorities are integers",
                    sp,
                    "decimals go in call arguments, e.g. `ByteLM(context, temperature=0.7)`",
                )
            case ast.In(span=sp):
                raise self._fail(
                    "E109",
                    "a neighbourhood binder (`(dx,dy) in N8`) may only appear "
                    "as a top-level `and` term of a `when` guard",
                    sp,
                )
            case _:
                raise self._fail(
                    "E108", f"{_describe(e)} is not allowed in an integer expression", e.span
                )

    def _access(self, e: ast.Expr, scope: _Scope, *, what: str) -> Access:
        """`Value[indices]` or a bare `Value` (all its cells)."""
        if (p := self._params_of(e)) is not None:
            return self._params_access(e, p)
        if isinstance(e, ast.Name):
            v = self._lookup_value(e.id, e.span)
            return Access(v.name, tuple(Axis(AxisKind.ALL) for _ in v.dims), e.span)
        if not (isinstance(e, ast.Subscript) and isinstance(e.base, ast.Name)):
            raise self._fail(
                "E108",
                f"{what} must be a value access like `Vid[t,x,y]`, got {_describe(e)}",
                e.span,
            )
        v = self._lookup_value(e.base.id, e.base.span)
        if v.shape == ShapeKind.SET:
            raise self._fail(
                "E104",
                f"`{v.name}` is a Set value and has no cells to index",
                e.span,
                f"write `{v.name}` without brackets",
            )
        rank = len(v.dims)
        idx = e.indices
        if len(idx) == 1 and isinstance(idx[0], ast.Star) and rank > 1:
            return Access(v.name, tuple(Axis(AxisKind.ALL) for _ in range(rank)), e.span)
        regions = [i for i in idx if isinstance(i, ast.Call)]
        if len(regions) > 1:
            raise self._fail("E103", "at most one region call per access", regions[1].span)
        width = rank - (len(idx) - 1) if regions else 1
        covered = len(idx) - len(regions) + (width if regions else 0)
        if covered != rank or (regions and width < 1):
            raise self._fail(
                "E103",
                f"`{v.name}` is {v.shape.value} with {rank} ax"
                f"{'i' if rank == 1 else 'e'}s ({', '.join(v.axis_names)}), "
                f"but this access gives {len(idx)} ind{'ex' if len(idx) == 1 else 'ices'}",
                e.span,
                f"write `{v.name}[{', '.join(v.axis_names)}]`",
            )
        axes = tuple(self._axis(i, scope, width) for i in idx)
        return Access(v.name, axes, e.span)

    def _axis(self, i: ast.Expr, scope: _Scope, width: int) -> Axis:
        match i:
            case ast.Star():
                return Axis(AxisKind.ALL)
            case ast.Range(lo=lo, hi=hi):
                return Axis(
                    AxisKind.RANGE,
                    self._index_expr(lo, scope),
                    self._index_expr(hi, scope),
                )
            case ast.Call():
                return Axis(
                    AxisKind.REGION, call=self._bound_call(i, "region", (), scope), width=width
                )
            case _:
                return Axis(AxisKind.AT, self._index_expr(i, scope))

    def _index_expr(self, e: ast.Expr, scope: _Scope) -> Expr:
        """An index: affine in the index variables, plus floor division and modulo by constants.

        The checker's probing (and the visibility compiler's stencils) rely on this shape."""
        out = self._expr(e, scope)
        bad = _non_affine(out, e)
        if bad is not None:
            node, why = bad
            raise self._fail(
                "E114",
                f"index `{_src(node)}` {why}",
                node.span,
                "indices are affine in the index variables: `x+dx`, `2*x`, `x/8`, `t-1`",
            )
        return out

    def _lookup_value(self, name: str, span: Span) -> Value:
        if name in self.values:
            return self.values[name]
        if name in self.names:
            kind, _ = self.names[name]
            if kind == "value":
                raise _Skip()  # its declaration failed, and said so
            raise self._fail("E101", f"`{name}` is a {kind}, not a value", span)
        raise self._fail(
            "E101",
            f"unknown value `{name}`",
            span,
            _suggest(name, list(self.values)) or "declare it with `value NAME : TYPE shape SHAPE`",
        )

    def _target(self, e: ast.Expr, *, what: str) -> tuple[Value, tuple[str, ...]]:
        """`Vid[t,x,y]` with distinct variable names (or a bare Set or Params value)."""
        if (p := self._params_of(e)) is not None:
            access = self._params_access(e, p)
            if access.axes[0].kind != AxisKind.ALL:
                raise self._fail(
                    "E151",
                    f"{what} is the whole Params value `{p.name}`, not some of its cells",
                    e.span,
                    f"write `{p.name}[*]`",
                )
            return p, ()
        if isinstance(e, ast.Name):
            v = self._lookup_value(e.id, e.span)
            if v.shape != ShapeKind.SET:
                raise self._fail(
                    "E107",
                    f"{what} `{v.name}` needs index variables",
                    e.span,
                    f"write `{v.name}[{', '.join(v.axis_names)}]`",
                )
            return v, ()
        if not (isinstance(e, ast.Subscript) and isinstance(e.base, ast.Name)):
            raise self._fail(
                "E107", f"{what} must look like `Vid[t,x,y]`, got {_describe(e)}", e.span
            )
        v = self._lookup_value(e.base.id, e.base.span)
        if v.shape == ShapeKind.SET:
            raise self._fail(
                "E104",
                f"`{v.name}` is a Set value and has no cells to index",
                e.span,
                f"write `{v.name}` without brackets",
            )
        names: list[str] = []
        for i in e.indices:
            if not isinstance(i, ast.Name):
                raise self._fail(
                    "E107",
                    f"{what} indices must be variable names, got {_describe(i)}",
                    i.span,
                    f"write `{v.name}[{', '.join(v.axis_names)}]`; put conditions in `when`",
                )
            if self._declared_param(i.id) or i.id in self.names:
                raise self._fail(
                    "E107",
                    f"`{i.id}` is already a name in the program and cannot be an index variable",
                    i.span,
                )
            if i.id in names:
                raise self._fail("E107", f"index variable `{i.id}` is used twice", i.span)
            names.append(i.id)
        if len(names) != len(v.dims):
            raise self._fail(
                "E103",
                f"`{v.name}` is {v.shape.value} with {len(v.dims)} axes "
                f"({', '.join(v.axis_names)}), but {len(names)} index variable(s) given",
                e.span,
                f"write `{v.name}[{', '.join(v.axis_names)}]`",
            )
        return v, tuple(names)

    # ---- guards and binders --------------------------------------------------------------------
    def _split_guard(self, g: ast.Expr | None, scope: _Scope) -> tuple[tuple[Binder, ...], Expr]:
        if g is None:
            return (), TRUE
        terms: list[ast.Expr] = []

        def flatten(x: ast.Expr) -> None:
            if isinstance(x, ast.And):
                flatten(x.lhs)
                flatten(x.rhs)
            else:
                terms.append(x)

        flatten(g)
        binders: list[Binder] = []
        rest: list[ast.Expr] = []
        for t in terms:
            if isinstance(t, ast.In):
                binders.append(self._binder(t, scope))
            else:
                rest.append(t)
        guard: Expr | None = None
        for t in rest:
            ex = self._expr(t, scope)
            guard = ex if guard is None else Expr(Op.AND, (guard, ex))
        return tuple(binders), guard if guard is not None else TRUE

    def _binder(self, t: ast.In, scope: _Scope) -> Binder:
        lhs = t.lhs
        names = (
            [lhs]
            if isinstance(lhs, ast.Name)
            else list(lhs.items)
            if isinstance(lhs, ast.Tuple)
            else []
        )
        if not names or not all(isinstance(n, ast.Name) for n in names):
            raise self._fail(
                "E109",
                "the left side of `in` must be a name or a tuple of names",
                lhs.span,
                "write `(dx,dy) in N8` or `d in -2..2`",
            )
        vars_ = tuple(n.id for n in names if isinstance(n, ast.Name))
        for n in names:
            assert isinstance(n, ast.Name)
            if n.id in scope.vars or self._declared_param(n.id) or n.id in self.names:
                raise self._fail("E109", f"binder variable `{n.id}` shadows another name", n.span)
        if len(set(vars_)) != len(vars_):
            raise self._fail("E109", "binder variables must be distinct", lhs.span)
        rhs = t.rhs
        if isinstance(rhs, ast.Name):
            if rhs.id not in NEIGHBORHOODS:
                raise self._fail(
                    "E109",
                    f"unknown neighbourhood `{rhs.id}`",
                    rhs.span,
                    "neighbourhoods: " + ", ".join(NEIGHBORHOODS),
                )
            dim = len(NEIGHBORHOODS[rhs.id][0])
            if dim != len(vars_):
                raise self._fail(
                    "E109",
                    f"{rhs.id} is {dim}-D but binds {len(vars_)} variable(s)",
                    t.span,
                    f"write ({', '.join(f'd{i}' for i in range(dim))}) in {rhs.id}",
                )
            scope.vars.update(vars_)
            return Binder(vars_, rhs.id)
        if isinstance(rhs, ast.Range) and len(vars_) == 1:
            lo, hi = self._expr(rhs.lo, scope), self._expr(rhs.hi, scope)
            scope.vars.update(vars_)
            return Binder(vars_, None, lo, hi)
        raise self._fail(
            "E109",
            "a binder ranges over a neighbourhood (N4, N8, N6, N26, N2) or, "
            "for one variable, a range `a..b`",
            rhs.span,
        )

    # ---- statements ----------------------------------------------------------------------------
    def _visible(self, item: ast.Visible) -> Stencil:
        for side in (item.target, item.source):
            if (p := self._params_of(side)) is not None:
                raise self._fail(
                    "E152",
                    f"`{p.name}` is a Params value; Params values take no `visible` clauses",
                    side.span,
                    "a Params value is read only by its loss: `minimize(Loss("
                    + p.name
                    + ", data), ...)`",
                )
        target, vars_ = self._target(item.target, what="the target of `visible`")
        if target.shape == ShapeKind.SET:
            raise self._fail(
                "E104",
                f"`{target.name}` is a Set value; visibility is between cells",
                item.target.span,
            )
        scope = _Scope(vars=set(vars_))
        binders, guard = self._split_guard(item.guard, scope)
        access = self._access(item.source, scope, what="the source of `visible`")
        return Stencil(target.name, vars_, access.value, access.axes, binders, guard, item.span)

    def _rule(self, item: ast.Rule) -> Rule:
        ons = [s for s in item.body if isinstance(s, ast.On)]
        reads = [s for s in item.body if isinstance(s, ast.Read)]
        emits = [s for s in item.body if isinstance(s, ast.Emit)]
        scores = [s for s in item.body if isinstance(s, ast.Score)]
        for kind, stmts in (("on", ons), ("read", reads), ("emit", emits), ("score", scores)):
            if len(stmts) > 1:
                raise self._fail(
                    "E111", f"rule `{item.name}` has more than one `{kind}`", stmts[1].span
                )
        if not ons:
            raise self._fail(
                "E111",
                f"rule `{item.name}` has no `on` pattern",
                item.name_span,
                "add `on Value[vars]` naming the cells it proposes for",
            )
        if not emits:
            raise self._fail(
                "E111",
                f"rule `{item.name}` emits nothing",
                item.name_span,
                "add `emit proposal Value[vars] := Model(...)`",
            )
        on = ons[0]
        target, vars_ = self._target(on.pattern, what="the `on` pattern")
        if target.dtype == DType.PARAMS:
            return self._minimize_rule(item, target, on, reads, emits[0], scores)
        emit_call = emits[0].call
        if isinstance(emit_call, ast.Call) and emit_call.func == MINIMIZE:
            raise self._fail(
                "E154",
                f"`minimize` proposes parameters, but `{target.name}` holds "
                f"{target.dtype.value}s: discrete cells are not differentiable",
                emit_call.span,
                "minimize a loss over a Params value: `value P : Params[Module] shape "
                "Tensors()`, then `on P[*]` ... `emit proposal P[*] := minimize(Loss(P, data), ...)`",
            )
        scope = _Scope(vars=set(vars_), allow_epoch=True)
        trigger = self._expr(on.guard, scope) if on.guard is not None else TRUE
        kind = RuleKind.SCHEDULE if target.shape == ShapeKind.SET else RuleKind.LOCAL
        rule_reads = self._reads(reads[0], target, vars_, scope) if reads else ()
        if kind == RuleKind.SCHEDULE and rule_reads:
            raise self._fail(
                "E111", "a schedule rule reads nothing; it proposes the open set", reads[0].span
            )
        emit = emits[0]
        etarget, evars = self._target(emit.target, what="the emitted cell")
        if etarget.name != target.name or evars != vars_:
            want = f"{target.name}[{', '.join(vars_)}]" if vars_ else target.name
            raise self._fail(
                "E111",
                "a rule emits proposals for the cells of its `on` pattern",
                emit.target.span,
                f"write `emit proposal {want} := ...`",
            )
        proposal = self._bound_call(
            emit.call, "schedule" if kind == RuleKind.SCHEDULE else "model", rule_reads, scope
        )
        score = self._bound_call(scores[0].call, "score", rule_reads, scope) if scores else None
        return Rule(
            item.name, kind, target.name, vars_, trigger, rule_reads, proposal, score, item.span
        )

    def _reads(
        self, stmt: ast.Read, target: Value, vars_: tuple[str, ...], scope: _Scope
    ) -> tuple[Read, ...]:
        out: list[Read] = []
        for item in stmt.items:
            rd = self._read(item, target, vars_, scope)
            if any(r.name == rd.name for r in out):
                raise self._fail(
                    "E112",
                    f"two reads are named `{rd.name}`",
                    item.span,
                    f"name one explicitly: `other = {rd.source}[...]`",
                )
            out.append(rd)
        return tuple(out)

    def _read(self, item: ast.Arg, target: Value, vars_: tuple[str, ...], scope: _Scope) -> Read:
        e = item.value
        optional = False
        if isinstance(e, ast.Optional):
            optional, e = True, e.inner
        if item.name is None and isinstance(e, ast.In):
            if not isinstance(e.lhs, ast.Name) or not isinstance(e.rhs, ast.Name):
                raise self._fail("E112", "a neighbourhood read is written `name in N8`", e.span)
            hood = e.rhs.id
            if hood not in NEIGHBORHOODS:
                raise self._fail(
                    "E109",
                    f"unknown neighbourhood `{hood}`",
                    e.rhs.span,
                    "neighbourhoods: " + ", ".join(NEIGHBORHOODS),
                )
            dim = len(NEIGHBORHOODS[hood][0])
            if dim > len(vars_):
                raise self._fail(
                    "E103",
                    f"{hood} spans {dim} axes but `{target.name}` has {len(vars_)}",
                    e.rhs.span,
                )
            offs = tuple(f"_d{i}" for i in range(dim))
            lead = len(vars_) - dim
            axes = tuple(
                Axis(AxisKind.AT, Expr.var(v))
                if k < lead
                else Axis(AxisKind.AT, Expr(Op.ADD, (Expr.var(v), Expr.var(offs[k - lead]))))
                for k, v in enumerate(vars_)
            )
            return Read(
                e.lhs.id,
                ReadKind.NEIGHBORS,
                target.name,
                axes,
                (Binder(offs, hood),),
                optional,
                item.span,
            )
        name = item.name
        if isinstance(e, ast.Name) and e.id == PREV_READ and e.id not in self.values:
            if not vars_:
                raise self._fail("E112", "`prev_frame` needs a target with a time axis", e.span)
            axes = (
                Axis(AxisKind.AT, Expr(Op.SUB, (Expr.var(vars_[0]), Expr.const(1)))),
                *(Axis(AxisKind.AT, Expr.var(v)) for v in vars_[1:]),
            )
            return Read(
                name or PREV_READ, ReadKind.PREV, target.name, axes, (), optional, item.span
            )
        if isinstance(e, ast.Name):
            if e.id not in self.values:
                raise self._fail(
                    "E112",
                    f"unknown read `{e.id}`",
                    e.span,
                    "a read is `name in N8`, `prev_frame`, `Value`, `Value[...]` or "
                    "`name = Value[...]`"
                    + (f"; {s}" if (s := _suggest(e.id, list(self.values))) else ""),
                )
            v = self.values[e.id]
            if v.dtype == DType.PARAMS:
                raise self._fail(
                    "E153",
                    f"`{v.name}` is a Params value; rules do not read parameters as cells",
                    e.span,
                    f"a loss takes the parameters as its first argument: `Loss({v.name}, data)`",
                )
            if v.shape == ShapeKind.SET:
                raise self._fail("E104", f"`{v.name}` is a Set value; rules read cells", e.span)
            return Read(
                name or v.name.lower(), ReadKind.VISIBLE, v.name, (), (), optional, item.span
            )
        if (p := self._params_of(e)) is not None:
            raise self._fail(
                "E153",
                f"`{p.name}` is a Params value; rules do not read parameters as cells",
                e.span,
                f"a loss takes the parameters as its first argument: `Loss({p.name}, data)`",
            )
        acc = self._access(e, scope, what="a read")
        return Read(
            name or acc.value.lower(), ReadKind.INDEX, acc.value, acc.axes, (), optional, item.span
        )

    def _bound_call(self, e: ast.Expr, role: str, reads: tuple[Read, ...], scope: _Scope) -> Call:
        if isinstance(e, ast.Name):
            return Call(e.id, (), role, e.span)
        if not isinstance(e, ast.Call):
            raise self._fail(
                "E108", f"expected a call like `Model(...)`, got {_describe(e)}", e.span
            )
        args: list[Arg] = []
        for a in e.args:
            args.append(self._call_arg(a, reads, scope, role))
        return Call(e.func, tuple(args), role, e.span)

    def _call_arg(self, a: ast.Arg, reads: tuple[Read, ...], scope: _Scope, role: str) -> Arg:
        v = a.value
        key = a.name
        match v:
            case ast.Dots():
                if role != "score":
                    raise self._fail(
                        "E112",
                        "`...` forwards a rule's reads and proposal to its "
                        "score; it is only allowed in `score`",
                        v.span,
                    )
                return Arg(ArgKind.FORWARD, key)
            case ast.Int(value=n):
                return Arg(ArgKind.INT, key, n)
            case ast.Float(value=x):
                return Arg(ArgKind.FLOAT, key, x)
            case ast.Neg(operand=ast.Float(value=x)):
                return Arg(ArgKind.FLOAT, key, -x)
            case ast.Str(value=s):
                return Arg(ArgKind.STR, key, s)
            case ast.Name(id=n, span=sp):
                if n in scope.vars or (n == EPOCH_VAR and scope.allow_epoch) or n in self.params:
                    return Arg(ArgKind.EXPR, key, expr=self._expr(v, scope))
                if reads:
                    match = [r for r in reads if r.name == n] or [
                        r for r in reads if r.name.startswith(n)
                    ]
                    if len(match) == 1:
                        return Arg(ArgKind.READ, key, match[0].name)
                    names = ", ".join(r.name for r in reads)
                    if len(match) > 1:
                        raise self._fail(
                            "E112",
                            f"`{n}` could mean any of the reads {', '.join(r.name for r in match)}",
                            sp,
                            "use the full read name",
                        )
                    if role in ("model", "score") and key is None:
                        raise self._fail(
                            "E112",
                            f"`{n}` names no read of this rule",
                            sp,
                            f"the reads are: {names}",
                        )
                return Arg(ArgKind.NAME, key, n)
            case ast.Call():
                return Arg(ArgKind.CALL, key, call=self._bound_call(v, role, reads, scope))
            case ast.Subscript():
                return Arg(ArgKind.ACCESS, key, access=self._access(v, scope, what="an argument"))
            case ast.BinOp() | ast.Neg():
                return Arg(ArgKind.EXPR, key, expr=self._expr(v, scope))
            case ast.Of(count=k, total=n):
                if role != "policy":
                    raise self._fail(
                        "E108",
                        "`k of n` is only allowed as a commit policy's argument",
                        v.span,
                        "write e.g. `commit X[*] using quorum(2 of 3, satisfy)`",
                    )
                parts = tuple(self._count_arg(x, scope) for x in (k, n))
                return Arg(ArgKind.OF, key, parts=parts)
            case _:
                raise self._fail(
                    "E108", f"{_describe(v)} is not allowed as a call argument", v.span
                )

    def _count_arg(self, e: ast.Expr, scope: _Scope) -> Arg:
        """One side of `k of n`: an integer literal or an integer expression of the params."""
        if isinstance(e, ast.Int):
            return Arg(ArgKind.INT, None, e.value)
        if isinstance(e, ast.Name | ast.BinOp | ast.Neg):
            return Arg(ArgKind.EXPR, None, expr=self._expr(e, scope))
        raise self._fail(
            "E108", f"`k of n` counts with integers, got {_describe(e)}", e.span, "e.g. `2 of 3`"
        )

    def _hard(self, item: ast.Constraint, c: Constraint) -> Constraint:
        """`... priority N hard`: only a constraint on candidates' cells can be hard."""
        if not item.hard:
            return c
        if c.pred not in (PredKind.IN_SET, PredKind.USER, PredKind.CHANGE) or c.access is None:
            raise self._fail(
                "E118",
                f"`hard` applies to a constraint checked on candidates; `{c.name}` is not one",
                item.span,
                "drop `hard` (a `read_future` is proved at compile time; a training constraint "
                "on parameters is enforced as it is)",
            )
        return replace(c, hard=True)

    def _constraint(self, item: ast.Constraint) -> Constraint:
        prio = item.priority
        pexpr = self._expr(prio, _Scope())
        try:
            priority = evaluate(pexpr, self._param_defaults())
        except EvalError:
            raise self._fail(
                "E113", "priority must be an integer known at compile time", prio.span
            ) from None
        pred = item.pred
        scope = _Scope(free_params=True)
        if (p := self._params_predicate(pred)) is not None:
            return self._params_constraint(item, p, priority)
        if isinstance(pred, ast.Call) and pred.func in BUILTIN_PREDICATES:
            kind = BUILTIN_PREDICATES[pred.func]
            if len(pred.args) != 1 or pred.args[0].name is not None:
                raise self._fail(
                    "E116",
                    f"`{pred.func}` takes one value access, e.g. `{pred.func}(Vid[t,x,y])`",
                    pred.span,
                )
            pvars = self._pattern_vars(pred.args[0].value, scope)
            access = self._access(pred.args[0].value, scope, what=f"the argument of `{pred.func}`")
            return Constraint(
                item.name,
                item.kind,
                kind,
                access,
                pvars,
                None,
                None,
                priority,
                Status.DYNAMIC,
                item.span,
            )
        if isinstance(pred, ast.In):
            pvars = self._pattern_vars(pred.lhs, scope)
            access = self._access(pred.lhs, scope, what="the left side of `in`")
            rhs = pred.rhs
            if isinstance(rhs, ast.Call) and rhs.func == "Set":
                set_call = self._set_literal(rhs)
            elif isinstance(rhs, ast.Call):
                set_call = self._bound_call(rhs, "set", (), _Scope())
            else:
                raise self._fail(
                    "E115",
                    "the right side of `in` must be a set: `Set(...)` or a "
                    'bound call like `Palette("blue-ish")`',
                    rhs.span,
                )
            return Constraint(
                item.name,
                item.kind,
                PredKind.IN_SET,
                access,
                pvars,
                set_call,
                None,
                priority,
                Status.DYNAMIC,
                item.span,
            )
        if isinstance(pred, ast.Call):
            pvars = ()
            for a in pred.args:
                if isinstance(a.value, ast.Subscript):
                    new = self._pattern_vars(a.value, scope)
                    pvars += tuple(v for v in dict.fromkeys(new) if v not in pvars)
            call = self._bound_call(pred, "predicate", (), scope)
            first = next((a.access for a in call.args if a.access is not None), None)
            return Constraint(
                item.name,
                item.kind,
                PredKind.USER,
                first,
                pvars,
                None,
                call,
                priority,
                Status.DYNAMIC,
                item.span,
            )
        raise self._fail(
            "E115",
            f"{_describe(pred)} is not a predicate",
            pred.span,
            "predicates: change(A), read_future(A), A in Set(...), A in Call(...), "
            "or a bound predicate Call(A, ...); `forbid not P(...)` is `require P(...)`, and "
            "`require P(...) priority N hard` is a bound no commit may break",
        )

    def _pattern_vars(self, e: ast.Expr, scope: _Scope) -> tuple[str, ...]:
        """Bare names used directly as indices range over their axis (pattern variables)."""
        if not isinstance(e, ast.Subscript):
            return ()
        out = []
        for i in e.indices:
            if isinstance(i, ast.Name) and i.id not in self.params and i.id not in self.names:
                out.append(i.id)
        scope.vars.update(out)
        return tuple(out)

    def _set_literal(self, c: ast.Call) -> Call:
        args: list[Arg] = []
        for a in c.args:
            v = a.value
            if a.name is not None:
                raise self._fail("E116", "Set(...) takes no keyword arguments", a.span)
            if isinstance(v, ast.Int):
                args.append(Arg(ArgKind.INT, None, v.value))
            elif isinstance(v, ast.Str):
                args.append(Arg(ArgKind.STR, None, v.value))
            elif isinstance(v, ast.Range):
                # A range is two args, `lo` then `hi`, so the printer and runtime see it plainly.
                args.append(Arg(ArgKind.EXPR, "lo", expr=self._expr(v.lo, _Scope())))
                args.append(Arg(ArgKind.EXPR, "hi", expr=self._expr(v.hi, _Scope())))
            elif isinstance(v, ast.Name) and v.id in self.params:
                args.append(Arg(ArgKind.EXPR, None, expr=Expr.param(v.id)))
            else:
                raise self._fail(
                    "E116",
                    f"Set(...) holds integers, ranges `a..b` and strings, got {_describe(v)}",
                    v.span,
                )
        return Call("Set", tuple(args), "set", c.span)

    def _commit(self, item: ast.Commit) -> Commit:
        access = self._access(item.target, _Scope(free_params=True), what="the target of `commit`")
        if any(a.kind != AxisKind.ALL for a in access.axes):
            raise self._fail(
                "E117",
                f"a commit policy applies to a whole value, not to part of `{access.value}`",
                item.target.span,
                f"write `commit {access.value}[*] using ...`",
            )
        value = self.values[access.value]
        if value.dtype == DType.PARAMS:
            return Commit(access, self._params_policy(item.policy), item.span)
        pol = item.policy
        name = (
            pol.func if isinstance(pol, ast.Call) else pol.id if isinstance(pol, ast.Name) else ""
        )
        if name == "diloco":
            raise self._fail(
                "E160",
                f"`diloco` commits a Params value; `{value.name}` holds {value.dtype.value}s",
                pol.span,
                "use it as `commit P[*] using diloco(outer_lr=0.7, momentum=0.9)` on a Params value",
            )
        policy = self._bound_call(item.policy, "policy", (), _Scope())
        return Commit(access, policy, item.span)

    # ---- training values (Params) ------------------------------------------------------------
    def _params_value(self, v: ast.Value) -> Value:
        """`value P : Params[Module] shape Tensors()|Blocks()`: cells named after the module."""
        t = v.type
        if len(t.args) != 1 or not isinstance(t.args[0], ast.Name):
            raise self._fail(
                "E150",
                "`Params` takes the name of a module binding, e.g. `Params[ByteLM]`",
                t.span,
                "write `value P : Params[ByteLM] shape Tensors()`",
            )
        shape = v.shape
        kinds = {k.value: k for k in PARAMS_SHAPES}
        if shape.kind not in kinds or shape.dims:
            raise self._fail(
                "E150",
                f"a Params value has the shape Tensors() (one cell per parameter tensor) or "
                f"Blocks() (one per top-level block), got `{shape.kind}` with "
                f"{len(shape.dims)} dimension(s)",
                shape.span,
                "write `shape Tensors()` or `shape Blocks()`",
            )
        if v.clock is not None and v.clock != "Lamport":
            raise self._fail("E105", f"unknown clock `{v.clock}`", v.span, "the clock is `Lamport`")
        kind = kinds[shape.kind]
        return Value(
            v.name, DType.PARAMS, None, None, kind, (), (), "Lamport", v.span, t.args[0].id
        )

    def _params_of(self, e: ast.Expr) -> Value | None:
        """The Params value `e` names (`P`, `P[...]`), if it names one."""
        base = e.base if isinstance(e, ast.Subscript) else e
        if isinstance(base, ast.Name):
            v = self.values.get(base.id)
            if v is not None and v.dtype == DType.PARAMS:
                return v
        return None

    def _params_access(self, e: ast.Expr, p: Value) -> Access:
        """`P`, `P[*]` (every cell) or `P["glob"]` (the cells whose names match)."""
        if isinstance(e, ast.Name):
            return Access(p.name, (Axis(AxisKind.ALL),), e.span)
        assert isinstance(e, ast.Subscript)
        idx = e.indices
        if len(idx) == 1 and isinstance(idx[0], ast.Star):
            return Access(p.name, (Axis(AxisKind.ALL),), e.span)
        if len(idx) == 1 and isinstance(idx[0], ast.Str) and idx[0].value:
            return Access(p.name, (Axis(AxisKind.GLOB, pattern=idx[0].value),), e.span)
        bad = idx[0] if len(idx) == 1 else e
        raise self._fail(
            "E151",
            f"the cells of the Params value `{p.name}` are named tensors; select them with `*` "
            f"or a name pattern, got {_describe(bad) if len(idx) == 1 else f'{len(idx)} indices'}",
            bad.span,
            f'write `{p.name}[*]` or `{p.name}["blocks.*"]` (fnmatch over names like '
            "`blocks.0.attn.weight`)",
        )

    def _minimize_rule(
        self,
        item: ast.Rule,
        target: Value,
        on: ast.On,
        reads: list[ast.Read],
        emit: ast.Emit,
        scores: list[ast.Score],
    ) -> Rule:
        if on.guard is not None:
            raise self._fail(
                "E154",
                f"rule `{item.name}` minimizes a loss every epoch; it takes no `when` guard",
                on.guard.span,
                "drop the `when ...`",
            )
        scope = _Scope()
        rule_reads = self._reads(reads[0], target, (), scope) if reads else ()
        rule_reads = tuple(self._data_read(r) for r in rule_reads)
        etarget, _ = self._target(emit.target, what="the emitted cell")
        if etarget.name != target.name:
            raise self._fail(
                "E111",
                "a rule emits proposals for the cells of its `on` pattern",
                emit.target.span,
                f"write `emit proposal {target.name}[*] := ...`",
            )
        call = emit.call
        if not (isinstance(call, ast.Call) and call.func == MINIMIZE):
            raise self._fail(
                "E154",
                f"a Params value is proposed by `minimize(...)`; rule `{item.name}` proposes "
                f"{_describe(call)}",
                call.span,
                f"write `emit proposal {target.name}[*] := minimize(Loss({target.name}, data), "
                "steps=50, batch=8)`",
            )
        proposal = self._minimize(call, target, rule_reads)
        score = self._loss(scores[0].call, target, rule_reads, "score") if scores else None
        return Rule(
            item.name,
            RuleKind.MINIMIZE,
            target.name,
            (),
            TRUE,
            rule_reads,
            proposal,
            score,
            item.span,
        )

    def _data_read(self, r: Read) -> Read:
        """A read of a minimize rule is data: a whole token value of rows (Seq or Grid2D)."""
        v = self.values[r.source]
        whole = r.kind == ReadKind.VISIBLE or (
            r.kind == ReadKind.INDEX and all(a.kind == AxisKind.ALL for a in r.axes)
        )
        if v.dtype != DType.TOKEN or v.shape not in (ShapeKind.SEQ, ShapeKind.GRID2D):
            raise self._fail(
                "E157",
                f"a loss reads token data (Seq(N): one row; Grid2D(L, R): R rows of L tokens); "
                f"`{v.name}` is a {v.dtype.value} {v.shape.value} value",
                r.span,
                "declare the data as `value Corpus : Token[Byte] shape Grid2D(64, 4096)`",
            )
        if not whole:
            raise self._fail(
                "E157",
                f"a loss reads whole data values (workers shard the rows); `{read_str(r)}` is "
                f"part of `{v.name}`",
                r.span,
                f"write `{r.name} = {v.name}[*]`",
            )
        return Read(
            r.name,
            ReadKind.INDEX,
            v.name,
            tuple(Axis(AxisKind.ALL) for _ in v.dims),
            (),
            r.optional,
            r.span,
        )

    def _loss(self, e: ast.Expr, p: Value, reads: tuple[Read, ...], what: str) -> Call:
        """`Loss(P, data...)`: the Params value first (what is differentiated), then reads."""
        form = f"`Loss({p.name}, data)`"
        if not isinstance(e, ast.Call):
            raise self._fail(
                "E155",
                f"the {what} must be a loss call {form}, got {_describe(e)}",
                e.span,
                "a loss binding takes the parameters and the data it is computed on",
            )
        args = e.args
        first = args[0].value if args else None
        if not (
            isinstance(first, ast.Name) and first.id == p.name and args[0].name is None
        ) and not (first is not None and self._params_of(first) is p):
            raise self._fail(
                "E155",
                f"`{e.func}` does not take `{p.name}` as its first argument: "
                "there is nothing to differentiate",
                args[0].span if args else e.span,
                f"write `{e.func}({p.name}, "
                + ", ".join(r.name for r in reads[:1] or ())
                + ("" if reads else "data")
                + ")`",
            )
        if first is not None and isinstance(first, ast.Subscript):
            self._params_access(first, p)  # `P[*]` only: a loss differentiates every cell
            if not isinstance(first.indices[0], ast.Star):
                raise self._fail(
                    "E155",
                    f"a loss differentiates the whole Params value; write `{p.name}`",
                    first.span,
                    f"freeze cells with `forbid change({p.name}[...])` instead",
                )
        out = [Arg(ArgKind.ACCESS, None, access=Access(p.name, (Axis(AxisKind.ALL),), first.span))]
        names = [r.name for r in reads]
        for a in args[1:]:
            v = a.value
            if a.name is not None:
                raise self._fail(
                    "E155",
                    f"a loss takes its data positionally, got `{a.name}=`",
                    a.span,
                    f"write `{e.func}({p.name}, {', '.join(names) or 'data'})`",
                )
            if self._params_of(v) is not None:
                raise self._fail(
                    "E153",
                    f"`{p.name}` as data of `{e.func}`: a Params value is what a loss "
                    "differentiates, not what it reads",
                    v.span,
                    f"pass token data: `{e.func}({p.name}, {', '.join(names) or 'data'})`",
                )
            if not (isinstance(v, ast.Name) and v.id in names):
                raise self._fail(
                    "E155",
                    f"a loss's data are the rule's reads; {_describe(v)}"
                    + (f" `{v.id}`" if isinstance(v, ast.Name) else "")
                    + " is not one",
                    v.span,
                    "the reads are: " + ", ".join(names)
                    if names
                    else "add `read {data = Corpus[*]}` to the rule",
                )
            out.append(Arg(ArgKind.READ, None, v.id))
        if len(out) == 1:
            raise self._fail(
                "E155",
                f"`{e.func}` reads no data",
                e.span,
                f"pass the data reads: `{e.func}({p.name}, {', '.join(names) or 'data'})`",
            )
        return Call(e.func, tuple(out), "loss", e.span)

    def _minimize(self, c: ast.Call, p: Value, reads: tuple[Read, ...]) -> Call:
        """`minimize(Loss(P, data...), steps=H, batch=B, ...)` with the options of MinimizeSpec."""
        if not c.args or c.args[0].name is not None:
            raise self._fail(
                "E155",
                "`minimize` takes the loss first, without a keyword",
                c.args[0].span if c.args else c.span,
                f"write `minimize(Loss({p.name}, data), steps=50, batch=8)`",
            )
        args = [Arg(ArgKind.CALL, None, call=self._loss(c.args[0].value, p, reads, "loss"))]
        seen: set[str] = set()
        for a in c.args[1:]:
            if a.name is None:
                raise self._fail(
                    "E156",
                    "`minimize` takes one loss, then keyword options",
                    a.span,
                    "options: " + ", ".join(MINIMIZE_OPTIONS),
                )
            if a.name not in MINIMIZE_OPTIONS:
                near = _suggest(a.name, list(MINIMIZE_OPTIONS))
                raise self._fail(
                    "E156",
                    f"`minimize` has no option `{a.name}`",
                    a.span,
                    (near + "; " if near else "") + "options: " + ", ".join(MINIMIZE_OPTIONS),
                )
            if a.name in seen:
                raise self._fail("E156", f"option `{a.name}` is given twice", a.span)
            seen.add(a.name)
            args.append(self._option(a.name, a.value, MINIMIZE_OPTIONS[a.name]))
        missing = [k for k in ("steps", "batch") if k not in seen]
        if missing:
            raise self._fail(
                "E156",
                f"`minimize` needs `{missing[0]}=`",
                c.span,
                "steps: inner optimizer steps per epoch; batch: rows per step per worker",
            )
        return Call(MINIMIZE, tuple(args), "minimize", c.span)

    def _option(self, key: str, v: ast.Expr, rule: _Opt) -> Arg:
        """One keyword option, its kind and range checked (params resolved with their defaults)."""
        kind, lo, _, _, choices = rule
        if kind == "choice":
            if isinstance(v, ast.Str | ast.Name):
                word = v.value if isinstance(v, ast.Str) else v.id
                if word in choices:
                    return Arg(ArgKind.STR, key, word)
            near = _suggest(v.value, list(choices)) if isinstance(v, ast.Str) else None
            raise self._fail(
                "E156",
                f"`{key}` is one of " + ", ".join(f'"{x}"' for x in choices) + f", got {_src(v)}",
                v.span,
                near or f'write `{key}="{choices[0]}"`',
            )
        if kind == "int":
            if isinstance(v, ast.Float) or not isinstance(
                v, ast.Int | ast.Name | ast.BinOp | ast.Neg
            ):
                raise self._fail(
                    "E156", f"`{key}` is an integer, got {_describe(v)}", v.span, _range(key, rule)
                )
            ex = self._expr(v, _Scope())
            env = self._param_defaults()
            try:
                n: float = evaluate(ex, env)
            except EvalError as err:
                if all(name in env for _, name in names_in(ex)):
                    raise self._fail(
                        "E156", f"`{key}` cannot be evaluated: {err}", v.span
                    ) from None
                n = lo if lo is not None else 0  # decided when the parameters are bound
            self._in_range(key, n, rule, v.span)
            if ex.op == Op.CONST:
                return Arg(ArgKind.INT, key, ex.value)
            return Arg(ArgKind.EXPR, key, expr=ex)
        x = v.operand if isinstance(v, ast.Neg) else v
        if not isinstance(x, ast.Int | ast.Float):
            raise self._fail(
                "E156", f"`{key}` is a number, got {_describe(v)}", v.span, _range(key, rule)
            )
        f = float(x.value) * (-1 if isinstance(v, ast.Neg) else 1)
        self._in_range(key, f, rule, v.span)
        return Arg(ArgKind.FLOAT, key, f)

    def _in_range(self, key: str, n: float, rule: _Opt, span: Span) -> None:
        _, lo, lo_open, hi, _ = rule
        if (lo is not None and (n < lo or (lo_open and n == lo))) or (hi is not None and n >= hi):
            raise self._fail("E156", f"`{key}` is {n:g}; {_range(key, rule)}", span)

    def _params_predicate(self, pred: ast.Expr) -> Value | None:
        """The Params value a constraint's predicate speaks about (its first operand), if any."""
        if isinstance(pred, ast.Call):
            first = pred.args[0].value if pred.args else None
            return self._params_of(first) if first is not None else None
        if isinstance(pred, ast.In):
            return self._params_of(pred.lhs)
        return None

    def _params_constraint(self, item: ast.Constraint, p: Value, priority: int) -> Constraint:
        """`forbid change(P[sel])` (freeze) or `require NormAtMost(P[sel], R)` (a norm bound)."""
        pred = item.pred
        allowed = (
            f'the constraints on a Params value are `forbid change({p.name}["pos.*"])` (freeze) '
            f'and `require {NORM_PREDICATE}({p.name}["blocks.*"], 40)` (a norm bound)'
        )
        func = pred.func if isinstance(pred, ast.Call) else None
        if func == "change" and item.kind == "forbid":
            assert isinstance(pred, ast.Call)
            if len(pred.args) != 1 or pred.args[0].name is not None:
                raise self._fail("E159", "`change` takes one access", pred.span, allowed)
            access = self._params_access(pred.args[0].value, p)
            return Constraint(
                item.name,
                item.kind,
                PredKind.CHANGE,
                access,
                (),
                None,
                None,
                priority,
                Status.DYNAMIC,
                item.span,
            )
        if func == NORM_PREDICATE and item.kind == "require":
            assert isinstance(pred, ast.Call)
            if len(pred.args) != 2 or any(a.name is not None for a in pred.args):
                raise self._fail(
                    "E159",
                    f"`{NORM_PREDICATE}` takes a Params access and a bound",
                    pred.span,
                    f'write `require {NORM_PREDICATE}({p.name}["blocks.*"], 40)`',
                )
            access = self._params_access(pred.args[0].value, p)
            b = pred.args[1].value
            if not (isinstance(b, ast.Int | ast.Float) and b.value > 0):
                raise self._fail(
                    "E159",
                    f"the bound of `{NORM_PREDICATE}` is a positive number, got {_src(b)}",
                    b.span,
                    "e.g. 40 or 2.5",
                )
            bound = (
                Arg(ArgKind.INT, None, b.value)
                if isinstance(b, ast.Int)
                else Arg(ArgKind.FLOAT, None, b.value)
            )
            call = Call(
                NORM_PREDICATE, (Arg(ArgKind.ACCESS, None, access=access), bound), "norm", pred.span
            )
            return Constraint(
                item.name,
                item.kind,
                PredKind.USER,
                access,
                (),
                None,
                call,
                priority,
                Status.DYNAMIC,
                item.span,
            )
        what = (
            f"`{item.kind} {func}(...)`"
            if func in ("change", NORM_PREDICATE)
            else f"{_describe(pred)}"
        )
        raise self._fail(
            "E159", f"{what} is not a constraint on a Params value", pred.span, allowed
        )

    def _params_policy(self, e: ast.Expr) -> Call:
        """`diloco(outer_lr=F, momentum=F[, nesterov=0|1])`, `average` or
        `satisfy(max_constraints_then_score)` (the best-scoring valid replica)."""
        allowed = (
            "a Params value commits with diloco(outer_lr=0.7, momentum=0.9), average, or "
            "satisfy(max_constraints_then_score)"
        )
        name = e.func if isinstance(e, ast.Call) else e.id if isinstance(e, ast.Name) else None
        args = e.args if isinstance(e, ast.Call) else ()
        if name == "average" and not args:
            return Call("average", (), "policy", e.span)
        if (
            name == "satisfy"
            and len(args) == 1
            and isinstance(args[0].value, ast.Name)
            and args[0].value.id == "max_constraints_then_score"
        ):
            return Call("satisfy", (Arg(ArgKind.NAME, None, args[0].value.id),), "policy", e.span)
        if name != "diloco" or not isinstance(e, ast.Call):
            raise self._fail(
                "E160",
                f"{_src(e)} is not a commit policy for a Params value",
                e.span,
                allowed,
            )
        out: list[Arg] = []
        seen: set[str] = set()
        for a in args:
            if a.name is None or a.name not in DILOCO_OPTIONS:
                raise self._fail(
                    "E160",
                    "`diloco` takes the keywords " + ", ".join(DILOCO_OPTIONS),
                    a.span,
                    "write diloco(outer_lr=0.7, momentum=0.9)",
                )
            if a.name in seen:
                raise self._fail("E160", f"`{a.name}` is given twice", a.span)
            seen.add(a.name)
            x = a.value
            if a.name == "nesterov":
                if not (isinstance(x, ast.Int) and x.value in (0, 1)):
                    raise self._fail("E160", "`nesterov` is 0 or 1", x.span)
                out.append(Arg(ArgKind.INT, a.name, x.value))
                continue
            if not isinstance(x, ast.Int | ast.Float):
                raise self._fail(
                    "E160", f"`{a.name}` is a number, got {_describe(x)}", x.span, allowed
                )
            f = float(x.value)
            if a.name == "outer_lr" and f <= 0:
                raise self._fail("E160", f"`outer_lr` must be above 0, got {f:g}", x.span)
            if a.name == "momentum" and not 0 <= f < 1:
                raise self._fail("E160", f"`momentum` must be in [0, 1), got {f:g}", x.span)
            out.append(Arg(ArgKind.FLOAT, a.name, f))
        missing = [k for k in ("outer_lr", "momentum") if k not in seen]
        if missing:
            raise self._fail(
                "E160",
                f"`diloco` needs `{missing[0]}=`",
                e.span,
                "write diloco(outer_lr=0.7, momentum=0.9)",
            )
        return Call("diloco", tuple(out), "policy", e.span)

    def _training_scope(
        self,
        rules: list[Rule],
        constraints: list[Constraint],
        commits: list[Commit],
        workflows: list[Workflow],
    ) -> None:
        """A training program trains one Params value with one minimize rule; its other values
        are data the loss reads (rules, workflows, constraints and commits on them: not yet)."""
        params = [v for v in self.values.values() if v.dtype == DType.PARAMS]
        if not params:
            return
        p = params[0]
        soon = "not supported yet: in a training program the other values are data inputs"
        for extra in params[1:]:
            self.sink.error(
                "E162",
                f"a second Params value `{extra.name}` (`{p.name}` is at line {p.span.line}); "
                "one Params value per program is supported",
                extra.span,
                "train one module per program",
            )
        mins = [r for r in rules if r.target == p.name]
        for r in mins[1:]:
            self.sink.error(
                "E162",
                f"a second minimize rule on `{p.name}` (`{mins[0].name}` is at line "
                f"{mins[0].span.line}); one per Params value is supported",
                r.span,
                "merge them into one rule (a loss may read several data values)",
            )
        for r in rules:
            if r.target != p.name:
                self.sink.error(
                    "E162", f"rule `{r.name}` on `{r.target}` is {soon}", r.span, "remove it"
                )
        for w in workflows:
            self.sink.error("E162", f"workflow `{w.name}` is {soon}", w.span, "remove it")
        for c in constraints:
            if c.access is None or c.access.value != p.name:
                self.sink.error(
                    "E162",
                    f"constraint `{c.name}` on "
                    + (f"`{c.access.value}`" if c.access is not None else "a data value")
                    + f" is {soon}",
                    c.span,
                    "constrain the parameters: `forbid change(P[...])`, `require NormAtMost(...)`",
                )
        for cm in commits:
            if cm.access.value != p.name:
                self.sink.error(
                    "E162",
                    f"a commit of `{cm.access.value}` is {soon}",
                    cm.span,
                    "remove it",
                )
        if self.sink.has_errors:
            return  # a statement about the Params value may have failed to build: say no more
        if not mins:
            self.sink.error(
                "E162",
                f"no rule trains the Params value `{p.name}`",
                p.span,
                f"add `rule Fit:` with `on {p.name}[*]` and "
                f"`emit proposal {p.name}[*] := minimize(Loss({p.name}, data), steps=50, batch=8)`",
            )
        if not any(cm.access.value == p.name for cm in commits):
            self.sink.error(
                "E161",
                f"the Params value `{p.name}` has no `commit` line; a training program says how "
                "replicas agree",
                p.span,
                f"add `commit {p.name}[*] using diloco(outer_lr=0.7, momentum=0.9)` "
                "(or `average`, or `satisfy(max_constraints_then_score)`)",
            )

    # ---- workflows -----------------------------------------------------------------------------
    def _workflow(self, item: ast.Workflow) -> Workflow:
        value = self._lookup_value(item.value, item.value_span)
        if value.dtype != DType.TOKEN or value.shape not in (ShapeKind.SEQ, ShapeKind.GRID2D):
            raise self._fail(
                "E140",
                f"workflow `{item.name}` runs on `{value.name}`, a {value.dtype.value} "
                f"{value.shape.value} value; workflows run on token streams",
                item.value_span,
                "declare `value Txt : Token[Byte] shape Grid2D(B, N)` (B streams of N tokens)",
            )
        names: dict[str, Span] = {}
        for z in item.zones:
            if z.name in names:
                raise self._fail(
                    "E141",
                    f"zone `{z.name}` is already declared at line {names[z.name].line}",
                    z.name_span,
                    "zone names are unique within a workflow",
                )
            names[z.name] = z.name_span
        captures = {st.name for z in item.zones for st in z.body if isinstance(st, ast.Capture)}
        zones = tuple(self._zone(z, list(names), captures) for z in item.zones)
        return Workflow(item.name, value.name, zones, item.span)

    def _zone(self, z: ast.Zone, zones: list[str], captures: set[str]) -> Zone:
        feeds: list[Feed] = []
        exits: list[Exit] = []
        tags: list[str] = []
        gen: ast.Generate | None = None
        capture: ast.Capture | None = None
        tool: ast.ToolCall | None = None
        for st in z.body:
            match st:
                case ast.Feed(value=ast.Str(value=text)):
                    feeds.append(Feed(text, None, st.span))
                case ast.Feed(value=ast.Name(id=name)):
                    feeds.append(Feed(None, name, st.span))
                case ast.Feed(value=v):
                    raise self._fail(
                        "E142",
                        f"`feed` takes a string or the name of an input, got {_describe(v)}",
                        v.span,
                        'write `feed "text"` or `feed question` (an input given per stream)',
                    )
                case ast.Generate():
                    if gen is not None:
                        raise self._fail("E143", "a zone generates once", st.span)
                    gen = st
                case ast.Until(pattern=pat):
                    if not isinstance(pat, ast.Str) or not pat.value:
                        raise self._fail(
                            "E144",
                            f"`until` takes a non-empty string pattern, got {_describe(pat)}",
                            pat.span,
                            'write `until "."` or `until "no" jump ask`',
                        )
                    if st.jump is not None and st.jump not in zones:
                        raise self._fail(
                            "E145",
                            f"unknown zone `{st.jump}`",
                            st.span,
                            _suggest(st.jump, zones) or "jump to a zone of this workflow",
                        )
                    limit = self._count(st.limit, "limit") if st.limit is not None else None
                    exits.append(Exit(pat.value, st.jump, limit, st.span))
                case ast.Capture():
                    if capture is not None:
                        raise self._fail("E143", "a zone captures once", st.span)
                    capture = st
                case ast.ToolCall():
                    if tool is not None:
                        raise self._fail("E143", "a zone calls one tool", st.span)
                    tool = st
                case ast.Tag(name=name):
                    tags.append(name)
        if gen is None and (exits or capture is not None):
            raise self._fail(
                "E146",
                f"zone `{z.name}` has `until` or `capture` but no `generate`",
                z.name_span,
                "add `generate` (triggers and captures watch generated tokens)",
            )
        if gen is not None and gen.max is None and not exits:
            raise self._fail(
                "E146",
                f"zone `{z.name}` can generate forever: no `max` and no `until`",
                gen.span,
                'add `max N` or `until "pattern"`',
            )
        if gen is None and not feeds:
            raise self._fail(
                "E146",
                f"zone `{z.name}` neither feeds nor generates",
                z.name_span,
                'add `feed "..."` or `generate`',
            )
        allowed: Call | None = None
        max_tokens: Expr | None = None
        if gen is not None:
            if gen.max is not None:
                max_tokens = self._count(gen.max, "max")
            if gen.allowed is not None:
                if not (isinstance(gen.allowed, ast.Call) and gen.allowed.func == "Set"):
                    raise self._fail(
                        "E116",
                        f"`generate in` takes a `Set(...)` literal, got {_describe(gen.allowed)}",
                        gen.allowed.span,
                    )
                allowed = self._set_literal(gen.allowed)
        call: Call | None = None
        if tool is not None:
            call = self._bound_call(tool.call, "tool", (), _Scope())
            for a in call.args:
                if a.kind == ArgKind.NAME and a.value not in captures:
                    raise self._fail(
                        "E147",
                        f"`{a.value}` is not captured by any zone of this workflow",
                        tool.call.span,
                        _suggest(str(a.value), sorted(captures))
                        or "tools take captures (`capture NAME`), strings and integers",
                    )
                if a.kind not in (ArgKind.NAME, ArgKind.STR, ArgKind.INT):
                    raise self._fail(
                        "E147",
                        "tools take captures (`capture NAME`), strings and integers",
                        tool.call.span,
                    )
        return Zone(
            z.name,
            tuple(feeds),
            gen is not None,
            max_tokens,
            allowed,
            tuple(exits),
            capture.name if capture is not None else None,
            call,
            tuple(tags),
            z.span,
        )

    def _count(self, e: ast.Expr, what: str) -> Expr:
        """A positive count (`max`, `limit`): an integer or a parameter expression."""
        out = self._expr(e, _Scope())
        try:
            n = evaluate(out, self._param_defaults())
        except EvalError:
            return out  # decided by the checker once parameters are bound
        if n < 1:
            raise self._fail("E148", f"`{what}` must be at least 1, got {n}", e.span)
        return out

    def _param_defaults(self) -> dict[str, int]:
        # Declarations are complete before any constraint is built, so compute this once.
        if self._defaults is not None:
            return self._defaults
        env: dict[str, int] = {}
        for p in self.params.values():
            if p.default is not None:
                try:
                    env[p.name] = evaluate(p.default, env)
                except EvalError:
                    pass
        self._defaults = env
        return env


def _range(key: str, rule: _Opt) -> str:
    """The allowed values of a `minimize` option, in words."""
    kind, lo, lo_open, hi, _ = rule
    what = "an integer" if kind == "int" else "a number"
    if lo is None:
        return f"`{key}` is {what}"
    low = f"above {lo:g}" if lo_open else f"at least {lo:g}"
    return f"`{key}` must be {what} {low}" + (f" and below {hi:g}" if hi is not None else "")


def _has_var(e: Expr) -> bool:
    stack = [e]
    while stack:
        x = stack.pop()
        if x.op == Op.VAR:
            return True
        stack.extend(x.args)
    return False


def _non_affine(e: Expr, src: ast.Expr) -> tuple[ast.Expr, str] | None:
    """The AST node of the first non-affine operation in ``e`` (built from ``src``), and why."""
    stack: list[tuple[Expr, ast.Expr]] = [(e, src)]
    while stack:
        x, a = stack.pop()
        kids = _ast_kids(a)
        if x.op == Op.MUL and _has_var(x.args[0]) and _has_var(x.args[1]):
            return a, "multiplies two index variables"
        if x.op in (Op.DIV, Op.MOD):
            rhs = x.args[1]
            if _has_var(rhs):
                return a, "divides by an index variable"
            if rhs.op == Op.CONST and rhs.value == 0:
                return a, "divides by zero"
        if x.op in (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE, Op.AND, Op.OR, Op.NOT):
            return a, "is a condition, not a number"
        if len(kids) == len(x.args):
            stack.extend(zip(x.args, kids))
    return None


def _ast_kids(a: ast.Expr) -> tuple[ast.Expr, ...]:
    match a:
        case ast.BinOp(lhs=lhs, rhs=rhs) | ast.Cmp(lhs=lhs, rhs=rhs):
            return (lhs, rhs)
        case ast.And(lhs=lhs, rhs=rhs) | ast.Or(lhs=lhs, rhs=rhs):
            return (lhs, rhs)
        case ast.Neg(operand=x) | ast.Not(operand=x):
            return (x,)
    return ()


def _src(a: ast.Expr) -> str:
    from lmpm.lang.format import fmt_expr

    try:
        return fmt_expr(a)
    except RecursionError:
        return "..."


def _describe(e: ast.Expr) -> str:
    names = {
        ast.Int: "an integer",
        ast.Float: "a decimal number",
        ast.Str: "a string",
        ast.Name: "a name",
        ast.Star: "`*`",
        ast.Dots: "`...`",
        ast.Call: "a call",
        ast.Subscript: "an access",
        ast.Optional: "`X?`",
        ast.Tuple: "a tuple",
        ast.Range: "a range",
        ast.BinOp: "arithmetic",
        ast.Neg: "a negation",
        ast.Cmp: "a comparison",
        ast.In: "an `in` test",
        ast.And: "`and`",
        ast.Or: "`or`",
        ast.Not: "`not`",
        ast.Of: "`k of n`",
    }
    return names.get(type(e), type(e).__name__)


def _suggest(name: str, candidates: list[str]) -> str | None:
    import difflib

    close = difflib.get_close_matches(name, candidates, n=1)
    return f"did you mean `{close[0]}`?" if close else None


def build(prog: ast.Program, sink: DiagnosticSink | None = None) -> Program:
    """Lower an AST to IR; structural errors go to ``sink`` (raised if no sink is given)."""
    own = sink is None
    sink = sink if sink is not None else DiagnosticSink()
    ir = Builder(prog.file, sink).build(prog)
    if own:
        sink.raise_if_errors()
    return ir
