"""`lmpm show FILE --compiled`: what ``--compile`` makes of each proposed value.

For every value a rule proposes: whether its epoch step compiles or runs eagerly, and why
(:func:`lmpm.runtime.data.compiled.eligibility`); for a compiled one, what its graph bakes in (the
:class:`~lmpm.runtime.data.compiled.StepSpec` in words) and the graph itself, summarized: the step is
traced into an aten FX graph with ``make_fx(tracing_mode="fake")`` at a representative shape,
exactly as ``--compile`` traces it, but inductor does not run (tracing takes well under a second,
code generation ten). ``--graph`` prints the traced graph's code.

The trace goes through :meth:`CompiledEpoch.step` itself, so the inputs are assembled, padded to
the shape bucket and ordered as in a run; only the step's compiler
(:attr:`~lmpm.runtime.data.compiled.CompiledEpoch.compiler`) is replaced by a tracer, and the step
stops before anything runs.
"""

from __future__ import annotations

import io
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lmpm.errors import LmpmError, RuntimeFault, UsageError
from lmpm.runtime.data.coverage import Coverage, coverage

if TYPE_CHECKING:
    from lmpm.ir import Frontend
    from lmpm.resolve.plan import ConstraintPlan, RulePlan
    from lmpm.runtime.data.compiled import StepSpec
    from lmpm.runtime.session import Run

# The step's results, in the order :meth:`CompiledEpoch.step` documents them.
OUTPUTS = ("winner", "changed", "score", "valid", "violated", "applies", "new_clock", "was")
OUTPUTS_COUNTS = "counts"
WIDTH = 100  # columns the report wraps long lists to


@dataclass
class Traced:
    """One value's step traced at one shape."""

    graph: torch.fx.GraphModule
    inputs: list[str]  # a name per graph input
    written: list[str]  # the inputs the graph writes in place
    bucket: int  # open-cell rows the graph takes (padded)
    open_cells: int  # the open cells it was traced for
    k: int  # proposals per cell
    k_given: bool  # the rule's literal `k=` (else 1, assumed)
    opened: bool  # epoch 0 opens cells of the value (else traced at 1 cell)


class _Stop(Exception):
    """Raised in place of running a traced step."""


def compiled_text(
    front: Frontend, params: dict[str, int], bind: Sequence[str], *, graph: bool = False
) -> str:
    """The report `lmpm show --compiled` prints (``graph``: with each traced graph's code)."""
    from lmpm.runtime.session import Run
    from lmpm.train.frontend import is_training

    if is_training(front.ir):
        raise UsageError(
            f"{front.ast.file} is a training program; --compiled shows the epoch step of a cell "
            "program (what `lmpm run --compile` compiles)",
            code="U110",
        )
    run = Run(front, params=params, bind=tuple(bind), compile=True)
    try:
        return _report(run, graph)
    finally:
        run.close()


def _report(run: Run, graph: bool) -> str:
    ce = run.engine.compiled
    assert ce is not None  # Run(compile=True) makes it or raises
    plan = run.plan
    rules = plan.rules_by_target
    live = plan.live_constraints
    cov = coverage(plan, seed=run.seed)
    out = [_overview(run, cov), ""]
    if not ce.reasons:
        out.append("no rule proposes a value: there is no epoch step to compile")
    open0 = run.engine.open_cells(0)
    for name, why in ce.reasons.items():
        if why is not None:
            out.append(f"{name}: eager island: {why}")
            out.append("  (each epoch runs the ordinary propose, check, agree and apply steps;")
            out.append("  on cuda nothing of it is captured as a CUDA graph)")
            out.extend(_mask_lines(plan, name))
            out.append("")
            continue
        spec = ce.specs[name]
        cps = live.get(name, [])
        out.append(
            f"{name}: compiled (one graph per bucket of open cells, a power of two, and per set "
            "of rules that proposed)"
        )
        out.extend(_spec_lines(run, spec, rules[name], cps))
        out.extend(_mask_lines(plan, name))
        out.extend(_cuda_lines(rules[name]))
        traced = trace_value(run, name, open0.get(name))
        out.extend(_graph_lines(traced))
        if graph:
            ph = [nd.name for nd in traced.graph.graph.nodes if nd.op == "placeholder"]
            out.extend(_wrap("  graph code (", [f"{a} = {b}" for a, b in zip(ph, traced.inputs)]))
            out[-1] += "):"
            out.extend("    " + line for line in traced.graph.code.strip("\n").splitlines())
        out.append("")
    if ce.specs:
        out.extend(
            textwrap.wrap(
                "A compiled value's epoch still runs eagerly while candidates are traced "
                "(--trace cells), a tap watches the candidate tables, or a fault is injected.",
                WIDTH,
            )
        )
        if not graph:
            out.append("lmpm show --compiled --graph prints each traced graph.")
    return "\n".join(out).rstrip("\n") + "\n"


def _overview(run: Run, cov: Coverage) -> str:
    """The head of the report: a table of every value (compiled, eager island and why, or an
    input) and one of the eager islands, drawn with rich."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=WIDTH, record=True, file=io.StringIO(), color_system=None)
    values = Table(title="values", title_justify="left")
    values.add_column("value")
    values.add_column("under --compile")
    for v in cov.values:
        values.add_row(v.value, v.status())
    for name in cov.inputs:
        values.add_row(name, "input: no rule proposes it (no decision to compile)")
    console.print(values)
    if cov.islands:
        islands = Table(title="eager islands (run between compiled parts)", title_justify="left")
        for col in ("kind", "name", "where", "value"):
            islands.add_column(col)
        for isl in cov.islands:
            kind = isl.kind + (" (own lmpm_compile)" if isl.own_compile else "")
            islands.add_row(kind, isl.name, isl.where, isl.value)
        console.print(islands)
    tables = [line.rstrip() for line in console.export_text().rstrip("\n").splitlines()]
    return "\n".join([f"{run.front.ast.file}: --compile: {cov.summary()}", *tables])


def _mask_lines(plan: Any, name: str) -> list[str]:
    """The value's set constraints lowered into a mask on its models' logits (the worker applies
    it before choosing, before the step runs: the step gets the chosen candidates)."""
    vm = plan.masks.get(name)
    if vm is None:
        return []
    text = (
        f"{', '.join(vm.lowering.lowered)} lowered into a vocabulary mask on the logits of "
        f"{', '.join(vm.lowering.rules)}, applied by the worker before it chooses (the step gets "
        "the chosen candidates)"
    )
    lines = textwrap.wrap(text, WIDTH - 15)
    return ["  mask         " + lines[0]] + [" " * 15 + line for line in lines[1:]]


def _proposals(rp: RulePlan) -> tuple[int, bool]:
    """Proposals per cell to trace with, and whether the rule says so: its literal ``k=``, else 1
    (the built-in models' default; the model decides at run time)."""
    k = rp.kwargs.get("k")
    if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
        return k, True
    return 1, False


# what the step does with the policy, beyond its name
_POLICY_NOTE = {
    "satisfy": "",
    "winner_takes_all": " (the best-scored proposal, soft constraints ignored)",
    "average": " (the mean of the valid proposals)",
}


def _spec_lines(
    run: Run, spec: StepSpec, rps: list[RulePlan], cps: list[ConstraintPlan]
) -> list[str]:
    """What the graph bakes in, in words."""
    from lmpm.ir.printer import call_str

    vp = run.plan.values[spec.value]
    shape = f"{vp.ncells} cells" + (f" ({'x'.join(map(str, vp.dims))})" if len(vp.dims) > 1 else "")
    cell = (
        f"a {list(vp.cell_shape)} {_dtype(spec.dtype)} tensor per cell"
        if spec.cdims
        else f"one {_dtype(spec.dtype)} per cell"
    )
    if vp.vocab is not None:
        cell += f" (tokens < {vp.vocab})"
    lines = []
    for rp in rps:
        reps = f", {rp.replicas} replicas" if rp.replicas != 1 else ""
        call = call_str(rp.ir.proposal)
        lines += [f"  rule         {rp.name} (rule {rp.id}{reps}) proposes it: {call}"]
        lines += _read_lines(run, rp)
    note = _POLICY_NOTE[spec.policy]
    if spec.quorum:
        note = f" (a payload {spec.quorum} replicas proposed; then {spec.policy}{note})"
    lines += [f"  cells        {shape}, {cell}", f"  policy       {vp.policy_text}" + note]
    if spec.quota:
        lines.append("  quota        the schedule's: the most confident winners commit")
    if not spec.checks:
        lines.append("  constraints  none checked at run time")
    else:
        lines.append(f"  constraints  {len(spec.checks)}, highest priority first:")
        width = max(len(cp.name) for cp in cps)
        for j in spec.order:
            cp, ck = cps[j], spec.checks[j]
            if ck.needs_inputs:
                where = "on the cells given as input"
            elif ck.covers_all:
                where = "on every cell"
            else:
                where = f"on {int(cp.cells.count_nonzero())} of {vp.ncells} cells"
            lines.append(
                f"    {cp.name:<{width}}  {cp.kind} {_pred(cp)}  priority {spec.priority[j]}, "
                f"{where}" + (", hard" if ck.hard else "")
            )
    if not spec.clock_sources:
        lines.append("  clock reads  none (a commit's clock is 1 + its own)")
    else:
        lines.append("  clock reads  a commit's clock is 1 + the max of its own and:")
        ce = run.engine.compiled
        assert ce is not None
        index = ce.tables(spec.value, run.dataplane)[2]
        for j, src in enumerate(spec.clock_sources):
            idx = index[j] if j < len(index) else None
            by = f" (rule {rps[spec.clock_rule[j]].name})" if len(rps) > 1 else ""
            if spec.clock_uniform[j]:
                how = "the same cells for every cell"
                if idx is not None:
                    how = f"the same {idx.numel()} cell{'s' if idx.numel() != 1 else ''} for every cell"
            else:
                how = "per cell"
                if idx is not None and idx.dim() == 2:
                    how = f"per cell, up to {idx.shape[1]} cell{'s' if idx.shape[1] != 1 else ''}"
            if spec.clock_masked[j]:
                how += ", masked where the read is invalid"
            own = " (its own clocks)" if src == spec.value else ""
            lines.append(f"    {src}{own}{by}: {how}")
    return lines


def _cuda_lines(rps: list[RulePlan]) -> list[str]:
    """What runs captured as a CUDA graph under ``--backend cuda`` (lmpm.runtime.data.captured),
    and what does not, and why."""
    names = list(dict.fromkeys(rp.ir.proposal.func for rp in rps))
    model = f"the model{'s' if len(names) > 1 else ''} {' and '.join(names)}"
    return [
        "  on cuda      captured: the step, one CUDA graph per bucket, replayed each epoch",
        f"               (records to the host in one copy); not captured: {model}",
        "               and the read gathers, run before it (a model may read values on the",
        "               host or make data-dependent shapes)",
    ]


def _read_lines(run: Run, rp: RulePlan) -> list[str]:
    """How the model's reads are gathered under --compile (lmpm.runtime.data.compiled.ReadGathers)."""
    if not rp.reads:
        return []
    head = "  reads        "
    if not run.dataplane.trusts(rp):
        return [head + "gathered eagerly (a bound model gets copies it may write into)"]
    per_cell = [a for rd in rp.reads if not rd.uniform for a in rd.args]
    shared = [a for rd in rp.reads if rd.uniform for a in rd.args]
    lines = []
    if per_cell:
        lines.append(f"{', '.join(per_cell)}: a compiled gather per open-cell bucket")
    if shared:
        lines.append(f"{', '.join(shared)}: one row, broadcast to every cell")
    return [(head if i == 0 else " " * len(head)) + line for i, line in enumerate(lines)]


def _pred(cp: ConstraintPlan) -> str:
    from lmpm.ir.nodes import PredKind
    from lmpm.ir.printer import access_str, call_str

    c = cp.ir
    acc = access_str(c.access) if c.access is not None else cp.target
    if cp.pred == PredKind.IN_SET and c.set is not None:
        return f"{acc} in {call_str(c.set)}"
    return f"{cp.pred.value}({acc})"


def _dtype(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _graph_lines(t: Traced) -> list[str]:
    ops = op_counts(t.graph)
    nodes = list(t.graph.graph.nodes)
    n_in = sum(nd.op == "placeholder" for nd in nodes)
    outs = _outputs(t.graph)
    shown = [f"{op} ×{c}" for op, c in ops.most_common()]
    cells = f"{t.open_cells} open cell{'s' if t.open_cells != 1 else ''}"
    pad = f" padded to {t.bucket}" if t.bucket != t.open_cells else ""
    return [
        f"  graph        traced at {cells}{pad} "
        + ("(what epoch 0 opens)," if t.opened else "(epoch 0 opens none),"),
        f"               {t.k} proposal{'s' if t.k != 1 else ''} per cell "
        + ("(the rule's k)" if t.k_given else "(assumed: the model decides at run time)"),
        "               with fake tensors: nothing ran, nothing was compiled",
        *_wrap(f"    {sum(ops.values())} aten ops: ", shown),
        *_wrap(f"    {n_in} inputs: ", t.inputs),
        *_wrap(f"    {len(outs)} outputs: ", outs),
        *_wrap("    written in place: ", t.written or ["nothing"]),
    ]


def _wrap(head: str, items: Sequence[str]) -> list[str]:
    """``head`` and the comma-separated ``items``, wrapped to WIDTH columns between items."""
    lines = [head]
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(lines[-1]) + 1 + len(piece) > WIDTH and lines[-1] != head:
            lines.append(" " * 6 + piece)
        else:
            lines[-1] += ("" if lines[-1] == head else " ") + piece
    return lines


def op_counts(gm: torch.fx.GraphModule) -> Counter[str]:
    """aten ops of ``gm`` by kind (overloads merged: ``index_put_``, ``where``, ...)."""
    out: Counter[str] = Counter()
    for nd in gm.graph.nodes:
        if nd.op == "call_function":
            out[_op_name(nd.target)] += 1
    return out


def _op_name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(getattr(packet, "__name__", packet))
    return str(getattr(target, "__name__", target))


def _outputs(gm: torch.fx.GraphModule) -> list[str]:
    for nd in gm.graph.nodes:
        if nd.op == "output":
            res = nd.args[0]
            k = len(res) if isinstance(res, (tuple, list)) else 1
            if k == len(OUTPUTS) + 1:
                return [*OUTPUTS, OUTPUTS_COUNTS]
            if k == len(OUTPUTS) + 3:  # a quorum's
                return [*OUTPUTS, "lost", "checksums", OUTPUTS_COUNTS]
            return [f"out{i}" for i in range(k)]
    return []


def written_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of the graph inputs an op writes in place (through views, too)."""
    placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
    pos = {nd: i for i, nd in enumerate(placeholders)}
    hit: set[int] = set()
    for nd in gm.graph.nodes:
        schema = getattr(nd.target, "_schema", None)
        if nd.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            src = nd.args[i] if i < len(nd.args) else nd.kwargs.get(arg.name)
            base = _base(src)
            if base in pos:
                hit.add(pos[base])
    return sorted(hit)


def _base(node: Any) -> Any:
    """The node a view chain starts from (``x.view(...)[0]`` → ``x``)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.arguments or not node.args:
            break
        info = schema.arguments[0].alias_info
        if info is None or info.is_write:
            break
        node = node.args[0]
    return node


def trace_value(run: Run, value: str, open_cells: Tensor | None) -> Traced:
    """Trace ``value``'s compiled step at ``open_cells`` (1 cell when none) and the rule's ``k``
    proposals per cell, through :meth:`CompiledEpoch.step` with its compiler replaced by
    ``make_fx``."""
    from lmpm.runtime.data import compiled as cmod

    ce = run.engine.compiled
    assert ce is not None
    eng = run.engine
    vp = run.plan.values[value]
    spec = ce.specs[value]
    rps = run.plan.rules_by_target[value]
    rp = rps[0]
    opened = open_cells is not None and bool(open_cells.numel())
    if open_cells is None or not opened:
        open_cells = torch.zeros(1, dtype=torch.int64)
    n = int(open_cells.numel())
    # every rule replica proposing for every open cell (the layout of a full epoch)
    layout = tuple((r.id, rep, _proposals(r)[0]) for r in rps for rep in range(r.replicas))
    width = sum(w for _, _, w in layout)
    prop = torch.zeros((n, width, *vp.cell_shape), dtype=vp.dtype)
    sc = torch.zeros((n, width), dtype=torch.float64)
    part = cmod.Fused(rp, open_cells, layout, prop, sc, None, None)
    active = torch.ones(len(spec.checks), dtype=torch.bool)
    clocks = {s: st.clock for s, st in eng.state.items()}
    got: dict[str, Any] = {}

    def tracer(
        key: tuple[Any, ...], make: Callable[[], Callable[..., Any]], args: Sequence[Tensor]
    ) -> tuple[Any, torch.fx.GraphModule, str]:
        import warnings

        from torch.fx.experimental.proxy_tensor import make_fx

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = make_fx(make(), tracing_mode="fake")(*args)
        got.update(gm=gm, args=list(args), lens=key[3])  # key: (spec, layout, signature, lens)

        def stop(*_: Any) -> Any:
            raise _Stop

        # "reused": the caller counts no compile and does none of a fresh compile's upkeep
        return stop, gm, "reused"

    saved = ce.on_compile, ce.compiler
    ce.on_compile, ce.compiler = None, tracer
    try:
        with torch.inference_mode():
            meta = cmod.StepMeta(eng.state[value], eng.why[value], active, clocks)
            ce.step(value, 0, part, run.dataplane, meta)
    except _Stop:
        pass
    except LmpmError:
        raise
    except Exception as exc:  # a tracing failure is what --compile would hit: say so
        raise RuntimeFault(
            f"tracing the epoch step of `{value}` failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}",
            where={"value": value},
            code="R080",
            hint="`lmpm run --compile` fails the same way; run without --compile",
        ) from None
    finally:
        ce.on_compile, ce.compiler = saved
    if "gm" not in got:
        raise RuntimeFault(
            f"the epoch step of `{value}` was not traced", where={"value": value}, code="R080"
        )
    gm: torch.fx.GraphModule = got["gm"]
    names = input_names(spec, run, value, got["lens"])
    args: list[Tensor] = got["args"]
    if len(names) != len(args):
        names = [f"arg{i}" for i in range(len(args))]
    written = [names[i] for i in written_inputs(gm)]
    return Traced(gm, names, written, int(args[1].numel()), n, width, _proposals(rp)[1], opened)


def input_names(spec: StepSpec, run: Run, value: str, lens: tuple[int, ...]) -> list[str]:
    """A name per flat graph input: the step's parameters, then its tables named after the
    constraint or the clock source they belong to."""
    from lmpm.runtime.data.compiled import StepInputs, StepTables

    cps = run.plan.live_constraints.get(value, [])
    per: dict[str, list[str]] = {
        "vtables": [cps[j].name for j, ck in enumerate(spec.checks) if ck.in_set],
        "where": [cps[j].name for j, ck in enumerate(spec.checks) if not ck.covers_all],
        "clock_index": list(spec.clock_sources),
        "clock_valid": [s for s, m in zip(spec.clock_sources, spec.clock_masked) if m],
        "clock_src": list(spec.others),
    }
    names = list(StepInputs._fields)
    for list_name, n in zip(StepTables._fields, lens):
        labels = per.get(list_name, [])
        for i in range(n):
            label = labels[i] if len(labels) == n else str(i)
            names.append(f"{list_name}[{label}]")
    return names
