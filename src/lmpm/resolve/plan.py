"""The resolver: Lamport IR + parameters + bindings → an execution plan (pure, no state).

Per value: shape, cell ids, payload dtype, commit policy. Per rule: gather tables for every read,
the bound model and score, literal arguments, the trigger. Per constraint: the cells it speaks about,
its evaluator (a set table, a bound predicate and the accesses it reads). Plus the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lmpm.bindings import Bindings
from lmpm.errors import BindError
from lmpm.ir.eval import bind_params, evaluate
from lmpm.ir.link import DEFAULT_POLICY, RUNTIME, Linked, link
from lmpm.ir.nodes import (
    ArgKind,
    Axis,
    AxisKind,
    Call,
    Constraint,
    DType,
    Expr,
    Op,
    PredKind,
    Program,
    ReadKind,
    Rule,
    RuleKind,
    ShapeKind,
    Status,
)
from lmpm.ir.printer import call_str, expr_str, read_str
from lmpm.resolve.budget import check_memory
from lmpm.resolve.masks import ValueMask, lower, lowering_of
from lmpm.resolve.policies import Policy, get_policy, replicas
from lmpm.resolve.schedules import ScheduleSpec, sample_tiles
from lmpm.runtime.data.texpr import coords as coords_of
from lmpm.runtime.data.texpr import eval_tensor


@dataclass(frozen=True, slots=True)
class ValuePlan:
    name: str
    dims: tuple[int, ...]
    ncells: int
    offset: int  # global id of the first cell (values in declaration order, Set values excluded)
    vocab: int | None  # tokens: vocabulary size
    dtype: torch.dtype  # payload dtype: int64 tokens, float32 numbers
    coords: Tensor  # (ncells, rank) int64, row-major
    policy: Policy
    policy_args: tuple[Any, ...]
    policy_text: str
    cell_shape: tuple[int, ...] = ()  # payload dims of one cell: (D,) for Tensor[D], () otherwise


@dataclass(frozen=True, slots=True)
class ReadPlan:
    name: str
    source: str
    args: tuple[str, ...]  # model argument names bound to this read
    index: Tensor  # (target cells, K) flat source index
    valid: Tensor  # (target cells, K) bool
    optional: bool
    text: str
    uniform: bool  # every row reads the same cells (e.g. `Txt[*]`): inputs are broadcast views


@dataclass(frozen=True, slots=True)
class RulePlan:
    id: int
    name: str
    ir: Rule
    target: str
    reads: tuple[ReadPlan, ...]
    model: Callable[..., Any]
    score: Callable[..., Any] | None
    score_args: tuple[str, ...]  # argument names the score call receives (all, with `...`)
    kwargs: Mapping[str, Any]  # literal arguments of the proposal call
    epoch_args: Mapping[str, Expr]  # arguments computed from the epoch `e` each epoch
    trigger: Expr  # evaluated per epoch over coords (+ e)
    replicas: int


@dataclass(frozen=True, slots=True)
class ConstraintPlan:
    id: int
    name: str
    ir: Constraint
    target: str
    kind: str  # forbid | require
    pred: PredKind
    priority: int
    cells: Tensor  # (ncells,) bool: cells the constraint speaks about (REGION "inputs" added at run time)
    needs_inputs_region: bool
    table: Tensor | None  # IN_SET: (vocab,) bool
    predicate: Callable[..., Any] | None  # USER
    accesses: tuple[tuple[Tensor, Tensor], ...]  # USER: (index, valid) per extra access argument
    literals: tuple[Any, ...]
    status: Status


@dataclass(frozen=True, slots=True)
class Gather:
    """One gather: the target's cells read these cells of ``source`` (``index``/``valid`` rows)."""

    target: str
    source: str
    index: Tensor  # (target cells, K) flat source index
    valid: Tensor  # (target cells, K) bool
    uniform: bool  # every target cell reads row 0's cells


@dataclass
class Plan:
    program: Program
    env: dict[str, int]
    values: dict[str, ValuePlan]
    rules: list[RulePlan]
    constraints: list[ConstraintPlan]
    schedule: ScheduleSpec
    colors: dict[str, Tensor] = field(
        default_factory=dict
    )  # independent schedule: (ncells,) colours
    # Indexes over the rules and constraints, built once here; the data plane, the engine, the
    # compiled epoch and the topology read them.
    rules_by_target: dict[str, list[RulePlan]] = field(init=False)  # program order per value
    # the constraints evaluated at run time, per constrained value (a constraint proved at
    # compile time, or a read_future decided there, is never re-evaluated)
    live_constraints: dict[str, list[ConstraintPlan]] = field(init=False)
    gathers: list[Gather] = field(init=False)  # rule reads, then the live constraints' accesses
    # per value: its static set constraints lowered into a vocabulary mask (lmpm.resolve.masks)
    masks: dict[str, ValueMask] = field(init=False)

    def __post_init__(self) -> None:
        self.rules_by_target = {}
        for rp in self.rules:
            self.rules_by_target.setdefault(rp.target, []).append(rp)
        self.live_constraints = {}
        for cp in self.constraints:
            if cp.status == Status.PROVED or cp.pred == PredKind.READ_FUTURE:
                continue
            self.live_constraints.setdefault(cp.target, []).append(cp)
        self.gathers = [
            Gather(rp.target, rd.source, rd.index, rd.valid, rd.uniform)
            for rp in self.rules
            for rd in rp.reads
        ]
        for cps in self.live_constraints.values():
            for cp in cps:
                for index, valid in cp.accesses:
                    self.gathers.append(Gather(cp.target, cp.target, index, valid, False))
        self.masks = lower(self)

    @property
    def total_cells(self) -> int:
        return sum(v.ncells for v in self.values.values())


def _gather(
    program: Program,
    env: dict[str, int],
    target: str,
    source: str,
    axes: tuple[Axis, ...],
    binders: Any,
    guard: Expr | None,
    tvars: tuple[str, ...],
) -> tuple[Tensor, Tensor]:
    from lmpm.visibility.gather import gather_table

    g = gather_table(program, env, target, source, axes, binders, guard, tvars)
    return g.index, g.valid


def _visible(
    program: Program, env: dict[str, int], target: str, source: str
) -> tuple[Tensor, Tensor]:
    from lmpm.visibility.gather import visible_union

    g = visible_union(program, env, target, source)
    return g.index, g.valid


def resolve(
    program: Program,
    overrides: Mapping[str, int] | None = None,
    bindings: Bindings | None = None,
    *,
    epochs: int | None = None,
    max_memory: int | None = None,
) -> Plan:
    """Build the execution plan. Raises BindError for anything that cannot be bound, UsageError
    (U043, U049) for a plan past ``max_memory`` bytes (default: the machine's memory)."""
    bindings = bindings or Bindings()
    env = bind_params(program, overrides, require_all=True)
    values: dict[str, ValuePlan] = {}
    policies = {cm.access.value: cm.policy for cm in program.commits}
    check_memory(program, env, max_memory)
    linked = link(program, bindings, env)
    offset = 0
    for v in program.values:
        if v.shape == ShapeKind.SET:
            continue
        dims = tuple(evaluate(d, env) for d in v.dims)
        n = 1
        for d in dims:
            n *= d
        vocab = evaluate(v.vocab, env) if v.vocab is not None and v.dtype == DType.TOKEN else None
        dtype = torch.float32 if v.dtype in (DType.FLOAT, DType.TENSOR) else torch.int64
        cell_shape: tuple[int, ...] = ()
        if v.dtype == DType.TENSOR and v.vocab is not None:
            cell_shape = (int(evaluate(v.vocab, env)),)
        pcall = policies.get(v.name, DEFAULT_POLICY)
        policy = get_policy(pcall.func)
        args = linked.args(pcall)
        values[v.name] = ValuePlan(
            v.name,
            dims,
            n,
            offset,
            vocab,
            dtype,
            coords_of(dims),
            policy,
            args,
            call_str(pcall),
            cell_shape,
        )
        offset += n

    rules: list[RulePlan] = []
    schedule = ScheduleSpec()
    replicas = {name: _replicas(vp) for name, vp in values.items()}
    for r in program.rules:
        if r.kind == RuleKind.SCHEDULE:
            fn = linked.bound(r.proposal)
            kwargs = linked.kwargs(r.proposal)
            try:
                spec = fn(**kwargs)
            except TypeError as e:
                raise BindError(
                    f"schedule {call_str(r.proposal)}: {e}", span=r.proposal.span, code="B042"
                ) from None
            if not isinstance(spec, ScheduleSpec):
                raise BindError(
                    f"schedule `{r.proposal.func}` must return a ScheduleSpec "
                    "(see lmpm.resolve.schedules.sample_tiles)",
                    span=r.proposal.span,
                    code="B043",
                )
            schedule = spec
            continue
        rules.append(_rule_plan(linked, values, r, len(rules), replicas[r.target]))
    if schedule.strategy == "confidence" and schedule.steps is None:
        schedule = ScheduleSpec(schedule.strategy, schedule.k, epochs or 16, schedule.options)

    constraints = [
        _constraint_plan(linked, values, c, i) for i, c in enumerate(program.constraints)
    ]
    plan = Plan(program, env, values, rules, constraints, schedule)
    if schedule.strategy == "independent":
        from lmpm.resolve.schedules import color_graph

        for name in {rp.target for rp in rules}:
            if any(s.target == name and s.source == name for s in program.stencils):
                index, valid = _visible(program, env, name, name)
                plan.colors[name] = color_graph(index, valid)
            else:
                plan.colors[name] = torch.zeros(values[name].ncells, dtype=torch.int64)
    return plan


def _replicas(vp: ValuePlan) -> int:
    """quorum(k, ...) runs every rule of the value as k replicas, quorum(k of n, ...) as n."""
    return replicas(vp.policy, vp.policy_args)


def _rule_plan(
    linked: Linked, values: dict[str, ValuePlan], r: Rule, rid: int, replicas: int
) -> RulePlan:
    program, env = linked.program, dict(linked.env)
    if r.target not in values:
        raise BindError(
            f"rule `{r.name}` targets `{r.target}`, which has no cells", span=r.span, code="B051"
        )
    model = linked.bound(r.proposal)  # callable (the link step says B052 otherwise)
    arg_names: dict[str, list[str]] = {}
    kwargs: dict[str, Any] = {}
    epoch_args: dict[str, Expr] = {}
    for i, (a, value) in enumerate(zip(r.proposal.args, linked.args(r.proposal))):
        if a.kind == ArgKind.READ:
            assert isinstance(a.value, str)
            # The model sees the read under its keyword when given, else under the read's name.
            arg_names.setdefault(a.value, []).append(a.key or a.value)
        elif value is RUNTIME:  # an expression of the epoch `e`
            assert a.expr is not None
            epoch_args[a.key or f"arg{i}"] = a.expr
        else:
            kwargs[a.key or f"arg{i}"] = value
    reads: list[ReadPlan] = []
    for rd in r.reads:
        if rd.kind == ReadKind.VISIBLE:
            index, valid = _visible(program, env, r.target, rd.source)
        else:
            index, valid = _gather(
                program, env, r.target, rd.source, rd.axes, rd.binders, None, r.vars
            )
        names = tuple(arg_names.get(rd.name, [])) or (rd.name,)
        uniform = bool(index.shape[0] > 0) and bool(
            (index == index[:1]).all() and (valid == valid[:1]).all()
        )
        reads.append(
            ReadPlan(rd.name, rd.source, names, index, valid, rd.optional, read_str(rd), uniform)
        )
    score = None
    score_args: tuple[str, ...] = ()
    if r.score is not None:
        score = linked.bound(r.score)
        forward = any(a.kind == ArgKind.FORWARD for a in r.score.args)
        if forward:
            score_args = tuple(n for rp in reads for n in rp.args)
        else:
            score_args = tuple(str(a.value) for a in r.score.args if a.kind == ArgKind.READ)
    return RulePlan(
        rid,
        r.name,
        r,
        r.target,
        tuple(reads),
        model,
        score,
        score_args,
        kwargs,
        epoch_args,
        r.trigger,
        replicas,
    )


def _constraint_plan(
    linked: Linked, values: dict[str, ValuePlan], c: Constraint, cid: int
) -> ConstraintPlan:
    program, env = linked.program, dict(linked.env)
    assert c.access is not None or c.pred == PredKind.USER
    target = c.access.value if c.access is not None else ""
    vp = values.get(target)
    if vp is None:
        raise BindError(
            f"constraint `{c.name}` speaks about `{target}`, which has no cells",
            span=c.span,
            code="B060",
        )
    cells, needs_inputs = _cells_of(c, linked, vp)
    table = None
    predicate = None
    accesses: list[tuple[Tensor, Tensor]] = []
    literals: list[Any] = []
    if c.pred == PredKind.IN_SET:
        assert c.set is not None
        table = _set_table(c.set, linked, vp)
    elif c.pred == PredKind.USER:
        assert c.call is not None
        predicate = linked.bound(c.call)
        tvars = _pattern_names(c)
        first = True
        for a, value in zip(c.call.args, linked.args(c.call)):
            if a.kind == ArgKind.ACCESS and a.access is not None:
                if first:
                    first = False
                    continue
                accesses.append(
                    _gather(program, env, target, a.access.value, a.access.axes, (), None, tvars)
                )
            else:
                literals.append(value)
    return ConstraintPlan(
        cid,
        c.name,
        c,
        target,
        c.kind,
        c.pred,
        c.priority,
        cells,
        needs_inputs,
        table,
        predicate,
        tuple(accesses),
        tuple(literals),
        c.status,
    )


def _pattern_names(c: Constraint) -> tuple[str, ...]:
    """One variable name per axis of the constraint's first access (dummy names where not a var)."""
    assert c.access is not None
    out: list[str] = []
    for k, ax in enumerate(c.access.axes):
        if ax.kind == AxisKind.AT and ax.lo is not None and ax.lo.op == Op.VAR:
            out.append(str(ax.lo.value))
        else:
            out.extend(f"_axis{k}_{j}" for j in range(ax.width))
    return tuple(out)


def _cells_of(c: Constraint, linked: Linked, vp: ValuePlan) -> tuple[Tensor, bool]:
    """The (ncells,) mask of cells the constraint's access covers (pattern variables match all)."""
    mask = torch.ones(vp.ncells, dtype=torch.bool)
    if c.access is None:
        return mask, False
    env = dict(linked.env)
    needs_inputs = False
    k = 0
    for ax in c.access.axes:
        col = vp.coords[:, k : k + ax.width]
        if ax.kind == AxisKind.AT:
            assert ax.lo is not None
            if not (ax.lo.op == Op.VAR and ax.lo.value in c.pattern_vars):
                at = eval_tensor(ax.lo, _env_with_vars(env, c, vp))
                mask &= col[:, 0] == at
        elif ax.kind == AxisKind.RANGE:
            assert ax.lo is not None and ax.hi is not None
            e2 = _env_with_vars(env, c, vp)
            lo, hi = eval_tensor(ax.lo, e2), eval_tensor(ax.hi, e2)
            mask &= (col[:, 0] >= lo) & (col[:, 0] <= hi)
        elif ax.kind == AxisKind.REGION:
            assert ax.call is not None
            if ax.call.func == "inputs":
                needs_inputs = True
            else:
                mask &= _region_mask(ax.call, linked, vp, k, ax.width)
        k += ax.width
    return mask, needs_inputs


def _env_with_vars(env: dict[str, int], c: Constraint, vp: ValuePlan) -> dict[str, Any]:
    missing = []
    for name in _free_params(c):
        if name not in env:
            missing.append(name)
    if missing:
        raise BindError(
            f"constraint `{c.name}` needs the region parameter(s) {', '.join(missing)}",
            span=c.span,
            code="B061",
            hint="bind them with " + " ".join(f"--set {m}=..." for m in missing),
        )
    out: dict[str, Any] = dict(env)
    assert c.access is not None
    for k, ax in enumerate(c.access.axes):
        if ax.kind == AxisKind.AT and ax.lo is not None and ax.lo.op == Op.VAR:
            out[str(ax.lo.value)] = vp.coords[:, k]
    return out


def _free_params(c: Constraint) -> list[str]:
    from lmpm.ir.eval import names_in

    names: set[str] = set()
    if c.access is not None:
        for ax in c.access.axes:
            for e in (ax.lo, ax.hi):
                names |= {n for op, n in names_in(e) if op == Op.PARAM}
    return sorted(names)


def _region_mask(call: Call, linked: Linked, vp: ValuePlan, first_axis: int, width: int) -> Tensor:
    fn = linked.bound(call)
    shape = vp.dims[first_axis : first_axis + width]
    args, kw = _call_args(call, linked)
    try:
        region = torch.as_tensor(fn(*args, shape=shape, **kw), dtype=torch.bool)
    except Exception as e:
        raise BindError(
            f"region {call_str(call)} raised {type(e).__name__}: {e}", span=call.span, code="B062"
        ) from e
    if tuple(region.shape) != tuple(shape):
        raise BindError(
            f"region {call_str(call)} returned shape {tuple(region.shape)}, expected "
            f"{tuple(shape)} (the axes it stands for)",
            span=call.span,
            code="B063",
        )
    flat = torch.zeros(vp.ncells, dtype=torch.long)
    stride = 1
    for k in range(first_axis + width - 1, first_axis - 1, -1):
        flat += vp.coords[:, k] * stride
        stride *= vp.dims[k]
    return region.reshape(-1)[flat]


def _set_table(call: Call, linked: Linked, vp: ValuePlan) -> Tensor:
    vocab = vp.vocab or 0
    if call.func == "Set":
        members = _set_members(call, linked)
    else:
        fn = linked.bound(call)
        args, kw = _call_args(call, linked)
        try:
            members = [int(m) for m in torch.as_tensor(list(fn(*args, **kw))).reshape(-1).tolist()]
        except Exception as e:
            raise BindError(
                f"set {call_str(call)} raised {type(e).__name__}: {e}", span=call.span, code="B064"
            ) from e
    table = torch.zeros(max(vocab, 1), dtype=torch.bool)
    bad = [m for m in members if not 0 <= m < vocab]
    if bad:
        raise BindError(
            f"set {call_str(call)} has members outside the vocabulary of `{vp.name}` "
            f"(size {vocab}): {bad[:5]}",
            span=call.span,
            code="B065",
        )
    if members:
        table[torch.tensor(members)] = True
    return table


def _set_members(call: Call, linked: Linked) -> list[int]:
    """The members of a `Set(...)` literal: integers, `lo..hi` ranges, strings' UTF-8 bytes."""
    members: list[int] = []
    args = list(zip(call.args, linked.args(call)))
    while args:
        a, value = args.pop(0)
        if a.key == "lo" and args and args[0][0].key == "hi":
            _, hi = args.pop(0)
            members.extend(range(value, hi + 1))
        elif a.kind == ArgKind.STR:
            members.extend(str(value).encode("utf-8"))
        else:
            members.append(int(value))
    return members


def _call_args(call: Call, linked: Linked) -> tuple[list[Any], dict[str, Any]]:
    """A bound call's literal arguments: positional, then by keyword."""
    pairs = list(zip(call.args, linked.args(call)))
    return [v for a, v in pairs if a.key is None], {a.key: v for a, v in pairs if a.key is not None}


def needs_input(plan: Plan) -> dict[str, list[str]]:
    """Values read (non-optionally) that no rule proposes -> the rules reading them."""
    proposed = {rp.target for rp in plan.rules}
    out: dict[str, list[str]] = {}
    for rp in plan.rules:
        for rd in rp.reads:
            if not rd.optional and rd.source not in proposed:
                out.setdefault(rd.source, []).append(rp.name)
    return out


def plan_text(program: Program, overrides: Mapping[str, int] | None = None) -> str:
    """`lmpm show --plan`: the resolved layout, reads, constraints and schedule (names unbound)."""
    env = bind_params(program, overrides)
    out = [f"plan for {program.file}"]
    out.append("params: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    offset = 0
    policies = {cm.access.value: call_str(cm.policy) for cm in program.commits}
    for v in program.values:
        if v.shape == ShapeKind.SET:
            out.append(f"value {v.name}: Set (CRDT log)")
            continue
        try:
            dims = tuple(evaluate(d, env) for d in v.dims)
        except Exception:
            out.append(f"value {v.name}: dims unbound ({', '.join(expr_str(d) for d in v.dims)})")
            continue
        n = 1
        for d in dims:
            n *= d
        pol = policies.get(v.name, call_str(DEFAULT_POLICY))
        out.append(
            f"value {v.name}: dims {dims} cells {n} ids [{offset}, {offset + n}) raster; commit {pol}"
        )
        offset += n
    for r in program.rules:
        if r.kind == RuleKind.SCHEDULE:
            out.append(f"schedule {r.name}: {call_str(r.proposal)}")
            continue
        out.append(
            f"rule {r.name} -> {r.target}: model {r.proposal.func}"
            + (f", score {r.score.func}" if r.score else "")
        )
        for rd in r.reads:
            out.append(f"  gather {rd.name}{'?' if rd.optional else ''}: {read_str(rd)}")
    for c in program.constraints:
        out.append(
            f"constraint {c.name} [{c.priority}] {c.kind} {c.pred.value}: {c.status.value}"
            + (" (not evaluated at run time)" if c.status == Status.PROVED else "")
        )
    for low in lowering_of(program).values():
        out += [f"mask {line}" for line in low.lines()]
    if not any(r.kind == RuleKind.SCHEDULE for r in program.rules):
        out.append("schedule: all (default)")
    return "\n".join(out) + "\n"


__all__ = [
    "ConstraintPlan",
    "Gather",
    "Plan",
    "ReadPlan",
    "RulePlan",
    "ValuePlan",
    "needs_input",
    "plan_text",
    "resolve",
    "sample_tiles",
]
