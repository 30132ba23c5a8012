"""The compiled epoch step (``lmpm run --compile``): per value, everything after the model as one
compiled graph.

An eager epoch spends dozens of small tensor operations per value after its model has run: build
the candidate table, fold a proposal equal to the committed payload into keep-current, check every
constraint, agree, write the winners, advance the Lamport clocks and the provenance, record why a
cell stays unset. Each costs microseconds of Python and dispatcher time whatever the tensor's size
(one open cell in causal text generation). :class:`CompiledEpoch` traces that whole sequence per
value (:func:`value_step`, no Python left in it) with ``make_fx`` into one aten graph, which
inductor compiles into a few fused C++ kernels behind a C++ wrapper. These are explicit graphs:
the run calls them directly, keyed by the shapes it compiled them for, so no dynamo frame and no
torch guards run per epoch (a plan of work on handles, realized by the worker); their one guard is
an identity test per tensor of the run they read (:class:`Graph`), which lets the C++ wrapper skip
its per-call size asserts.

What is baked into a value's graph is static for the run: the cell shape and dtype, the commit
policy (a quorum's k), the constraints' kinds and priorities, the clock reads of each of its rules,
the candidate columns (a :data:`Layout`: which rule replicas proposed, k proposals each, unrolled:
every operation is elementwise over the open cells). What changes per epoch is an input
(:class:`StepInputs`): the open cells, the proposals and their scores, where each column's rule
fired (a rule's trigger may skip open cells), the epoch, the RuleSet (a (K,) bool mask), a
schedule's quota (with the open-cell count before padding: a padded row takes no quota). Shapes are
bucketed (the open-cell count rounded up to a power of two, padded by repeating the first row:
identical rows make identical decisions and write identical bytes), so a run compiles each value
once per bucket and layout, not once per epoch; :attr:`CompileStats.compiles` counts them, and
inductor's on-disk cache (:func:`cache_dir`) serves later runs.

Several rules per value, quorum replicas (the payloads' checksums, :func:`lmpm.runtime.protocol.
checksum`, traced; a proposal eligible where k replicas of its rule and slot proposed it; the
cells no payload won as NO_QUORUM, the outvoted replicas as :class:`Outvoted` columns for the
owner's records), the ``satisfy``, ``winner_takes_all`` and ``average`` policies, ``hard``
constraints and a schedule's quota (confidence: :func:`lmpm.runtime.data.agree.keep_top`) are
decided inside the step, by the eager functions themselves traced (:mod:`lmpm.resolve.policies`,
:func:`lmpm.runtime.data.agree.drop_hard`). A value runs eagerly (the ordinary
propose/agree/apply protocol) only where user Python code decides it; :func:`eligibility` says
why, and ``lmpm show --compiled`` prints it:

- a constraint on it is a bound Python predicate;
- its policy is one the user registered (:func:`lmpm.resolve.policies.register`), alone or inside a
  quorum.

An epoch also runs eagerly while candidates are being recorded (``--trace cells``), a tap watches
the candidate tables, or a fault is injected. Compiled and eager runs commit the same payload, the
same clocks and provenance and the same epoch records (tests/runtime/test_compiled.py).

The steps run in a fused data plane (:meth:`lmpm.runtime.data.dataplane.DataPlane.compile`): one worker
that owns its cells (a worker group is refused, U101). On the CPU the step writes the owner's
metadata itself. On CUDA (:mod:`lmpm.runtime.data.captured`) inductor compiles it to Triton
kernels, each (value, bucket) step is captured as one CUDA graph and replayed, over a mirror of
the owner's metadata on the device, and the epoch's records reach the host in one copy.
"""

from __future__ import annotations

import functools
import gc
import operator
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from lmpm.errors import RuntimeFault
from lmpm.ir.nodes import PredKind
from lmpm.resolve import policies
from lmpm.resolve.plan import Plan
from lmpm.runtime.data.agree import drop_hard, keep_top
from lmpm.runtime.data.clocks import clock_reads
from lmpm.runtime.protocol import checksum
from lmpm.runtime.records import HELD, NO_QUORUM, NO_WINNER
from lmpm.workers import simcuda

# The compiled steps' inductor cache (kept across runs: a warm cache skips code generation).
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_dir() -> Path:
    """Where compiled kernels are cached across runs: ``$TORCHINDUCTOR_CACHE_DIR``, else
    ``~/.cache/lmpm/inductor``."""
    got = os.environ.get(CACHE_ENV)
    return Path(got) if got else Path.home() / ".cache" / "lmpm" / "inductor"


@dataclass(frozen=True, slots=True)
class _Check:
    """One constraint as the compiled step evaluates it."""

    forbid: bool
    in_set: bool  # else change()
    covers_all: bool  # speaks about every cell (no row mask)
    needs_inputs: bool  # `inputs()` region: masked by the cells committed from an input
    hard: bool  # a proposal violating it is not eligible


@dataclass(frozen=True, slots=True)
class StepSpec:
    """What one value's compiled step bakes into its graph (its candidate columns, which rules
    and replicas proposed this epoch, are a :data:`Layout` beside it)."""

    value: str
    rules: tuple[int, ...]  # the rules proposing the value, in plan order
    cdims: int  # len(cell_shape)
    dtype: torch.dtype
    policy: str  # satisfy | winner_takes_all | average (under a quorum: its inner policy)
    quorum: int  # the votes a payload needs (`quorum(k, ...)`); 0: no quorum
    folds: bool  # a proposal equal to the committed payload folds into keep-current
    checks: tuple[_Check, ...]
    priority: tuple[int, ...]  # per constraint
    # blocked reasons: constraint columns from the highest priority down, and their ids
    order: tuple[int, ...]
    ids: tuple[int, ...]
    clock_rule: tuple[int, ...]  # per clock read: its rule's index in ``rules``
    clock_sources: tuple[str, ...]  # per clock read: the value whose clocks it reads
    clock_uniform: tuple[bool, ...]
    clock_masked: tuple[bool, ...]
    others: tuple[str, ...]  # the other values whose clocks the reads take (one input each)
    tracks_inputs: bool  # the worker keeps the value's input flags (an `inputs()` constraint)
    quota: bool  # the schedule commits a quota of the cells (confidence)


# One epoch's candidate columns after keep-current: per rule replica that proposed, in the
# order the eager worker lays them out (lmpm.runtime.data.candidates), (rule id, replica, width).
Layout = tuple[tuple[int, int, int], ...]

_NO_QUOTA = 2**62  # a quota no epoch reaches

# the policies the compiled step expresses, by the name StepSpec bakes in
_POLICIES = {
    policies.satisfy: "satisfy",
    policies.winner_takes_all: "winner_takes_all",
    policies.average: "average",
}


def _policy(plan: Plan, value: str) -> tuple[str | None, int, str | None]:
    """(the policy the step runs, a quorum's votes (0: none), why it cannot (None: it can))."""
    vp = plan.values[value]
    name = _POLICIES.get(vp.policy)
    if name is not None:
        return name, 0, None
    user = user_policy(plan, value)
    k = policies.quorum_k(vp.policy, vp.policy_args) or 0
    if user is not None:
        return None, k, f"its policy `{user}` is user Python code (lmpm.resolve.policies.register)"
    inner = vp.policy_args[1] if len(vp.policy_args) > 1 else "satisfy"
    name = _POLICIES.get(policies.POLICIES[str(inner[0] if isinstance(inner, tuple) else inner)])
    if name is None:  # (a quorum inside a quorum)
        return None, k, f"its policy {vp.policy_text} nests a quorum in a quorum"
    return name, k, None


def user_policy(plan: Plan, value: str) -> str | None:
    """The name of the user's own policy (registered Python code) that commits ``value``,
    directly or inside a quorum; None when LMPM's policies decide it (the step traces them)."""
    vp = plan.values[value]
    fn, args = vp.policy, vp.policy_args
    if fn is policies.quorum:
        inner = args[1] if len(args) > 1 else "satisfy"
        fn = policies.POLICIES[str(inner[0] if isinstance(inner, tuple) else inner)]
    if fn in _POLICIES or fn is policies.quorum:
        return None
    return next((n for n, f in policies.POLICIES.items() if f is fn), vp.policy_text)


def eligibility(plan: Plan, value: str, *, quota: bool = False) -> str | None:
    """Why ``value`` runs eagerly under ``--compile`` (None: it compiles): user Python code
    decides it (a bound predicate, a registered policy), or it averages tokens (an error)."""
    vp = plan.values[value]
    name, _, why = _policy(plan, value)
    if why is not None:
        return why
    if name == "average" and not vp.dtype.is_floating_point:
        return "average of a value that holds tokens (the eager epoch reports B031)"
    for cp in plan.live_constraints.get(value, []):
        if cp.pred not in (PredKind.IN_SET, PredKind.CHANGE):
            return f"constraint `{cp.name}` is a bound Python predicate"
    return None


def step_spec(plan: Plan, value: str, *, quota: bool = False) -> StepSpec:
    rules = plan.rules_by_target[value]
    vp = plan.values[value]
    cps = plan.live_constraints.get(value, [])
    prio = tuple(cp.priority for cp in cps)
    order = tuple(sorted(range(len(cps)), key=lambda j: -prio[j]))  # stable: program order
    reads = [(r, cr) for r, rp in enumerate(rules) for cr in clock_reads(rp)]
    sources = tuple(cr.source for _, cr in reads)
    name, k, _ = _policy(plan, value)
    assert name is not None
    return StepSpec(
        value,
        tuple(rp.id for rp in rules),
        len(vp.cell_shape),
        vp.dtype,
        name,
        k,
        not policies.aggregates(vp.policy, vp.policy_args),
        tuple(
            _Check(
                cp.kind == "forbid",
                cp.pred == PredKind.IN_SET,
                bool(cp.cells.all()) and not cp.needs_inputs_region,
                cp.needs_inputs_region,
                cp.ir.hard,
            )
            for cp in cps
        ),
        prio,
        order,
        tuple(cps[j].id for j in order),
        tuple(r for r, _ in reads),
        sources,
        tuple(cr.uniform for _, cr in reads),
        tuple(cr.valid is not None for _, cr in reads),
        tuple(dict.fromkeys(s for s in sources if s != value)),
        any(cp.needs_inputs_region for cp in cps),
        quota,
    )


class StepInputs(NamedTuple):
    """A compiled step's fixed tensor inputs, in the order of its flat signature (the tables of
    :class:`StepTables` follow them)."""

    e: Tensor  # () int64
    cells: Tensor  # (n,) int64, sorted, unique (padding repeats row 0)
    prop: Tensor  # (n, P, *cell): every proposing rule replica's columns (the Layout)
    sc: Tensor  # (n, P) float64
    fired: Tensor  # (n, P) bool: the column's rule fired on the cell
    payload: Tensor  # the data plane's (N, *cell)
    dp_committed: Tensor  # the data plane's (N,) bool
    from_input: Tensor  # the data plane's (N,) bool
    committed: Tensor  # the owner's (N,) bool
    clock: Tensor  # (N,) int64
    rule: Tensor  # (N,) int64
    epoch: Tensor  # (N,) int64
    kept_score: Tensor  # (N,) float64
    why: Tensor  # (N,) int64
    active: Tensor  # (K,) bool: the constraint is in the RuleSet
    limit: Tensor  # (2,) int64: the schedule's quota this epoch, the open cells unpadded


class StepTables(NamedTuple):
    """A compiled step's static tables (lists whose lengths its graph is traced for)."""

    vtables: Sequence[Tensor]  # per IN_SET check: (vocab + 2,) violation table
    where: Sequence[Tensor]  # per check not covering all cells: (N,) bool
    clock_index: Sequence[Tensor]  # per clock read: (R,) uniform, else (N, K) source index
    clock_valid: Sequence[Tensor]  # per masked clock read: (N, K) bool
    clock_src: Sequence[Tensor]  # per value in StepSpec.others: its (M,) clocks


class _Cols(NamedTuple):
    """One value's candidate table inside the step, unrolled by column (column 0: keep-current)."""

    cols: list[Tensor]  # per column (n, *cell) payload
    score: list[Tensor]  # per column (n,) float64
    valid: list[Tensor]  # per column (n,) bool
    was: Tensor  # (n,) bool: the open cell was committed before the epoch
    kept: Tensor  # (n,) float64: its committed score
    rule: tuple[int, ...]  # per column its rule id (-1: keep), from the Layout
    replica: tuple[int, ...]  # per column its rule's replica (-1: keep)
    slot: tuple[int, ...]  # per column its proposal slot (-1: keep)


class _Agreed(NamedTuple):
    """Stage 4's result inside the step."""

    winner: Tensor  # (n,) int64 winning column (0: keep)
    changed: Tensor  # (n,) bool: the cell commits
    new: Tensor  # (n, *cell) the payload a committing cell writes
    rule: Tensor | None  # (n,) the winning column's rule (None: the value has one rule)
    contributed: list[Tensor | None] | None  # per rule: the cells its clocks count for
    lost: Tensor | None  # (n,) bool under a quorum: no proposed payload had its k votes
    sums: Tensor | None  # (n, C) int64 under a quorum: the candidates' payload checksums


def columns_of(layout: Layout) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per candidate column (column 0: keep, -1) its rule id, replica and proposal slot."""
    rule, rep, slot = [-1], [-1], [-1]
    for rid, replica, width in layout:
        rule += [rid] * width
        rep += [replica] * width
        slot += list(range(width))
    return tuple(rule), tuple(rep), tuple(slot)


def value_step(spec: StepSpec, layout: Layout) -> Callable[..., tuple[Tensor, ...]]:
    """The plain (uncompiled) function of one value's epoch after its models, for the candidate
    columns of ``layout``: what :class:`CompiledEpoch` hands to ``torch.compile``. It writes the
    payload and the metadata in place and returns the epoch's records. The stages are the eager
    owner's (fold, check, agree, apply, clocks, why); fold and check are unrolled over the
    candidate columns (every operation elementwise over the open cells), agree is the eager
    agreement's own functions over the stacked (n, C) tables (:func:`_agree`)."""
    columns = columns_of(layout)

    def step(x: StepInputs, t: StepTables) -> tuple[Tensor, ...]:
        c = _fold(spec, x, columns)
        verdicts, applies = _check(spec, c, x, t)
        tab = _tables(c, verdicts)
        ag = _agree(spec, c, tab, x.limit)
        # apply: a cell that keeps writes back its own payload (column 0)
        hit = ag.changed.reshape(-1, *([1] * spec.cdims))
        cells = x.cells
        x.payload.index_put_((cells,), torch.where(hit, ag.new, c.cols[0]))
        now = c.was | ag.changed
        x.committed.index_put_((cells,), now)
        x.dp_committed.index_put_((cells,), now)
        if spec.tracks_inputs:
            x.from_input.index_put_((cells,), x.from_input.index_select(0, cells) & ~ag.changed)
        own = x.clock.index_select(0, cells)
        top = _clock_top(spec, x, t, ag.contributed)
        new_clock = torch.where(ag.changed, top + 1, own)
        _write_meta(spec, x, ag, (new_clock, _pick(c.score, ag.winner, 0)))
        code = _why(spec, c, verdicts)
        if ag.lost is not None:  # no proposal had its k votes: the disagreement, not a constraint
            code = torch.where(ag.lost, NO_QUORUM, code)
        if spec.quota:  # winners the quota held back: not "no candidate"
            code = torch.where(ag.winner != 0, HELD, code)
        code = torch.where(~ag.changed & ~c.was, code, x.why.index_select(0, cells))
        x.why.index_put_((cells,), code)
        quorum = () if ag.lost is None or ag.sums is None else (ag.lost, ag.sums)
        return (
            ag.winner,
            ag.changed,
            *tab,
            _applies(applies, ag.changed),
            new_clock,
            c.was,
            *quorum,
            _counts(c, verdicts, ag.changed, x.e),
        )

    return step


def _fold(spec: StepSpec, x: StepInputs, columns: tuple[tuple[int, ...], ...]) -> _Cols:
    """Stage 2, fold candidates: the open cells' current payload as column 0, the proposals as
    columns 1..P (valid where their rule fired; ``columns``: :func:`columns_of` the Layout); a
    proposal equal to the committed payload is keep-current, freshly scored (not under an
    aggregating policy, where it counts as any)."""
    cells = x.cells
    current = x.payload.index_select(0, cells)  # (n, *cell)
    was = x.committed.index_select(0, cells)
    kept = x.kept_score.index_select(0, cells)
    width = x.prop.shape[1]
    cols = [current] + [x.prop[:, j].to(spec.dtype) for j in range(width)]
    scs = [x.sc[:, j] for j in range(width)]
    fired = [x.fired[:, j] for j in range(width)]
    if not spec.folds:
        return _Cols(cols, [kept, *scs], [torch.ones_like(was), *fired], was, kept, *columns)
    same = [_equal(col, current, spec.cdims) & was & f for col, f in zip(cols[1:], fired)]
    refreshed = _any(same)
    best_same = _max([torch.where(m, s, -torch.inf) for m, s in zip(same, scs)])
    score = [torch.where(refreshed, best_same, kept), *scs]
    valid = [torch.ones_like(was)] + [f & ~m for f, m in zip(fired, same)]
    return _Cols(cols, score, valid, was, kept, *columns)


def _equal(x: Tensor, y: Tensor, cdims: int) -> Tensor:
    eq = x == y
    return eq.flatten(1).all(dim=1) if cdims else eq


def _check(
    spec: StepSpec, c: _Cols, x: StepInputs, t: StepTables
) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Stage 3, check: per constraint, per column (n,) verdicts, masked by the cells the
    constraint speaks about, the RuleSet and the candidates that exist; and per constraint the
    (n,) cells it applies to."""
    cells = x.cells
    n = cells.shape[0]
    was = c.was
    verdicts: list[list[Tensor]] = []  # [constraint][column]
    applies: list[Tensor] = []
    vt = iter(t.vtables)
    wt = iter(t.where)
    for j, ck in enumerate(spec.checks):
        if ck.in_set:
            vtab = next(vt)
            hi = vtab.numel() - 2
            viol = [
                vtab.take((v if v.dtype == torch.int64 else v.long()).clamp(-1, hi)) for v in c.cols
            ]
        else:
            current = c.cols[0]
            holds = [torch.zeros_like(was)]
            holds += [~_equal(v, current, spec.cdims) & was for v in c.cols[1:]]
            viol = holds if ck.forbid else [~h for h in holds]
        # keep-current of an unset cell satisfies every forbid, violates every require
        viol[0] = viol[0] & was if ck.forbid else viol[0] | ~was
        on = x.active[j].expand(n)
        if not ck.covers_all:
            on = on & next(wt).index_select(0, cells)
            if ck.needs_inputs:
                on = on & x.from_input.index_select(0, cells)
        verdicts.append([v & ok & on for v, ok in zip(viol, c.valid)])
        applies.append(on)
    return verdicts, applies


def _agree(spec: StepSpec, c: _Cols, tab: tuple[Tensor, Tensor, Tensor], limit: Tensor) -> _Agreed:
    """Stage 4, agree: the eager agreement's own functions (:func:`lmpm.runtime.data.agree.agree`)
    traced over the stacked (n, C) tables ``tab`` (score, valid, violated): a proposal violating a
    `hard` constraint is not eligible (:func:`~lmpm.runtime.data.agree.drop_hard`), then the
    policy itself (:mod:`lmpm.resolve.policies`: a quorum's votes, its inner policy) picks the
    (n,) winning column (0: keep); which cells commit (a quota keeps the most confident:
    :func:`_quota`) and the (n, *cell) payload a committing cell writes (the winner's; an
    aggregating policy's: :func:`_mean` of its weights)."""
    score, valid, violated = tab
    dev = score.device
    hard = [ck.hard for ck in spec.checks]
    eligible = valid
    if any(hard):
        eligible = drop_hard(valid, violated, policies.host_tensor(hard, torch.bool, dev))
    sums = (
        torch.stack([checksum(col, spec.cdims) for col in c.cols], dim=1) if spec.quorum else None
    )
    rule, replica, slot = (
        policies.host_tensor(t, torch.int64, dev) for t in (c.rule, c.replica, c.slot)
    )
    a = policies.Agree(
        torch.empty(0, dtype=torch.int64, device=dev) if sums is None else sums,
        eligible,
        score,
        violated,
        policies.levels(spec.priority, dev),  # its key built inside the graph
        rule,
        replica,
        slot,
        spec.dtype.is_floating_point,
    )
    if spec.quorum:
        decision = policies.quorum(a, spec.quorum, spec.policy)
    else:
        decision = policies.get_policy(spec.policy)(a)
    winner = decision.winner
    lost = None  # (as lmpm.runtime.data.decide.quorum_lost: the votes before `hard`)
    if sums is not None:
        lost = policies.quorum_lost(sums, valid, rule, slot, spec.quorum)
    w = decision.weights
    new = _pick(c.cols, winner, spec.cdims) if w is None else _mean(spec, c, w)
    changed = winner != 0
    if spec.quota:
        changed = _quota(changed, _pick(c.score, winner, 0), limit)
    if w is not None:  # (after the quota, as the worker's write) an unchanged mean is no commit
        changed = changed & ~(_equal(new, c.cols[0], spec.cdims) & c.was)
    won, contributed = _contributions(spec, c, winner, w)
    return _Agreed(winner, changed, new, won, contributed, lost, sums)


def _contributions(
    spec: StepSpec, c: _Cols, winner: Tensor, weights: Tensor | None
) -> tuple[Tensor | None, list[Tensor | None] | None]:
    """:func:`lmpm.runtime.data.decide.contributions`: with several rules, (n,) each cell's
    winning rule and per rule the cells whose commit it contributed to (the winner's rule, or
    every rule an aggregate weighs; None for a rule that did not propose). One rule: (None, None)."""
    if len(spec.rules) < 2:
        return None, None
    won = torch.full_like(winner, -1)
    for j in range(1, len(c.rule)):
        won = torch.where(winner == j, c.rule[j], won)
    out: list[Tensor | None] = []
    for rid in spec.rules:
        cols = [j for j in range(1, len(c.rule)) if c.rule[j] == rid]
        if not cols:
            out.append(None)
        elif weights is not None:
            out.append(_any([weights[:, j] > 0 for j in cols]))
        else:
            out.append(won == rid)
    return won, out


def _quota(changed: Tensor, won: Tensor, limit: Tensor) -> Tensor:
    """A schedule's quota (:func:`lmpm.runtime.data.agree.keep_top`, the eager function): when
    more cells would commit than ``limit[0]`` allows, the most confident ones. ``limit[1]``: the
    open cells before padding; the padded rows (copies of row 0) decide as row 0."""
    real = torch.arange(changed.shape[0], device=changed.device) < limit[1]
    conf = torch.where(changed & real, won, -torch.inf)
    some = changed & real
    kept = torch.where(some.sum() > limit[0], some & keep_top(conf, limit[0]), some)
    return torch.where(real, kept, kept[0].expand(kept.shape[0]))


def _mean(spec: StepSpec, c: _Cols, weights: Tensor) -> Tensor:
    """The worker's weighted write of an aggregating policy's :class:`~lmpm.resolve.policies.
    Decision` (:meth:`lmpm.runtime.data.dataplane.DataPlane.apply`), the same float64 sums:
    ``sum_c w[c] * candidate[c] / sum_c w[c]`` per cell."""
    wv = weights.reshape(*weights.shape, *([1] * spec.cdims))
    table = torch.stack(c.cols, dim=1).to(torch.float64)
    count = weights.sum(dim=1).clamp(min=1e-300).reshape(-1, *([1] * spec.cdims))
    return ((wv * table).sum(dim=1) / count).to(spec.dtype)


def _clock_top(
    spec: StepSpec, x: StepInputs, t: StepTables, contributed: list[Tensor | None] | None
) -> Tensor:
    """Stage 6, advance clocks (:meth:`lmpm.runtime.data.clocks.Clocks.advance`): (n,) max(own
    clock, every clock read by a rule that contributed to the cell's commit); a committing
    cell's new clock is one more. Clocks are never negative: a read that does not count is 0."""
    cells = x.cells
    n = cells.shape[0]
    top = x.clock.index_select(0, cells)
    ci = iter(t.clock_valid)
    srcs = dict(zip(spec.others, t.clock_src))
    for j, uniform in enumerate(spec.clock_uniform):
        own_read = spec.clock_sources[j] == spec.value
        src = x.clock if own_read else srcs[spec.clock_sources[j]]  # own: no aliased input
        valid = next(ci) if spec.clock_masked[j] else None
        sel = None if contributed is None else contributed[spec.clock_rule[j]]
        if contributed is not None and sel is None:
            continue  # its rule proposed nothing this epoch
        if uniform:
            got = src.index_select(0, t.clock_index[j]).amax().expand(n)
        else:
            g = src.take(t.clock_index[j].index_select(0, cells).long())
            if valid is not None:
                g = g * valid.index_select(0, cells)
            # a few reads unrolled (a compiled loop reduces a short row poorly); a causal
            # context's dozens of reads as one reduction (an unrolled graph would grow with N)
            width = g.shape[1]
            got = _max([g[:, i] for i in range(width)]) if width <= 8 else g.amax(dim=1)
        if sel is not None:
            got = torch.where(sel, got, 0)
        top = torch.maximum(top, got)
    return top


def _write_meta(spec: StepSpec, x: StepInputs, ag: _Agreed, new: tuple[Tensor, Tensor]) -> None:
    """Stage 7, write metadata (:func:`lmpm.runtime.data.decide.write_meta`, as a graph over the
    open cells): clock, provenance (the winning column's rule), epoch and score of the
    committing ones."""
    cells, changed = x.cells, ag.changed
    new_clock, won = new
    x.clock.index_put_((cells,), new_clock)
    rule = spec.rules[0] if ag.rule is None else ag.rule
    x.rule.index_put_((cells,), torch.where(changed, rule, x.rule.index_select(0, cells)))
    x.epoch.index_put_((cells,), torch.where(changed, x.e, x.epoch.index_select(0, cells)))
    kept = x.kept_score.index_select(0, cells)
    x.kept_score.index_put_((cells,), torch.where(changed, won, kept))


def _why(spec: StepSpec, c: _Cols, verdicts: list[list[Tensor]]) -> Tensor:
    """Stage 8, record why (:func:`lmpm.runtime.data.decide.blocked_why`, unrolled): the
    highest-priority constraint every valid proposal violates, else one some proposal violates,
    else no winner."""
    code = torch.full_like(c.was, NO_WINNER, dtype=torch.int64)
    if not spec.checks:
        return code
    valid = c.valid[1:]
    some = _any(valid)
    every = [_all([v | ~ok for v, ok in zip(verdicts[i][1:], valid)]) & some for i in spec.order]
    anyv = [_any([v & ok for v, ok in zip(verdicts[i][1:], valid)]) for i in spec.order]
    for hit in (anyv, every):  # `every` overrides `some`
        for i in reversed(range(len(spec.order))):  # the first hit (highest priority) last
            code = torch.where(hit[i], spec.ids[i], code)
    return code


def _tables(c: _Cols, verdicts: list[list[Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate tables the policies take and the epoch records: score (n, C) float64, valid
    (n, C) bool, violated (n, C, K) bool."""
    n = c.was.shape[0]
    if verdicts:
        violated = torch.stack([torch.stack(v, dim=1) for v in verdicts], dim=2)
    else:
        violated = torch.zeros((n, len(c.cols), 0), dtype=torch.bool, device=c.was.device)
    return torch.stack(c.score, dim=1), torch.stack(c.valid, dim=1), violated


def _applies(applies: list[Tensor], changed: Tensor) -> Tensor:
    """The epoch record's (n, K) bool: the cells each constraint applies to."""
    if applies:
        return torch.stack(applies, dim=1)
    return torch.ones((changed.shape[0], 0), dtype=torch.bool, device=changed.device)


def _counts(c: _Cols, verdicts: list[list[Tensor]], changed: Tensor, e: Tensor) -> Tensor:
    """(2,) int64: how many cells commit, how many (cell, candidate) pairs violate a constraint."""
    if verdicts:
        n_viol = _sum([_any([v[col] for v in verdicts]) for col in range(len(c.cols))]).sum()
    else:
        n_viol = e * 0
    return torch.stack((changed.sum(), n_viol))


def _any(xs: Sequence[Tensor]) -> Tensor:
    out = xs[0]
    for x in xs[1:]:
        out = out | x
    return out


def _all(xs: Sequence[Tensor]) -> Tensor:
    out = xs[0]
    for x in xs[1:]:
        out = out & x
    return out


def _max(xs: Sequence[Tensor]) -> Tensor:
    out = xs[0]
    for x in xs[1:]:
        out = torch.maximum(out, x)
    return out


def _pick(cols: Sequence[Tensor], winner: Tensor, cdims: int) -> Tensor:
    """``cols[winner]`` per cell (a chain of selects over the unrolled columns)."""
    out = cols[0]
    for j in range(1, len(cols)):
        hit = (winner == j).reshape(-1, *([1] * cdims))
        out = torch.where(hit, cols[j], out)
    return out


def _sum(xs: Sequence[Tensor]) -> Tensor:
    out = xs[0].to(torch.int64)
    for x in xs[1:]:
        out = out + x.to(torch.int64)
    return out


def bucket(n: int) -> int:
    """The padded row count a step of ``n`` open cells is compiled for (a power of two)."""
    return 1 << max(n - 1, 0).bit_length()


def freeze_compiled() -> None:
    """After compiling: inductor loaded millions of long-lived objects that every later full
    garbage collection would walk (a 50 ms pause in some epoch). Freeze them out of it."""
    gc.collect()
    gc.freeze()


@dataclass
class CompileStats:
    """What ``--compile`` did in a run (``lmpm run`` prints it; benchmarks read it)."""

    compiles: int = 0  # graphs compiled (per value and shape bucket; per rule for read gathers)
    cache_hits: int = 0  # of those, found in inductor's on-disk cache (an earlier run built them)
    compile_seconds: float = 0.0  # tracing and code generation (a warm cache skips most)
    steps: int = 0  # compiled steps run
    eager_epochs: int = 0  # epochs run eagerly (tracing candidates, taps, faults)
    captures: int = 0  # CUDA graphs captured (per value and bucket; again if its tensors moved)
    buckets: dict[str, set[int]] = field(default_factory=dict)  # value -> open-cell buckets

    def record(self, how: str, seconds: float) -> None:
        """One graph obtained by :func:`compile_graph` (``how``: built, cached, reused, or
        simulated: the step's own function on the simulated device) in ``seconds``."""
        if how != "reused":
            self.compiles += 1
            self.cache_hits += how == "cached"
            if how != "simulated":  # inductor loaded nothing
                freeze_compiled()
        self.compile_seconds += seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "compiles": self.compiles,
            "cache_hits": self.cache_hits,
            "compile_seconds": round(self.compile_seconds, 3),
            "steps": self.steps,
            "eager_epochs": self.eager_epochs,
            "captures": self.captures,
        }


# The step's fixed inputs come first in its flat signature (by field), then its table lists.
_HEAD = len(StepInputs._fields)
# The step's inputs made per epoch at the shapes its key fixes come first (e, cells, prop, sc,
# fired); the run's tensors follow (a Graph holds them; the RuleSet mask among them is replaced
# only when the RuleSet changes, and then checked once).
_PER_EPOCH = StepInputs._fields.index("payload")


def flat_step(step: Callable[..., tuple[Tensor, ...]], lens: tuple[int, ...]) -> Callable[..., Any]:
    """``step`` over one flat tuple of tensors (what a traced graph takes): a
    :class:`StepInputs`, then the :class:`StepTables` lists of lengths ``lens``."""

    def flat(*ts: Tensor) -> tuple[Tensor, ...]:
        rest = list(ts[_HEAD:])
        lists = []
        for n in lens:
            lists.append(rest[:n])
            rest = rest[n:]
        return step(StepInputs(*ts[:_HEAD]), StepTables(*lists))

    return flat


# Compiled graphs of this process, by spec and the exact signature of their inputs: a later run
# of the same program (tests, benchmarks, notebooks) reuses them.
_GRAPHS: dict[tuple[Any, ...], tuple[Callable[..., Any], torch.fx.GraphModule]] = {}


def signature(args: Sequence[Tensor]) -> tuple[Any, ...]:
    """What a compiled graph is specialised to in its inputs: dtype, shape, strides, device."""
    return tuple((t.dtype, tuple(t.shape), t.stride(), t.device) for t in args)


class Graph:
    """A compiled graph and the inputs it is called with, checked cheaply per call.

    A graph compiled with ``guarded=True`` (:func:`compile_graph`) asserts nothing about its
    inputs: it reads and writes them at the sizes and strides it was compiled for. Its caller
    keys it by what fixes the shapes of the inputs that change per call (a step's value, bucket,
    column layout and dtype: the open cells, proposals, scores, fired and RuleSet mask are made
    contiguous at those shapes) and holds the run's other inputs (the payload, the owner's
    metadata, the static tables) here: :meth:`holds` is true while they are the very tensors the
    signature was checked on (one identity test per input, C-level). A new tensor there (a
    resume, a restore) is checked in full once (:func:`signature`), and a graph for another
    signature is compiled (:meth:`CompiledEpoch.step`)."""

    __slots__ = ("call", "first", "fn", "held", "sig")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Sequence[Tensor],
        first: int,
        sig: tuple[Any, ...] | None = None,
    ) -> None:
        self.fn = fn
        # where ``fn`` is a bare graph (_direct), the C++ entry it calls (_entry): the caller
        # passes it its tuple of inputs, one Python frame and list fewer per call
        self.call: Callable[[Sequence[Tensor]], Any] | None = _LIST_CALLS.get(fn)
        self.sig = signature(args) if sig is None else sig  # (``sig``: the caller's, of args)
        self.first = first  # args[first:] are the run's (checked by identity)
        self.held: tuple[Tensor, ...] = tuple(args[first:])

    def holds(self, args: Sequence[Tensor]) -> bool:
        """Whether the run's inputs in ``args`` are the tensors last checked."""
        return all(map(operator.is_, args[self.first :], self.held))

    def check(self, args: Sequence[Tensor]) -> bool:
        """Check ``args`` in full against the graph's signature; hold them when they match."""
        if signature(args) != self.sig:
            return False
        self.held = tuple(args[self.first :])
        return True


def _direct(fn: Callable[..., Any], args: Sequence[Tensor]) -> Callable[..., Any]:
    """The compiled graph itself, without the wrappers ``compile_fx`` puts around it (a dynamo
    guard switch, AOT autograd's runtime wrappers: five Python calls, ~25 µs an epoch once the
    model has evicted them from the caches), when calling it alone does exactly what the wrapped
    call does: checked once, on copies of the inputs (outputs and inputs written in place equal).
    Otherwise ``fn`` as it is. The graph is the inductor module's ``call`` (a list of inputs in,
    a list of outputs back), which ``CompiledFxGraph.__call__`` runs and which AOT autograd's
    wrapper carries as ``current_callable``; with a C++ wrapper, its C++ entry itself
    (:func:`_entry`)."""
    inner: Any = fn
    while not callable(getattr(inner, "current_callable", None)):
        inner = getattr(inner, "__wrapped__", None)
        if inner is None:
            return fn
    call = inner.current_callable
    bare = _entry(call)
    run = call if bare is None else bare

    def direct(*ts: Tensor) -> Any:
        return run(list(ts))

    a, b = [t.clone() for t in args], [t.clone() for t in args]
    try:
        want, got = fn(*a), direct(*b)
    except Exception:
        return fn
    same = len(want) == len(got) and all(torch.equal(x, y) for x, y in zip(want, got))
    if same and all(torch.equal(x, y) for x, y in zip(a, b)):
        if bare is not None:
            _LIST_CALLS[direct] = bare
        return direct
    return fn


def _entry(call: Callable[[list[Tensor]], Any]) -> Callable[[Sequence[Tensor]], Any] | None:
    """A C++-wrapped inductor module's ``call`` as its C++ entry between the two conversions of
    tensors to and from handles (the inputs a sequence of tensors): ``call`` (``_wrap_func``'s
    ``g`` over the entry ``f``) first turns every input that is not a tensor into one, in a
    Python loop over the inputs (a step has ~20, all tensors). None for any other ``call`` (a
    Python wrapper); :func:`_direct` checks the result either way."""
    code = getattr(call, "__code__", None)
    cells = getattr(call, "__closure__", None)
    if code is None or code.co_freevars != ("f",) or not cells:
        return None
    entry = cells[0].cell_contents
    # (typed for a list; pybind11 converts any sequence, the step's tuple of arguments)
    to_handles = cast(
        Callable[[Sequence[Tensor]], Any], torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
    )
    from_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs

    def bare(args: Sequence[Tensor]) -> Any:
        return from_handles(entry(to_handles(args)))

    return bare


# a bare graph (_direct's) -> the inductor call it wraps, taking its inputs as one sequence
_LIST_CALLS: dict[Callable[..., Any], Callable[[Sequence[Tensor]], Any]] = {}


_SIMULATED: dict[tuple[Any, ...], Callable[..., Any]] = {}


def simulated(
    key: tuple[Any, ...], make: Callable[[], Callable[..., Any]]
) -> tuple[Callable[..., Any], str] | None:
    """On the simulated CUDA device (:mod:`lmpm.workers.simcuda`), which has no inductor backend,
    a graph is its step's own function (what a capture then replays and what the device check
    proves): (it, "simulated"), or "reused" when this process made it before; None elsewhere."""
    if simcuda.active() is None:
        return None
    hit = _SIMULATED.get(key)
    if hit is not None:
        return hit, "reused"
    fn = _SIMULATED[key] = make()
    return fn, "simulated"


# (key, make, args) -> (the callable graph, its aten graph, how it was obtained): compile_graph
Compiler = Callable[
    [tuple[Any, ...], Callable[[], Callable[..., Any]], Sequence[Tensor]],
    tuple[Callable[..., Any], torch.fx.GraphModule, str],
]


def compile_graph(
    key: tuple[Any, ...],
    make: Callable[[], Callable[..., Any]],
    args: Sequence[Tensor],
    *,
    cpp_wrapper: bool = True,
    guarded: bool = False,
) -> tuple[Callable[..., Any], torch.fx.GraphModule, str]:
    """Trace ``make()`` (a function of flat tensors, with no Python decision that depends on
    their values) on the shapes of ``args`` into one aten graph with ``make_fx`` and compile it
    with inductor: explicit graphs, no dynamo frame and no guards; the caller calls the result
    only with inputs of this signature (``key`` says everything else the graph depends on).
    ``guarded``: the caller holds every call to that signature itself (a :class:`Graph`), so on
    the CPU the graph asserts no input's size and stride per call and allocates its scratch
    buffers as one block (together a third of a one-cell step's call). Returns (compiled, graph,
    how): "built" (code generated now), "cached" (inductor's on-disk cache had it, from an
    earlier run) or "reused" (this process had it)."""
    hit = _GRAPHS.get(key)
    if hit is not None:
        return hit[0], hit[1], "reused"
    with warnings.catch_warnings():
        # inductor's imports and code generation warn about torch internals, not about the run
        warnings.simplefilter("ignore")
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = make_fx(make(), tracing_mode="fake")(*args)
        options: dict[str, Any] = {
            # realize intermediates used by several loops instead of recomputing them in each (a
            # step reads the same gathered rows in its checks, its agreement and its writes)
            "realize_opcount_threshold": 4,
            # buffers allocated and the kernels called in C++, not Python
            "cpp_wrapper": cpp_wrapper,
            # Scalar loops: a step is gathers and scatters by cell index, which vectorized loops
            # do lane by lane through a stack buffer (7× slower at 32,768 open cells).
            "cpp.simdlen": 1,
            # A stack of unrolled columns (the candidate tables) as one pointwise loop: inductor's
            # CPU default writes each column into a slice of the stacked buffer, a tensor view
            # made and freed per column and call (30 of a one-cell text step's ~75 tensor
            # handles: 23 -> 18 us a call with warm caches)
            "force_pointwise_cat": True,
        }
        if guarded:
            # The C++ wrapper checks each input's sizes and strides with a std::stringstream
            # built per input and call; a Graph has checked them once. One allocation for the
            # intermediate buffers instead of one each (a one-cell step has ~25).
            options |= {"size_asserts": False, "memory_planning": True}
        from torch._dynamo.utils import counters

        hits = counters["inductor"]["fxgraph_cache_hit"]
        if not all(t.device.type == "cpu" for t in args):
            options = {"realize_opcount_threshold": 4}  # Triton kernels, a Python wrapper
        with config.patch(options):
            fn: Callable[..., Any] = compile_fx(gm, [t.clone() for t in args])  # type: ignore[assignment]
        cached = counters["inductor"]["fxgraph_cache_hit"] > hits
    if not any(node.op == "get_attr" for node in gm.graph.nodes):
        # a graph holding a tensor constant takes it as an extra input of ``call`` that only the
        # wrappers pass: called alone it would read past its inputs (a crash, not an exception)
        fn = _direct(fn, args)
    _GRAPHS[key] = (fn, gm)
    return fn, gm, "cached" if cached else "built"


class Fused(NamedTuple):
    """One compiled value's proposals in an epoch: every proposing rule replica's columns side by
    side, as the eager worker lays them out (:meth:`lmpm.runtime.data.candidates.Staging.build`).
    Indexed like a :class:`~lmpm.runtime.data.calls.Proposal`: ``[0]`` a rule, ``[1]`` the cells."""

    rule: Any  # the first part's RulePlan
    cells: Tensor  # (n,) open cells some part proposed for (sorted)
    layout: Layout
    proposals: Tensor  # (n, P, *cell)
    scores: Tensor  # (n, P) float64
    fired: Tensor | None  # (n, P) bool: the column's part proposed for the cell (None: all did)
    host_cells: Tensor | None  # ``cells`` on the host when the parts' cells differ (else None)


def fuse(parts: Sequence[Any], dtype: torch.dtype) -> Fused:
    """Lay out a value's parts (each rule replica's :class:`~lmpm.runtime.data.calls.Proposal`)
    as one block of candidate columns; where a part's rule did not fire on a cell its columns are
    not valid (zero payload, -inf score)."""
    first = parts[0]
    if len(parts) == 1:  # (one rule replica: its proposals are the columns as they are)
        layout: Layout = ((first.rule.id, first.replica, first.proposals.shape[1]),)
        return Fused(first.rule, first.cells, layout, first.proposals, first.scores, None, None)
    layout = tuple((p.rule.id, p.replica, p.proposals.shape[1]) for p in parts)
    if all(p.cells is first.cells or torch.equal(p.cells, first.cells) for p in parts[1:]):
        prop = torch.cat([p.proposals.to(dtype) for p in parts], 1)
        sc = torch.cat([p.scores for p in parts], 1)
        return Fused(first.rule, first.cells, layout, prop, sc, None, None)
    cells = torch.unique(torch.cat([p.cells for p in parts]))
    n, width = cells.numel(), sum(w for _, _, w in layout)
    dev = cells.device
    prop = torch.zeros((n, width, *first.proposals.shape[2:]), dtype=dtype, device=dev)
    sc = torch.full((n, width), -torch.inf, dtype=torch.float64, device=dev)
    fired = torch.zeros((n, width), dtype=torch.bool, device=dev)
    c = 0
    for p, (_, _, w) in zip(parts, layout):
        rows = torch.searchsorted(cells, p.cells)
        prop[rows, c : c + w] = p.proposals.to(dtype)
        sc[rows, c : c + w] = p.scores
        fired[rows, c : c + w] = True
        c += w
    return Fused(first.rule, cells, layout, prop, sc, fired, cells.cpu())


class Outvoted(NamedTuple):
    """A quorum value's candidate columns after its step, as
    :func:`lmpm.runtime.data.owner.dissent` reads them (the replicas a commit outvoted)."""

    checksum: Tensor  # (n, C) int64 payload checksums
    col_rule: Tensor  # (C,) rule id per column (-1: keep)
    col_replica: Tensor  # (C,) replica per column
    col_slot: Tensor  # (C,) proposal slot per column


class StepMeta(NamedTuple):
    """The owner's side of one value's step: its metadata (or the device's mirror of it)."""

    state: Any  # the value's CellState: committed, clock, rule, epoch, score (N,)
    why: Tensor  # (N,) int64 why-codes
    active: Tensor  # (K,) bool: its constraints in the RuleSet
    clocks: dict[str, Tensor]  # the clocks of the other values its rules read
    quota: int | None = None  # the schedule's quota (Owner.quota), when it has one


class CompiledEpoch:
    """The compiled steps of a run's values (built lazily, one graph per value, bucket and
    column layout)."""

    def __init__(self, plan: Plan, device: torch.device, *, quota: bool = False) -> None:
        self.plan = plan
        self.device = device
        self.stats = CompileStats()
        self.reasons: dict[str, str | None] = {
            name: eligibility(plan, name, quota=quota) for name in plan.rules_by_target
        }
        self.specs = {
            name: step_spec(plan, name, quota=quota)
            for name, why in self.reasons.items()
            if why is None
        }
        self._tables: dict[str, tuple[list[Tensor], ...]] = {}
        self._flat: dict[str, tuple[Tensor, ...]] = {}  # value -> its tables, in step order
        # (value, open-cell bucket, column layout, the proposals' dtype) -> compiled step, with
        # the run's tensors it reads (held by identity: a Graph)
        self._fns: dict[tuple[Any, ...], Graph] = {}
        self._cols: dict[Layout, Tensor] = {}
        self._ones: dict[tuple[int, int], Tensor] = {}
        self._e = torch.zeros((), dtype=torch.int64, device=device)
        # on the CPU the epoch is written through a NumPy view of it: no tensor operation
        self._e_host = self._e.numpy() if self._e.device.type == "cpu" else None
        # the steps' (2,) quota input: the schedule's quota, the open cells before padding
        self._limit = torch.zeros(2, dtype=torch.int64, device=device)
        # off the CPU: the steps captured as CUDA graphs (lmpm.runtime.data.captured)
        self.captured: Any = None
        os.environ.setdefault(CACHE_ENV, str(cache_dir()))
        # called before a step is compiled: (value, open-cell bucket); the CLI shows a note
        self.on_compile: Callable[[str, int], None] | None = None
        # how a step's graph is made from (key, make, args): compile_graph (trace and compile,
        # guarded: the step holds its inputs itself, a Graph);
        # `lmpm show --compiled` puts a tracer here that stops before anything runs
        self.compiler: Compiler = functools.partial(compile_graph, guarded=True)

    def compiles(self, value: str) -> bool:
        return value in self.specs

    def summary(self) -> str:
        """One line for the end of a run: what compiled, in how long, what ran eagerly."""
        st = self.stats
        parts = [
            f"compiled {len(self.specs)} of {len(self.reasons)} values "
            f"({st.compiles} graph{'s' if st.compiles != 1 else ''}"
            + (f", {st.cache_hits} from the cache" if st.cache_hits else "")
            + f", {st.compile_seconds:.1f} s building or loading them; {st.steps} compiled steps"
            + (
                f", replayed as {st.captures} CUDA graph{'s' if st.captures != 1 else ''})"
                if self.captured is not None
                else ")"
            )
        ]
        eager = [name for name, why in self.reasons.items() if why is not None]
        if eager:
            parts.append("eager: " + ", ".join(eager) + " (lmpm show --compiled says why)")
        if st.eager_epochs:
            parts.append(f"{st.eager_epochs} epochs ran eagerly (candidates traced)")
        return ", ".join(parts)

    def prepare(self, dataplane: Any) -> None:
        """Make every compiled value's static tables now (when the run compiles), so the first
        epoch does not."""
        for value in self.specs:
            self.tables(value, dataplane)

    def tables(self, value: str, dataplane: Any) -> tuple[list[Tensor], ...]:
        """The static tables a value's step reads (device copies, made once): its constraints'
        and every proposing rule's clock reads (in :attr:`StepSpec.clock_rule` order)."""
        hit = self._tables.get(value)
        if hit is None:
            tabs = dataplane.tables[value]
            vtables = [t for t in tabs.tables if t is not None]
            where = [c for c, whole in zip(tabs.cells, tabs.covers_all) if not whole]
            reads = [cr for rp in self.plan.rules_by_target[value] for cr in clock_reads(rp)]
            index = [
                dataplane.dev(cr.index) if cr.uniform else _int32(dataplane.dev(cr.index))
                for cr in reads
            ]
            valid = [dataplane.dev(cr.valid) for cr in reads if cr.valid is not None]
            hit = self._tables[value] = (vtables, where, index, valid)
        return hit

    def columns(self, layout: Layout) -> Tensor:
        """(C,) rule id per candidate column of ``layout`` (-1: keep)."""
        hit = self._cols.get(layout)
        if hit is None:
            hit = self._cols[layout] = torch.tensor(columns_of(layout)[0])
        return hit

    def replicas(self, layout: Layout) -> tuple[Tensor, Tensor]:
        """(C,) replica and proposal slot per candidate column of ``layout`` (-1: keep)."""
        _, rep, slot = columns_of(layout)
        return torch.tensor(rep), torch.tensor(slot)

    def step(
        self, value: str, e: int | Tensor, part: Fused, dataplane: Any, meta: StepMeta
    ) -> tuple[Tensor, ...]:
        """Run ``value``'s compiled step on one epoch's proposals; returns (winner, changed,
        score, valid, violated, applies, new_clock, was) for the ``n`` open cells, under a
        quorum (lost, checksums (n, C)), and (2,) int64: how many commit, how many (cell,
        candidate) pairs violate a constraint. ``e`` a 0-d device tensor: the step runs inside a
        window's capture (lmpm.runtime.data.kepochs), directly."""
        spec = self.specs[value]
        head, n, b = self._inputs(spec, e, part, meta)
        st = meta.state
        tables = self._flat.get(value)
        if tables is None:
            tables = self._flat[value] = tuple(
                t for ts in self.tables(value, dataplane) for t in ts
            )
        # the run's tensors (a Graph holds them by identity), in StepInputs order, then the tables
        args = (
            *head,
            dataplane.payload[value],
            dataplane.committed[value],
            dataplane.from_input[value],
            st.committed,
            st.clock,
            st.rule,
            st.epoch,
            st.score,
            meta.why,
            meta.active,
            self._limit,
            *tables,
            *([meta.clocks[s] for s in spec.others] if spec.others else ()),
        )
        prop = head[2]
        key = (value, b, part.layout, prop.dtype)  # (the graph reads the proposals' dtype)
        g = self._fns.get(key)
        # (Graph.holds, inlined: the identity test of the run's tensors)
        if g is None or not all(map(operator.is_, args[g.first :], g.held)):
            g = self._graph(key, spec, part.layout, args, e, g)
        if self.captured is not None and head[0] is self._e:  # on CUDA: replay the captured graph
            out = self.captured.run(key, g.fn, args)
        elif g.call is not None:
            out = g.call(args)
        else:
            out = g.fn(*args)
        self.stats.steps += 1
        if b == n:
            return tuple(out)
        # padded: the rows past n repeat row 0, so the counts are taken over the first n
        out = tuple(t[:n] for t in out[:-1])
        changed, violated = out[1], out[4]
        n_viol = violated.any(dim=2).count_nonzero() if violated.shape[2] else changed.sum() * 0
        return (*out, torch.stack((changed.count_nonzero(), n_viol)))

    def _graph(
        self,
        key: tuple[Any, ...],
        spec: StepSpec,
        layout: Layout,
        args: tuple[Tensor, ...],
        e: int | Tensor,
        g: Graph | None,
    ) -> Graph:
        """The graph of ``key`` for ``args``: ``g`` when the run's inputs that are new tensors
        have its signature (then held), else one compiled for theirs (inductor's and this
        process's caches make a return to an earlier signature cheap)."""
        if g is not None and g.check(args):
            return g
        sig = signature(args)  # (once: the compiled graphs' key and the Graph's check)
        fn = self._compile(spec, layout, args, e, sig)
        g = self._fns[key] = Graph(fn, args, _PER_EPOCH, sig)
        self.stats.buckets.setdefault(spec.value, set()).add(key[1])
        return g

    def _inputs(
        self, spec: StepSpec, e: int | Tensor, part: Fused, meta: StepMeta
    ) -> tuple[tuple[Tensor, ...], int, int]:
        """The step's inputs made per epoch (:class:`StepInputs` up to ``payload``: e, cells,
        prop, sc, fired) padded to the bucket (by repeating row 0: identical rows decide and
        write identically); with ``n`` and the bucket."""
        cells, prop, sc, fired = part.cells, part.proposals, part.scores, part.fired
        n = cells.numel()
        b = 1 << (n - 1).bit_length() if n > 1 else 1  # (bucket, inlined)
        if b != n:
            pad = b - n
            cells = torch.cat((cells, cells[:1].expand(pad)))
            prop = torch.cat((prop, prop[:1].expand(pad, *prop.shape[1:])))
            sc = torch.cat((sc, sc[:1].expand(pad, *sc.shape[1:])))
            if fired is not None:
                fired = torch.cat((fired, fired[:1].expand(pad, *fired.shape[1:])))
        if fired is None:  # every part proposed for every cell: one constant input
            key = (b, prop.shape[1])
            fired = self._ones.get(key)
            if fired is None:
                fired = self._ones[key] = torch.ones(key, dtype=torch.bool, device=self.device)
        if spec.quota:  # written in place: a captured graph reads it at its address
            self._limit.copy_(torch.tensor((_NO_QUOTA if meta.quota is None else meta.quota, n)))
        if isinstance(e, Tensor):
            e_t = e
        else:
            if self._e_host is not None:
                self._e_host[()] = e
            else:
                self._e.fill_(e)
            e_t = self._e
        # (the graph reads them at the strides it was compiled for; contiguous() of a
        # contiguous tensor is the tensor itself)
        return (e_t, cells.contiguous(), prop.contiguous(), sc.contiguous(), fired), n, b

    def _compile(
        self,
        spec: StepSpec,
        layout: Layout,
        args: tuple[Tensor, ...],
        e: int | Tensor,
        sig: tuple[Any, ...],
    ) -> Callable[..., Any]:
        """The graph of ``value``'s step for ``args`` (``sig``: their :func:`signature`): this
        process's, inductor's cached one, or one built now."""
        value = spec.value
        vtables, where, index, valid = self._tables[value]
        lens = (len(vtables), len(where), len(index), len(valid), len(spec.others))
        if self.on_compile is not None:
            self.on_compile(value, int(args[1].numel()))
        t0 = time.perf_counter()
        try:
            key = (spec, layout, sig, lens)
            sim = simulated(key, lambda: flat_step(value_step(spec, layout), lens))
            if sim is not None:
                fn, how = sim
            else:
                make = lambda: flat_step(value_step(spec, layout), lens)  # noqa: E731
                fn, _, how = self.compiler(key, make, args)
        except Exception as exc:  # tracing and code generation run before anything is written
            raise RuntimeFault(
                f"--compile could not compile the epoch step of `{value}`: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                where={"value": value, "epoch": e if isinstance(e, int) else -1},
                code="R080",
                hint="run without --compile (the eager epoch commits the same)",
            ) from exc
        self.stats.record(how, time.perf_counter() - t0)
        return fn


def _int32(index: Tensor) -> Tensor:
    """A static gather table as int32 when its cell ids fit (half the memory a step reads after
    the model has pushed it out of the caches); the graphs widen each id as they load it."""
    if index.numel() and int(index.abs().max()) >= 2**31:
        return index
    return index.to(torch.int32)


def _gather_fn(cdims: tuple[int, ...]) -> Callable[..., tuple[Tensor, ...]]:
    """A rule's non-uniform reads for its open cells, as :meth:`ModelInputs.gather` gathers them
    eagerly: per read (its payload's cell rank in ``cdims``) the read cells' payload, mask and
    index. Inputs: the open cells, then per read its (N, K) index and valid tables and the
    source's payload and committed flags."""

    def gather(cells: Tensor, *tabs: Tensor) -> tuple[Tensor, ...]:
        out: list[Tensor] = []
        for j, cd in enumerate(cdims):
            index, valid, payload, committed = tabs[4 * j : 4 * j + 4]
            idx = index.index_select(0, cells).long()  # (n, K)
            mask = valid.index_select(0, cells) & committed.take(idx)
            if cd == 0:
                data = payload.take(idx)
            else:
                data = payload.index_select(0, idx.reshape(-1)).reshape(
                    *idx.shape, *payload.shape[1:]
                )
            out += [data, mask, idx]
        return tuple(out)

    return gather


class ReadGathers:
    """Under ``--compile``: the model inputs of LMPM's own models (which never write into them),
    their non-uniform reads gathered by one compiled graph per rule and open-cell bucket instead
    of a dozen eager gathers (uniform reads stay broadcast views of one gathered row)."""

    def __init__(self, stats: CompileStats | None = None) -> None:
        self.stats = stats if stats is not None else CompileStats()  # the run's, shared
        # rule id -> its non-uniform reads and their static tables, (index, valid) per read
        self._reads: dict[int, tuple[list[int], list[tuple[Tensor, Tensor]]]] = {}
        self._fns: dict[tuple[int, int], Graph] = {}  # (rule id, bucket) -> graph

    def prepare(self, rp: Any, dp: Any) -> tuple[list[int], list[tuple[Tensor, Tensor]]]:
        """``rp``'s non-uniform reads and their tables on ``dp``'s device (static: made when the
        run compiles, not in its first epoch)."""
        reads = [j for j, rd in enumerate(rp.reads) if not rd.uniform]
        tables = [(_int32(dp.dev(rp.reads[j].index)), dp.dev(rp.reads[j].valid)) for j in reads]
        self._reads[rp.id] = (reads, tables)
        return reads, tables

    def gather(self, rp: Any, cells: Tensor, dp: Any) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """Read index -> (data (n, K[, *cell]), mask (n, K), index (n, K)) of ``rp``'s
        non-uniform reads for ``cells``."""
        reads, tables = self._reads.get(rp.id) or self.prepare(rp, dp)
        if not reads:
            return {}
        n = cells.numel()
        b = bucket(n)
        if b != n:  # padded by repeating the first cell; the rows past n are dropped
            cells = torch.cat((cells, cells[:1].expand(b - n)))
        args: list[Tensor] = [cells.contiguous()]
        for j, (index, valid) in zip(reads, tables):
            src = rp.reads[j].source
            args += [index, valid, dp.payload[src], dp.committed[src]]
        g = self._fns.get((rp.id, b))
        if g is None or not g.holds(args):
            g = self._graph(rp, b, args, g)
        out = g.fn(*args) if g.call is None else g.call(args)
        if b != n:
            out = [t[:n] for t in out]
        return {j: (out[3 * i], out[3 * i + 1], out[3 * i + 2]) for i, j in enumerate(reads)}

    def _graph(self, rp: Any, b: int, args: list[Tensor], g: Graph | None) -> Graph:
        """The gather graph of ``rp`` for a bucket of ``b`` cells and ``args`` (after the open
        cells: the static tables and the read values' tensors, held by :class:`Graph`)."""
        if g is not None and g.check(args):
            return g
        reads = self._reads[rp.id][0]
        cdims = tuple(args[3 + 4 * i].dim() - 1 for i in range(len(reads)))  # the payloads'
        t0 = time.perf_counter()
        sig = signature(args)
        key = ("gather", cdims, sig)
        sim = simulated(key, lambda: _gather_fn(cdims))
        if sim is not None:
            fn, how = sim
        else:
            fn, _, how = compile_graph(key, lambda: _gather_fn(cdims), args, guarded=True)
        self.stats.record(how, time.perf_counter() - t0)
        g = self._fns[(rp.id, b)] = Graph(fn, args, 1, sig)
        return g
