"""Schedules against their definitions, over random committed flags."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpm.resolve.schedules import Frontier, Raster, ScheduleSpec, make_schedule
from lmpm.runtime.data.texpr import coords
from lmpm.signatures import STRATEGIES


@settings(max_examples=200, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=40),
    k=st.integers(1, 5),
    skip=st.integers(0, 4),
)
def test_raster_opens_the_next_k_unset_cells(flags: list[bool], k: int, skip: int) -> None:
    committed = torch.tensor(flags)
    raster = Raster(k)
    got = raster.open_cells("V", committed, 0, skip)
    unset = [i for i, f in enumerate(flags) if not f]
    assert got.dtype == torch.int64
    assert got.tolist() == unset[skip * k : (skip + 1) * k]


def test_raster_sees_commits_made_in_place() -> None:
    committed = torch.zeros(5, dtype=torch.bool)
    raster = Raster(1)
    assert raster.open_cells("V", committed, 0).tolist() == [0]
    committed[0] = True  # the control plane commits in place between epochs
    assert raster.open_cells("V", committed, 1).tolist() == [1]
    committed[:] = True
    assert raster.open_cells("V", committed, 2).tolist() == []
    fresh = torch.zeros(5, dtype=torch.bool)  # a new state tensor (a restore): read anew
    assert raster.open_cells("V", fresh, 3).tolist() == [0]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    k=st.integers(1, 3),
    skip=st.integers(0, 3),
)
def test_frontier_opens_the_next_k_unset_cells_of_every_row(
    rows: int, width: int, seed: int, k: int, skip: int
) -> None:
    committed = torch.rand(rows * width, generator=torch.Generator().manual_seed(seed)) < 0.5
    sched = make_schedule(ScheduleSpec("frontier", k), {"V": coords((rows, width))}, {}, 0)
    assert isinstance(sched, Frontier)
    got = sched.open_cells("V", committed, 0, skip)
    want = []
    for r in range(rows):  # each row on its own: raster over the row
        unset = [r * width + i for i in range(width) if not committed[r * width + i]]
        want += unset[skip * k : (skip + 1) * k]
    assert got.dtype == torch.int64
    assert got.tolist() == sorted(want)
    # every unset cell is opened once within stable_after epochs of passing over them
    assert sched.stable_after(int((~committed).sum())) * k >= max(
        (int((~committed.view(rows, width)[r]).sum()) for r in range(rows)), default=0
    )


def test_a_schedule_that_names_no_phase_never_returns_one() -> None:
    """Owner.epoch asks `phase` only of the schedules whose `phased` is set: the others must
    answer None in every epoch (the open cells depend on the state)."""
    shape = (3, 4)
    for strategy in STRATEGIES:
        sched = make_schedule(
            ScheduleSpec(strategy, 1, 4), {"V": coords(shape)}, {"V": torch.arange(12) % 2}, 0
        )
        if not sched.phased:
            assert all(sched.phase("V", e) is None for e in range(6)), strategy
    assert make_schedule(ScheduleSpec("red-black"), {"V": coords(shape)}, {}, 0).phased
