"""The checked IR of a training program → :class:`lmpm.train.spec.TrainSpec` (no torch).

The front end (``lmpm.ir.build``) has already refused everything a training program may not say
(E150–E162, docs/language.md "Training values"); this module reads the finished IR and resolves what
depends on the parameters: the data shapes, ``steps=H``.

>>> from lmpm.ir import compile_source
>>> src = '''value Corpus : Token[Byte] shape Grid2D(64, 128)
... value Theta : Params[ByteLM] shape Tensors()
... rule Fit:
...   on Theta[*]
...   read {data = Corpus[*]}
...   emit proposal Theta[*] := minimize(NextByteLoss(Theta, data), steps=10, batch=8)
... commit Theta[*] using average
... '''
>>> spec = train_spec(compile_source(src).ir, {})
>>> spec.rule.data[0].rows, spec.rule.data[0].length, spec.policy.kind
(128, 64, 'average')
"""

from __future__ import annotations

from collections.abc import Mapping

from lmpm.errors import DiagnosticSink
from lmpm.ir.eval import EvalError, bind_params, evaluate
from lmpm.ir.nodes import (
    Arg,
    ArgKind,
    AxisKind,
    Call,
    Constraint,
    DType,
    PredKind,
    Program,
    Rule,
    RuleKind,
    ShapeKind,
    Value,
)
from lmpm.train.spec import (
    DataSpec,
    MinimizeSpec,
    ParamConstraint,
    ParamsSpec,
    PolicySpec,
    TrainSpec,
)

# `minimize` options that are integers and their smallest value (the builder checks the literals;
# a parameter such as `steps=H` is checked here, once it is bound).
_INT_MINIMUM = {"steps": 1, "batch": 1, "warmup": 0, "seed": None}


def is_training(program: Program) -> bool:
    """Whether ``program`` trains a ``Params`` value (and so runs on the training runtime)."""
    return any(v.dtype == DType.PARAMS for v in program.values)


def train_spec(program: Program, params: Mapping[str, int]) -> TrainSpec | None:
    """What a checked training program asks for, with ``params`` (``--set``) over the defaults;
    None for a program without a Params value.

    Raises :class:`lmpm.errors.BindError` for an unknown or missing parameter (B001, B003) and
    :class:`lmpm.errors.CheckError` (E156, E209) for a bound value out of range."""
    p = next((v for v in program.values if v.dtype == DType.PARAMS), None)
    if p is None:
        return None
    env = bind_params(program, params, require_all=True)  # B001/B003 as for any run
    sink = DiagnosticSink()
    rule = next(r for r in program.rules if r.kind == RuleKind.MINIMIZE and r.target == p.name)
    commit = next(cm for cm in program.commits if cm.access.value == p.name)
    values = {v.name: v for v in program.values}
    assert p.module is not None and p.shape in (ShapeKind.TENSORS, ShapeKind.BLOCKS)
    spec = TrainSpec(
        ParamsSpec(
            p.name, p.module, "tensors" if p.shape == ShapeKind.TENSORS else "blocks", p.span
        ),
        _minimize(rule, values, env, sink),
        _policy(commit.policy),
        tuple(
            _constraint(c)
            for c in program.constraints
            if c.access is not None and c.access.value == p.name
        ),
        program.file,
    )
    sink.raise_if_errors()
    return spec


def _minimize(
    rule: Rule, values: Mapping[str, Value], env: Mapping[str, int], sink: DiagnosticSink
) -> MinimizeSpec:
    call = rule.proposal
    loss = call.args[0].call
    assert loss is not None
    opts: dict[str, object] = {}
    for a in call.args[1:]:
        assert a.key is not None
        opts[a.key] = _option(a, env, call, sink)
    score = rule.score
    return MinimizeSpec(
        rule.name,
        loss.func,
        _data(loss, rule, values, env, sink),
        span=rule.span,
        eval_loss=score.func if score is not None else None,
        eval_data=_data(score, rule, values, env, sink) if score is not None else (),
        **opts,  # type: ignore[arg-type]  # keys and kinds fixed by the builder (MINIMIZE_OPTIONS)
    )


def _option(a: Arg, env: Mapping[str, int], call: Call, sink: DiagnosticSink) -> object:
    if a.kind == ArgKind.EXPR:
        assert a.expr is not None and a.key is not None
        try:
            n = evaluate(a.expr, env)
        except EvalError as e:
            sink.error("E156", f"`{a.key}` of `minimize` cannot be evaluated: {e}", call.span)
            return 1
        low = _INT_MINIMUM.get(a.key)
        if low is not None and n < low:
            sink.error(
                "E156",
                f"`{a.key}` of `minimize` is {n}; it must be at least {low}",
                call.span,
                "check the parameters it uses (`--set`)",
            )
        return n
    if a.kind == ArgKind.FLOAT:
        return float(a.value)  # type: ignore[arg-type]
    return a.value


def _data(
    loss: Call,
    rule: Rule,
    values: Mapping[str, Value],
    env: Mapping[str, int],
    sink: DiagnosticSink,
) -> tuple[DataSpec, ...]:
    reads = {r.name: r for r in rule.reads}
    out: list[DataSpec] = []
    for a in loss.args:
        if a.kind != ArgKind.READ:
            continue
        rd = reads[str(a.value)]
        v = values[rd.source]
        try:
            dims = [evaluate(d, env) for d in v.dims]
            vocab = evaluate(v.vocab, env) if v.vocab is not None else 0
        except EvalError as e:
            sink.error("E209", f"the shape of `{v.name}` cannot be evaluated: {e}", v.span)
            continue
        if min(dims) < 1 or vocab < 1:
            sink.error("E209", f"`{v.name}` has a dimension or vocabulary below 1", v.span)
            continue
        # Seq(N): one row of N tokens; Grid2D(L, R): R rows of L tokens
        length, rows = (dims[0], 1) if v.shape == ShapeKind.SEQ else (dims[0], dims[1])
        out.append(DataSpec(v.name, rd.name, length, rows, vocab))
    return tuple(out)


def _policy(call: Call) -> PolicySpec:
    if call.func == "average":
        return PolicySpec("average")
    if call.func == "satisfy":
        return PolicySpec("best")
    opts = {a.key: a.value for a in call.args}
    return PolicySpec(
        "diloco",
        outer_lr=float(opts["outer_lr"]),  # type: ignore[arg-type]
        momentum=float(opts["momentum"]),  # type: ignore[arg-type]
        nesterov=bool(opts.get("nesterov", 1)),
    )


def _constraint(c: Constraint) -> ParamConstraint:
    """`forbid change(P[sel])` → freeze; `require NormAtMost(P[sel], R)` → norm."""
    assert c.access is not None
    ax = c.access.axes[0]
    select = (ax.pattern,) if ax.kind == AxisKind.GLOB and ax.pattern is not None else ("*",)
    if c.pred == PredKind.CHANGE:
        return ParamConstraint(c.name, "freeze", select, c.priority, None, c.span)
    assert c.call is not None
    bound = float(c.call.args[1].value)  # type: ignore[arg-type]
    return ParamConstraint(c.name, "norm", select, c.priority, bound, c.span)
