"""Schedules against their definitions, over random committed flags."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpm.resolve.schedules import Raster


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
