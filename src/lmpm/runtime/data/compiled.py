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
guards run per epoch (a plan of work on handles, realized by the worker).

What is baked into a value's graph is static for the run: the cell shape and dtype, the commit
policy, the constraints' kinds and priorities, the clock reads, the number of candidate columns
(unrolled: every operation is elementwise over the open cells). What changes per epoch is an
input: the open cells, the proposals and their scores, the epoch, the RuleSet (a (K,) bool mask),
a schedule's quota (with the open-cell count before padding: a padded row takes no quota).
Shapes are bucketed (the open-cell count rounded up to a power of two, padded by repeating the
first row: identical rows make identical decisions and write identical bytes), so a run compiles
each value once per bucket, not once per epoch; :attr:`CompileStats.compiles` counts them, and
inductor's on-disk cache (:func:`cache_dir`) serves later runs.

A value runs eagerly (the ordinary propose/agree/apply protocol) when the compiled step cannot
express it; :func:`eligibility` says why, and ``lmpm show --compiled`` prints it:

- more than one rule (or quorum replicas) proposes it;
- its policy is not ``satisfy``, ``winner_takes_all`` or ``average`` (quorum, user policies);
- a constraint on it is a bound Python predicate (user code).

``hard`` constraints and a schedule's quota (confidence: :func:`lmpm.runtime.data.agree.keep_top`,
traced) are decided inside the step.

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

import gc
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lmpm.errors import RuntimeFault
from lmpm.ir.nodes import PredKind
from lmpm.resolve import policies
from lmpm.resolve.plan import Plan
from lmpm.runtime.data.agree import keep_top
from lmpm.runtime.data.clocks import clock_reads
from lmpm.runtime.records import HELD, NO_WINNER
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
    """What one value's compiled step bakes into its graph."""

    value: str
    rule: int  # the one rule proposing the value
    cdims: int  # len(cell_shape)
    dtype: torch.dtype
    policy: str  # satisfy | winner_takes_all | average
    checks: tuple[_Check, ...]
    priority: tuple[int, ...]  # per constraint
    # blocked reasons: constraint columns from the highest priority down, and their ids
    order: tuple[int, ...]
    ids: tuple[int, ...]
    clock_sources: tuple[str, ...]  # per clock read: the value whose clocks it reads
    clock_uniform: tuple[bool, ...]
    clock_masked: tuple[bool, ...]
    tracks_inputs: bool  # the worker keeps the value's input flags (an `inputs()` constraint)
    quota: bool  # the schedule commits a quota of the cells (confidence)


_NO_QUOTA = 2**62  # a quota no epoch reaches

# the policies the compiled step expresses, by the name StepSpec bakes in
_POLICIES = {
    policies.satisfy: "satisfy",
    policies.winner_takes_all: "winner_takes_all",
    policies.average: "average",
}


def eligibility(plan: Plan, value: str, *, quota: bool = False) -> str | None:
    """Why ``value`` runs eagerly under ``--compile`` (None: it compiles)."""
    rules = plan.rules_by_target.get(value, [])
    vp = plan.values[value]
    if len(rules) != 1:
        return f"{len(rules)} rules propose it (the compiled step takes one)"
    if rules[0].replicas != 1:
        return f"{rules[0].replicas} quorum replicas propose it"
    if vp.policy not in _POLICIES:
        return f"its policy {vp.policy_text} is not satisfy, winner_takes_all or average"
    if vp.policy is policies.average and not vp.dtype.is_floating_point:
        return "average of a value that holds tokens (the eager epoch reports B031)"
    for cp in plan.live_constraints.get(value, []):
        if cp.pred not in (PredKind.IN_SET, PredKind.CHANGE):
            return f"constraint `{cp.name}` is a bound Python predicate"
    return None


def step_spec(plan: Plan, value: str, *, quota: bool = False) -> StepSpec:
    (rp,) = plan.rules_by_target[value]
    vp = plan.values[value]
    cps = plan.live_constraints.get(value, [])
    prio = tuple(cp.priority for cp in cps)
    order = tuple(sorted(range(len(cps)), key=lambda j: -prio[j]))  # stable: program order
    reads = clock_reads(rp)
    return StepSpec(
        value,
        rp.id,
        len(vp.cell_shape),
        vp.dtype,
        _POLICIES[vp.policy],
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
        tuple(cr.source for cr in reads),
        tuple(cr.uniform for cr in reads),
        tuple(cr.valid is not None for cr in reads),
        any(cp.needs_inputs_region for cp in cps),
        quota,
    )


class _Cols(NamedTuple):
    """One value's candidate table inside the step, unrolled by column (column 0: keep-current)."""

    cols: list[Tensor]  # per column (n, *cell) payload
    score: list[Tensor]  # per column (n,) float64
    valid: list[Tensor]  # per column (n,) bool
    was: Tensor  # (n,) bool: the open cell was committed before the epoch
    kept: Tensor  # (n,) float64: its committed score


def value_step(spec: StepSpec) -> Callable[..., tuple[Tensor, ...]]:
    """The plain (uncompiled) function of one value's epoch after its model: what
    :class:`CompiledEpoch` hands to ``torch.compile``. It writes the payload and the metadata in
    place and returns the epoch's metadata. The stages are the eager owner's (fold, check,
    agree, apply, clocks, why), unrolled over the candidate columns: every operation is
    elementwise over the open cells (a compiled loop reduces a row of 2..9 columns poorly)."""

    def step(
        e: Tensor,  # () int64
        cells: Tensor,  # (n,) int64, sorted, unique (padding repeats row 0)
        prop: Tensor,  # (n, k, *cell)
        sc: Tensor,  # (n, k) float64
        payload: Tensor,  # the data plane's (N, *cell)
        dp_committed: Tensor,  # the data plane's (N,) bool
        from_input: Tensor,  # the data plane's (N,) bool
        committed: Tensor,  # the owner's (N,) bool
        clock: Tensor,  # (N,) int64
        rule: Tensor,  # (N,) int64
        epoch: Tensor,  # (N,) int64
        kept_score: Tensor,  # (N,) float64
        why: Tensor,  # (N,) int64
        active: Tensor,  # (K,) bool: the constraint is in the RuleSet
        limit: Tensor,  # (2,) int64: the schedule's quota this epoch, the open cells unpadded
        vtables: Sequence[Tensor],  # per IN_SET check: (vocab + 2,) violation table
        where_tables: Sequence[Tensor],  # per check not covering all cells: (N,) bool
        clock_index: Sequence[Tensor],  # per clock read: (R,) uniform, else (N, K) source index
        clock_valid: Sequence[Tensor],  # per masked clock read: (N, K) bool
        clock_src: Sequence[Tensor],  # per clock read of another value: its (M,) clocks
    ) -> tuple[Tensor, ...]:
        c = _fold(spec, cells, prop, sc, payload, committed, kept_score)
        tables = (vtables, where_tables, active, from_input)
        verdicts, applies = _check(spec, c, cells, tables)
        winner, changed, new = _agree(spec, c, verdicts, limit)
        # apply: a cell that keeps writes back its own payload (column 0)
        hit = changed.reshape(-1, *([1] * spec.cdims))
        payload.index_put_((cells,), torch.where(hit, new, c.cols[0]))
        now = c.was | changed
        committed.index_put_((cells,), now)
        dp_committed.index_put_((cells,), now)
        if spec.tracks_inputs:
            from_input.index_put_((cells,), from_input.index_select(0, cells) & ~changed)
        reads = (clock_index, clock_valid, clock_src)
        own = clock.index_select(0, cells)
        new_clock = torch.where(changed, _clock_top(spec, cells, clock, reads) + 1, own)
        meta = (clock, rule, epoch, kept_score)
        _write_meta(spec, cells, meta, (changed, new_clock, e, _pick(c.score, winner, 0)))
        stays = ~changed & ~c.was
        code = _why(spec, c, verdicts)
        if spec.quota:  # winners the quota held back: not "no candidate"
            code = torch.where(winner != 0, HELD, code)
        code = torch.where(stays, code, why.index_select(0, cells))
        why.index_put_((cells,), code)
        return (
            winner,
            changed,
            *_records(spec, c, verdicts, applies, changed),
            new_clock,
            c.was,
            _counts(c, verdicts, changed, e),
        )

    return step


def _fold(
    spec: StepSpec,
    cells: Tensor,
    prop: Tensor,
    sc: Tensor,
    payload: Tensor,
    committed: Tensor,
    kept_score: Tensor,
) -> _Cols:
    """Stage 2, fold candidates: the open cells' current payload as column 0, the proposals as
    columns 1..k; a proposal equal to the committed payload is keep-current, freshly scored."""
    current = payload.index_select(0, cells)  # (n, *cell)
    was = committed.index_select(0, cells)
    kept = kept_score.index_select(0, cells)
    cols = [current] + [prop[:, j].to(spec.dtype) for j in range(prop.shape[1])]
    scs = [sc[:, j] for j in range(prop.shape[1])]
    same = [_equal(col, current, spec.cdims) & was for col in cols[1:]]
    refreshed = _any(same)
    best_same = _max([torch.where(m, x, -torch.inf) for m, x in zip(same, scs)])
    score = [torch.where(refreshed, best_same, kept), *scs]
    valid = [torch.ones_like(was)] + [~m for m in same]
    return _Cols(cols, score, valid, was, kept)


def _equal(x: Tensor, y: Tensor, cdims: int) -> Tensor:
    eq = x == y
    return eq.flatten(1).all(dim=1) if cdims else eq


def _check(
    spec: StepSpec, c: _Cols, cells: Tensor, tables: tuple[Any, ...]
) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Stage 3, check: per constraint, per column (n,) verdicts, masked by the cells the
    constraint speaks about and the RuleSet; and per constraint the (n,) cells it applies to."""
    vtables, where_tables, active, from_input = tables
    n = cells.shape[0]
    was = c.was
    verdicts: list[list[Tensor]] = []  # [constraint][column]
    applies: list[Tensor] = []
    vt = iter(vtables)
    wt = iter(where_tables)
    for j, ck in enumerate(spec.checks):
        if ck.in_set:
            vtab = next(vt)
            hi = vtab.numel() - 2
            viol = [
                vtab.take((x if x.dtype == torch.int64 else x.long()).clamp(-1, hi)) for x in c.cols
            ]
        else:
            current = c.cols[0]
            holds = [torch.zeros_like(was)]
            holds += [~_equal(x, current, spec.cdims) & was for x in c.cols[1:]]
            viol = holds if ck.forbid else [~h for h in holds]
        # keep-current of an unset cell satisfies every forbid, violates every require
        viol[0] = viol[0] & was if ck.forbid else viol[0] | ~was
        on = active[j].expand(n)
        if not ck.covers_all:
            on = on & next(wt).index_select(0, cells)
            if ck.needs_inputs:
                on = on & from_input.index_select(0, cells)
        verdicts.append([v & ok & on for v, ok in zip(viol, c.valid)])
        applies.append(on)
    return verdicts, applies


def _agree(
    spec: StepSpec, c: _Cols, verdicts: list[list[Tensor]], limit: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Stage 4, agree (:func:`lmpm.runtime.data.agree.agree`, unrolled): a proposal violating a
    `hard` constraint is not eligible; then the policy's (n,) winning column (0: keep), (n,)
    which cells commit (a quota keeps the most confident: :func:`_quota`) and the (n, *cell)
    payload a committing cell writes (the winner's; average: the mean of the proposals)."""
    valid = c.valid
    hard = [v for v, ck in zip(verdicts, spec.checks) if ck.hard]
    if hard:
        valid = [valid[0]] + [
            ok & ~_any([v[col] for v in hard]) for col, ok in enumerate(valid) if col
        ]
    if spec.policy == "satisfy":
        winner = _best(c.score, _narrow(verdicts, valid, list(spec.priority)))
    elif spec.policy == "winner_takes_all":
        eligible = [torch.zeros_like(c.was), *valid[1:]]
        winner = _best(c.score, eligible)
        winner = torch.where(_any(eligible[1:]), winner, torch.zeros_like(winner))
    if spec.policy == "average":  # the first valid proposal names the rule, the payload the mean
        winner, new = _average(spec, c, valid)
    else:
        new = _pick(c.cols, winner, spec.cdims)
    changed = winner != 0
    if spec.quota:
        changed = _quota(changed, _pick(c.score, winner, 0), limit)
    if spec.policy == "average":  # (after the quota, as the worker's write)
        changed = changed & ~(_equal(new, c.cols[0], spec.cdims) & c.was)
    return winner, changed, new


def _quota(changed: Tensor, won: Tensor, limit: Tensor) -> Tensor:
    """A schedule's quota (:func:`lmpm.runtime.data.agree.keep_top`, the eager function): when
    more cells would commit than ``limit[0]`` allows, the most confident ones. ``limit[1]``: the
    open cells before padding; the padded rows (copies of row 0) decide as row 0."""
    real = torch.arange(changed.shape[0], device=changed.device) < limit[1]
    conf = torch.where(changed & real, won, -torch.inf)
    some = changed & real
    kept = torch.where(some.sum() > limit[0], some & keep_top(conf, limit[0]), some)
    return torch.where(real, kept, kept[0].expand(kept.shape[0]))


def _average(spec: StepSpec, c: _Cols, valid: list[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`lmpm.resolve.policies.average` and the worker's weighted write
    (:meth:`lmpm.runtime.data.dataplane.DataPlane.apply`), the same float64 sums: the first
    valid proposal's column and the mean of the valid proposals."""
    winner = torch.zeros_like(c.was, dtype=torch.int64)
    for j in reversed(range(1, len(valid))):
        winner = torch.where(valid[j], j, winner)
    w = torch.stack([torch.zeros_like(c.score[0]), *(v.to(torch.float64) for v in valid[1:])], 1)
    wv = w.reshape(*w.shape, *([1] * spec.cdims))
    table = torch.stack(c.cols, dim=1).to(torch.float64)
    count = w.sum(dim=1).clamp(min=1e-300).reshape(-1, *([1] * spec.cdims))
    return winner, ((wv * table).sum(dim=1) / count).to(spec.dtype)


def _clock_top(
    spec: StepSpec, cells: Tensor, clock: Tensor, reads: tuple[Sequence[Tensor], ...]
) -> Tensor:
    """Stage 6, advance clocks: (n,) max(own clock, every clock the rule read); a committing
    cell's new clock is one more."""
    clock_index, clock_valid, clock_src = reads
    n = cells.shape[0]
    top = clock.index_select(0, cells)
    ci = iter(clock_valid)
    cs = iter(clock_src)
    for j, uniform in enumerate(spec.clock_uniform):
        own_read = spec.clock_sources[j] == spec.value
        src = clock if own_read else next(cs)  # a value's own clocks: no aliased input
        if uniform:
            got = src.index_select(0, clock_index[j]).amax().expand(n)
        else:
            g = src.take(clock_index[j].index_select(0, cells).long())
            if spec.clock_masked[j]:
                g = g * next(ci).index_select(0, cells)
            # a few reads unrolled (a compiled loop reduces a short row poorly); a causal
            # context's dozens of reads as one reduction (an unrolled graph would grow with N)
            width = g.shape[1]
            got = _max([g[:, i] for i in range(width)]) if width <= 8 else g.amax(dim=1)
        top = torch.maximum(top, got)
    return top


def _write_meta(
    spec: StepSpec, cells: Tensor, meta: tuple[Tensor, ...], new: tuple[Tensor, ...]
) -> None:
    """Stage 7, write metadata (:func:`lmpm.runtime.data.decide.write_meta`, as a graph over the
    open cells): clock, provenance, epoch and score of the committing ones."""
    clock, rule, epoch, kept_score = meta
    changed, new_clock, e, won = new
    clock.index_put_((cells,), new_clock)
    rule.index_put_((cells,), torch.where(changed, spec.rule, rule.index_select(0, cells)))
    epoch.index_put_((cells,), torch.where(changed, e, epoch.index_select(0, cells)))
    kept = kept_score.index_select(0, cells)
    kept_score.index_put_((cells,), torch.where(changed, won, kept))


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


def _records(
    spec: StepSpec, c: _Cols, verdicts: list[list[Tensor]], applies: list[Tensor], changed: Tensor
) -> tuple[Tensor, ...]:
    """The epoch's record tensors: score (n, C), valid (n, C), violated (n, C, K), applies (n, K)."""
    n = changed.shape[0]
    ncol = len(c.cols)
    if verdicts:
        violated = torch.stack([torch.stack(v, dim=1) for v in verdicts], dim=2)
        applies_t = torch.stack(applies, dim=1)
    else:
        violated = torch.zeros((n, ncol, 0), dtype=torch.bool, device=changed.device)
        applies_t = torch.ones((n, 0), dtype=torch.bool, device=changed.device)
    return torch.stack(c.score, dim=1), torch.stack(c.valid, dim=1), violated, applies_t


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


def _best(score: Sequence[Tensor], eligible: Sequence[Tensor]) -> Tensor:
    """The eligible column with the highest score, ties to the lowest column
    (:func:`lmpm.resolve.policies.best_by_score`, unrolled); 0 when none is eligible."""
    s = [torch.where(ok, x, -torch.inf) for ok, x in zip(eligible, score)]
    top = _max(s)
    winner = torch.zeros(score[0].shape, dtype=torch.int64, device=score[0].device)
    found = torch.zeros_like(eligible[0])
    for j, (ok, x) in enumerate(zip(eligible, s)):
        hit = ok & (x == top) & ~found
        winner = torch.where(hit, j, winner)
        found = found | hit
    return winner


def _narrow(
    verdicts: list[list[Tensor]], eligible: list[Tensor], priority: list[int]
) -> list[Tensor]:
    """:func:`lmpm.resolve.policies.lexicographic`, unrolled over the columns."""
    for prio in sorted(set(priority), reverse=True):
        ks = [j for j, p in enumerate(priority) if p == prio]
        if len(ks) == 1:
            ok = [e & ~v for e, v in zip(eligible, verdicts[ks[0]])]
            some = _any(ok)
            eligible = [torch.where(some, o, e) for o, e in zip(ok, eligible)]
            continue
        count = []
        for c, e in enumerate(eligible):
            sat = _sum([~verdicts[j][c] for j in ks])
            count.append(torch.where(e, sat, -1))
        top = _max(count)
        eligible = [e & (x == top) for e, x in zip(eligible, count)]
    return eligible


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


# Flat argument lists: the step's fixed tensor arguments (its first parameters, by name), then
# its table lists (of the lengths its compile is given).
STEP_HEAD = (
    "e",
    "cells",
    "prop",
    "sc",
    "payload",
    "dp_committed",
    "from_input",
    "committed",
    "clock",
    "rule",
    "epoch",
    "kept_score",
    "why",
    "active",
    "limit",
)
_HEAD = len(STEP_HEAD)


def _flat(step: Callable[..., tuple[Tensor, ...]], lens: tuple[int, ...]) -> Callable[..., Any]:
    """``step`` over one flat tuple of tensors (what a traced graph takes)."""

    def flat(*ts: Tensor) -> tuple[Tensor, ...]:
        rest = list(ts[_HEAD:])
        lists = []
        for n in lens:
            lists.append(rest[:n])
            rest = rest[n:]
        return step(*ts[:_HEAD], *lists)

    return flat


# Compiled graphs of this process, by spec and the exact signature of their inputs: a later run
# of the same program (tests, benchmarks, notebooks) reuses them.
_GRAPHS: dict[tuple[Any, ...], tuple[Callable[..., Any], torch.fx.GraphModule]] = {}


def signature(args: Sequence[Tensor]) -> tuple[Any, ...]:
    """What a compiled graph is specialised to in its inputs: dtype, shape, strides, device."""
    return tuple((t.dtype, tuple(t.shape), t.stride(), t.device) for t in args)


def _direct(fn: Callable[..., Any], args: Sequence[Tensor]) -> Callable[..., Any]:
    """The compiled graph itself, without the wrappers ``compile_fx`` puts around it (a dynamo
    guard switch, AOT autograd's runtime wrappers: five Python calls, ~25 µs an epoch once the
    model has evicted them from the caches), when calling it alone does exactly what the wrapped
    call does: checked once, on copies of the inputs (outputs and inputs written in place equal).
    Otherwise ``fn`` as it is. The graph is the inductor module's ``call`` (a list of inputs in,
    a list of outputs back), which ``CompiledFxGraph.__call__`` runs and which AOT autograd's
    wrapper carries as ``current_callable``."""
    inner: Any = fn
    while not callable(getattr(inner, "current_callable", None)):
        inner = getattr(inner, "__wrapped__", None)
        if inner is None:
            return fn
    call = inner.current_callable

    def direct(*ts: Tensor) -> Any:
        return call(list(ts))

    a, b = [t.clone() for t in args], [t.clone() for t in args]
    try:
        want, got = fn(*a), direct(*b)
    except Exception:
        return fn
    same = len(want) == len(got) and all(torch.equal(x, y) for x, y in zip(want, got))
    if same and all(torch.equal(x, y) for x, y in zip(a, b)):
        return direct
    return fn


def compile_step(
    spec: StepSpec, args: Sequence[Tensor], lens: tuple[int, ...]
) -> tuple[Callable[..., Any], torch.fx.GraphModule, str]:
    """Trace ``spec``'s step on the shapes of ``args`` into one aten graph and compile it with
    inductor (:func:`compile_graph`)."""
    key = (spec, signature(args), lens)
    return compile_graph(key, lambda: _flat(value_step(spec), lens), args)


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


def compile_graph(
    key: tuple[Any, ...],
    make: Callable[[], Callable[..., Any]],
    args: Sequence[Tensor],
    *,
    cpp_wrapper: bool = True,
) -> tuple[Callable[..., Any], torch.fx.GraphModule, str]:
    """Trace ``make()`` (a function of flat tensors, with no Python decision that depends on
    their values) on the shapes of ``args`` into one aten graph with ``make_fx`` and compile it
    with inductor: explicit graphs, no dynamo frame and no guards; the caller calls the result
    only with inputs of this signature (``key`` says everything else the graph depends on).
    Returns (compiled, graph, how): "built" (code generated now), "cached" (inductor's on-disk
    cache had it, from an earlier run) or "reused" (this process had it)."""
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
        }
        from torch._dynamo.utils import counters

        hits = counters["inductor"]["fxgraph_cache_hit"]
        if not all(t.device.type == "cpu" for t in args):
            options = {"realize_opcount_threshold": 4}  # Triton kernels, a Python wrapper
        with config.patch(options):
            fn: Callable[..., Any] = compile_fx(gm, [t.clone() for t in args])  # type: ignore[assignment]
        cached = counters["inductor"]["fxgraph_cache_hit"] > hits
    fn = _direct(fn, args)
    _GRAPHS[key] = (fn, gm)
    return fn, gm, "cached" if cached else "built"


class CompiledEpoch:
    """The compiled steps of a run's values (built lazily, one graph per value and bucket)."""

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
        self._rules = {name: plan.rules_by_target[name][0] for name in self.specs}
        self._tables: dict[str, tuple[list[Tensor], ...]] = {}
        # (value, open-cell bucket, proposals per cell, their dtype) -> compiled step; the value's
        # other inputs keep their shapes and dtypes for the whole run
        self._fns: dict[tuple[str, int, int, torch.dtype], Callable[..., Any]] = {}
        self._cols: dict[tuple[int, int], Tensor] = {}
        self._e = torch.zeros((), dtype=torch.int64, device=device)
        # the steps' (2,) quota input: the schedule's quota, the open cells before padding
        self._limit = torch.zeros(2, dtype=torch.int64, device=device)
        # off the CPU: the steps captured as CUDA graphs (lmpm.runtime.data.captured)
        self.captured: Any = None
        os.environ.setdefault(CACHE_ENV, str(cache_dir()))
        # called before a step is compiled: (value, open-cell bucket); the CLI shows a note
        self.on_compile: Callable[[str, int], None] | None = None

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
        """The static tables a value's step reads (device copies, made once)."""
        hit = self._tables.get(value)
        if hit is None:
            tabs = dataplane.tables[value]
            vtables = [t for t in tabs.tables if t is not None]
            where = [c for c, whole in zip(tabs.cells, tabs.covers_all) if not whole]
            reads = clock_reads(self._rules[value])
            index = [
                dataplane.dev(cr.index) if cr.uniform else _int32(dataplane.dev(cr.index))
                for cr in reads
            ]
            valid = [dataplane.dev(cr.valid) for cr in reads if cr.valid is not None]
            hit = self._tables[value] = (vtables, where, index, valid)
        return hit

    def columns(self, rule: int, k: int) -> Tensor:
        """(C,) rule id per column for one rule proposing ``k`` candidates per cell."""
        hit = self._cols.get((rule, k))
        if hit is None:
            hit = self._cols[(rule, k)] = torch.tensor([-1] + [rule] * k)
        return hit

    def step(
        self,
        value: str,
        e: int | Tensor,
        cells: Tensor,
        prop: Tensor,
        sc: Tensor,
        dataplane: Any,
        state: Any,
        why: Tensor,
        active: Tensor,
        clocks: dict[str, Tensor],
        quota: int | None = None,
    ) -> tuple[Tensor, ...]:
        """Run ``value``'s compiled step on one epoch's proposals; returns (winner, changed, score,
        valid, violated, applies, new_clock, was) for the ``n`` open cells and (2,) int64: how
        many commit, how many (cell, candidate) pairs violate a constraint. ``e`` a 0-d device
        tensor: the step runs inside a window's capture (lmpm.runtime.data.kepochs), directly.
        ``quota``: the schedule's (:meth:`lmpm.runtime.data.owner.Owner.quota`), when it has one."""
        n = cells.numel()
        b = bucket(n)
        if b != n:  # pad by repeating row 0: identical rows decide and write identically
            pad = b - n
            cells = torch.cat((cells, cells[:1].expand(pad)))
            prop = torch.cat((prop, prop[:1].expand(pad, *prop.shape[1:])))
            sc = torch.cat((sc, sc[:1].expand(pad, *sc.shape[1:])))
        spec = self.specs[value]
        if spec.quota:  # written in place: a captured graph reads it at its address
            self._limit.copy_(torch.tensor((_NO_QUOTA if quota is None else quota, n)))
        vtables, where, index, valid = self.tables(value, dataplane)
        if isinstance(e, Tensor):
            e_t = e
        else:
            self._e.fill_(e)
            e_t = self._e
        args = (
            e_t,
            cells,
            prop.contiguous(),
            sc.contiguous(),
            dataplane.payload[value],
            dataplane.committed[value],
            dataplane.from_input[value],
            state.committed,
            state.clock,
            state.rule,
            state.epoch,
            state.score,
            why,
            active,
            self._limit,
            *vtables,
            *where,
            *index,
            *valid,
            *(clocks[s] for s in spec.clock_sources if s != value),
        )
        key = (value, b, prop.shape[1], prop.dtype)  # (the graph reads the proposals' dtype)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self._compile(value, spec, args, e if isinstance(e, int) else -1)
            self.stats.buckets.setdefault(value, set()).add(b)
        if (
            self.captured is not None and e_t is self._e
        ):  # on CUDA: replay the captured graph, records on the host
            out = self.captured.run(key, fn, args)
        else:
            out = fn(*args)
        self.stats.steps += 1
        if b == n:
            return tuple(out)
        # padded: the rows past n repeat row 0, so the counts are taken over the first n
        out = tuple(t[:n] for t in out[:-1])
        changed, violated = out[1], out[4]
        n_viol = violated.any(dim=2).count_nonzero() if violated.shape[2] else changed.sum() * 0
        return (*out, torch.stack((changed.count_nonzero(), n_viol)))

    def _compile(
        self, value: str, spec: StepSpec, args: tuple[Tensor, ...], e: int
    ) -> Callable[..., Any]:
        vtables, where, index, valid = self._tables[value]
        lens = (
            len(vtables),
            len(where),
            len(index),
            len(valid),
            sum(s != value for s in spec.clock_sources),
        )
        if self.on_compile is not None:
            self.on_compile(value, int(args[1].numel()))
        t0 = time.perf_counter()
        try:
            sim = simulated((spec, signature(args), lens), lambda: _flat(value_step(spec), lens))
            if sim is not None:
                fn, how = sim
            else:
                fn, _, how = compile_step(spec, args, lens)
        except Exception as exc:  # tracing and code generation run before anything is written
            raise RuntimeFault(
                f"--compile could not compile the epoch step of `{value}`: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                where={"value": value, "epoch": e},
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
        self._fns: dict[tuple[int, int], Callable[..., Any]] = {}  # (rule id, bucket) -> graph

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
        args: list[Tensor] = [cells]
        for j, (index, valid) in zip(reads, tables):
            src = rp.reads[j].source
            args += [index, valid, dp.payload[src], dp.committed[src]]
        fn = self._fns.get((rp.id, b))
        if fn is None:
            cdims = tuple(dp.payload[rp.reads[j].source].dim() - 1 for j in reads)
            t0 = time.perf_counter()
            key = ("gather", cdims, signature(args))
            sim = simulated(key, lambda: _gather_fn(cdims))
            if sim is not None:
                fn, how = sim
            else:
                fn, _, how = compile_graph(key, lambda: _gather_fn(cdims), args)
            self.stats.record(how, time.perf_counter() - t0)
            self._fns[(rp.id, b)] = fn
        out = fn(*args)
        if b != n:
            out = [t[:n] for t in out]
        return {j: (out[3 * i], out[3 * i + 1], out[3 * i + 2]) for i, j in enumerate(reads)}
