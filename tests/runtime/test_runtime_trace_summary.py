"""The trace's summary rows against a plain restatement of their definition.

``summary_reference`` is the tracer's previous implementation (torch, one pass per priority level over
every cell): the vectorized summary must produce exactly its rows, in its order, and never read a
payload (the control plane has none: a ValueEpoch is metadata only).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmpm.ir import compile_source
from lmpm.resolve.plan import Plan
from lmpm.runtime.control.engine import Engine
from lmpm.runtime.control.trace import Tracer, box_text
from lmpm.runtime.records import EpochRecord, OneCell, ValueEpoch
from lmpm.runtime.session import Run

sys.path.insert(0, str(Path(__file__).parent))
from test_runtime_differential import BINDINGS, programs, used
from test_runtime_trace import CELLS


def _attribute_reference(
    score: torch.Tensor,
    valid: torch.Tensor,
    violated: torch.Tensor,
    priority: torch.Tensor,
    winner: torch.Tensor,
    hard: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(favourite (n,), responsible (n, K)), level by level over every cell; a favourite a `hard`
    constraint excludes is decided by the highest-priority hard constraints it violates."""
    n = valid.shape[0]
    s = torch.where(valid, score, torch.full_like(score, -torch.inf))
    hit = valid & (s == s.max(dim=1, keepdim=True).values)
    fav = hit.to(torch.uint8).argmax(dim=1)
    k = violated.shape[2]
    rows = torch.arange(n)
    none = torch.iinfo(torch.int64).min
    elim = torch.full((n,), none, dtype=torch.int64)
    out = (violated & hard).any(dim=2)  # (n, C): proposals a hard constraint rules out
    out[:, 0] = False
    eligible = valid & ~out
    sat = ~violated
    for prio in torch.unique(priority, sorted=True).flip(0).tolist():
        level = priority == prio
        count = sat[:, :, level].sum(dim=2)
        count = torch.where(eligible, count, torch.full_like(count, -1))
        narrowed = eligible & (count == count.max(dim=1, keepdim=True).values)
        gone = eligible[rows, fav] & ~narrowed[rows, fav]
        elim = torch.where(gone, torch.full_like(elim, prio), elim)
        eligible = narrowed
    if k == 0:
        return fav, torch.zeros((n, 0), dtype=torch.bool)
    decided = (winner != fav) & (elim != none)
    responsible = (
        decided[:, None]
        & (priority[None, :] == elim[:, None])
        & violated[rows, fav]
        & ~violated[rows, winner]
    )
    broke = violated[rows, fav] & hard & (fav != 0)[:, None]  # (n, K)
    for i in torch.nonzero(broke.any(dim=1) & (winner != fav)).flatten().tolist():
        top = int(priority[broke[i]].max())
        responsible[i] = broke[i] & (priority == top)
    return fav, responsible


def summary_reference(plan: Plan, ve: ValueEpoch, e: int) -> tuple[list[tuple[Any, ...]], int]:
    """(summary rows, decisions decided by a constraint) of one value's epoch."""
    ids = ve.constraint_ids.tolist()
    prio = {cp.id: cp.priority for cp in plan.constraints}
    priority = torch.tensor([prio[i] for i in ids], dtype=torch.int64)
    is_hard = {cp.id: cp.ir.hard for cp in plan.constraints}
    hard = torch.tensor([is_hard[i] for i in ids], dtype=torch.bool)
    fav, resp = _attribute_reference(ve.score, ve.valid, ve.violated, priority, ve.winner, hard)
    rows: list[tuple[Any, ...]] = []
    coords = plan.values[ve.value].coords
    for rule in torch.unique(ve.col_rule).tolist():
        cols = ve.col_rule == rule
        for k, cid in enumerate(ids):
            checked = int((ve.valid[:, cols] & ve.applies[:, k : k + 1]).sum())
            if checked == 0:
                continue
            viol = int(ve.violated[:, cols, k].sum())
            won_at = resp[:, k] & (ve.col_rule[ve.winner] == rule)
            lost_at = resp[:, k] & (ve.col_rule[fav] == rule)
            where = None
            if lost_at.any():
                sel = coords[ve.cells[lost_at]]
                where = box_text(ve.value, sel.amin(dim=0).tolist(), sel.amax(dim=0).tolist())
            rows.append((e, cid, rule, checked, viol, int(won_at.sum()), int(lost_at.sum()), where))
    return rows, int(resp.any(dim=1).sum())


def _metadata_only(ve: ValueEpoch) -> ValueEpoch:
    return dataclasses.replace(ve)  # (payload fields no longer exist: nothing to strip)


def _check(plan: Plan, engine: Engine, records: list[EpochRecord]) -> None:
    tracer = Tracer(plan, "summary")
    for record in records:
        values = [_metadata_only(ve) for ve in record.values]
        got = tracer.record(engine, dataclasses.replace(record, values=values))
        want: list[tuple[Any, ...]] = []
        decided = 0
        for ve in record.values:
            rows, d = summary_reference(plan, ve, record.epoch)
            want += rows
            decided += d
        assert got.summary_rows() == want  # blocked_where as written
        assert got.decided == decided
        assert not got.cells and not got.candidates


class _Keep:
    def __init__(self) -> None:
        self.records: list[EpochRecord] = []

    def on_start(self, engine: Engine) -> None: ...

    def on_epoch(self, engine: Engine, record: EpochRecord) -> None:
        self.records.append(record)

    def on_end(self, engine: Engine) -> None: ...


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_summary_rows_equal_the_reference_on_random_programs(
    case: tuple[str, dict[str, Any]],
) -> None:
    src, info = case
    front = compile_source(src, raise_errors=False)
    run = Run(front, bindings=used(front, BINDINGS), seed=info["seed"])
    keep = _Keep()
    run.engine.observers.append(keep)
    run.run(info["epochs"])
    _check(run.plan, run.engine, keep.records)


_GRID = Run(compile_source(CELLS), seed=0)  # G 4×4; Lock (100), Low (10) and Diff (10)


@st.composite
def value_epochs(draw: st.DrawFn, max_cells: int = 16) -> ValueEpoch:
    """Random metadata of one epoch of G: ties, unset (-inf) and NaN scores, several rules, any
    coverage, any winner; more structure than the engine ever produces, never a payload."""
    plan = _GRID.plan
    ids = [cp.id for cp in plan.constraints if cp.target == "G"]
    k = draw(st.integers(0, len(ids)))
    chosen = sorted(draw(st.permutations(ids))[:k])
    cells = sorted(draw(st.sets(st.integers(0, 15), min_size=1, max_size=max_cells)))
    n, c = len(cells), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    scores = np.array([-np.inf, 0.0, 0.5, 1.0, np.nan])
    p_nan = draw(st.sampled_from([0.0, 0.05]))
    score = g.choice(scores[:4], size=(n, c))
    score[g.random((n, c)) < p_nan] = np.nan
    valid = g.random((n, c)) < draw(st.sampled_from([0.5, 0.9, 1.0]))
    valid[:, 0] |= draw(st.booleans())
    applies = g.random((n, k)) < draw(st.sampled_from([0.5, 1.0]))
    violated = g.random((n, c, k)) < draw(st.sampled_from([0.1, 0.5, 0.9]))
    if draw(st.booleans()):  # as the engine masks them
        violated &= valid[:, :, None] & applies[:, None, :]
    col_rule = np.concatenate([[-1], g.integers(0, 3, size=c - 1)])
    changed = g.random(n) < 0.5
    return ValueEpoch(  # metadata only: the control plane has no payload
        value="G",
        cells=torch.tensor(cells, dtype=torch.int64),
        valid=torch.from_numpy(valid),
        score=torch.from_numpy(score),
        col_rule=torch.from_numpy(col_rule),
        violated=torch.from_numpy(violated),
        constraint_ids=torch.tensor(chosen, dtype=torch.int64),
        winner=torch.from_numpy(g.integers(0, c, size=n)),
        changed=torch.from_numpy(changed),
        new_clock=torch.from_numpy(g.integers(0, 9, size=n)),
        was_committed=torch.from_numpy(g.random(n) < 0.5),
        applies=torch.from_numpy(applies),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(value_epochs(), min_size=1, max_size=3))
def test_summary_rows_equal_the_reference_on_random_metadata(values: list[ValueEpoch]) -> None:
    records = [EpochRecord(e, [ve], 0, 0, 0, 0, 0.0, 0.0) for e, ve in enumerate(values)]
    _check(_GRID.plan, _GRID.engine, records)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(value_epochs(max_cells=1), min_size=1, max_size=3), st.data())
def test_one_cell_epochs_equal_the_reference(values: list[ValueEpoch], data: st.DataObject) -> None:
    """A one-cell epoch (a decode's) is counted from Python lists when its favourite won, else by
    the NumPy passes: the reference's rows either way; the lists' path is taken when it applies."""
    from lmpm.runtime.control import trace

    if data.draw(st.booleans()):  # the favourite wins (the lists' path), or any winner
        values = [dataclasses.replace(ve, winner=_favourite(ve)) for ve in values]
    records = [EpochRecord(e, [ve], 0, 0, 0, 0, 0.0, 0.0) for e, ve in enumerate(values)]
    _check(_GRID.plan, _GRID.engine, records)
    tracer = Tracer(_GRID.plan, "summary")
    for e, ve in enumerate(values):
        if not ve.constraint_ids.numel():
            continue
        out = trace.TraceRows()
        one = OneCell.of(ve)
        assert one is not None
        taken = trace._one_cell_summary(ve, one, e, tracer._static(ve), tracer._layout, out)
        assert taken == (int(ve.winner[0]) == int(_favourite(ve)[0]))


def _favourite(ve: ValueEpoch) -> torch.Tensor:
    from lmpm.runtime.control import trace

    return torch.from_numpy(trace.favourite(ve.valid.numpy().T, ve.score.numpy().T))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 80), st.integers(1, 20), st.integers(0, 2**32 - 1))
def test_the_favourites_paths_agree(c: int, n: int, seed: int) -> None:
    """The score favourite reduces along the candidates in one call (k above WIDE, or at most FEW
    cells) or loops over the columns: the same favourite either way, ties to the lowest column,
    0 where no valid candidate or a NaN among the valid scores."""
    from lmpm.runtime.control import trace

    gen = np.random.default_rng(seed)
    valid = gen.random((c, n)) < 0.6
    score = gen.integers(-2, 3, (c, n)).astype(np.float64)  # ties
    score[gen.random((c, n)) < 0.1] = np.nan
    score[gen.random((c, n)) < 0.1] = -np.inf
    want = np.zeros(n, dtype=np.int64)
    for j in range(n):
        s = score[valid[:, j], j]
        if s.size and not np.isnan(s).any():
            want[j] = np.flatnonzero(valid[:, j] & (score[:, j] == s.max()))[0]
    got = []
    for few, wide in ((0, 10**9), (10**9, 0)):  # the loop, then the one-call reduction
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(trace, "FEW", few)
            mp.setattr(trace, "WIDE", wide)
            got.append(trace.favourite(valid, score))
    assert got[0].tolist() == want.tolist() and got[1].tolist() == want.tolist()
    one = [trace.favourite_of_one(valid[:, j].tolist(), score[:, j].tolist()) for j in range(n)]
    assert one == want.tolist()  # one cell's, from Python lists
