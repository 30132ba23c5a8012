"""The trace's passes over many candidates (k in the thousands) agree with its per-column loops."""

from __future__ import annotations

import numpy as np
import pytest

from lmpm.runtime.control import trace


@pytest.mark.parametrize("hard", [None, np.array([False, False, True])])
@pytest.mark.parametrize("ncol", [3, 70, 300])
def test_wide_and_narrow_passes_agree(
    ncol: int, hard: np.ndarray | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(ncol)
    n, k = 40, 3
    valid = rng.random((n, ncol)) < 0.7
    valid[:, 0] = True
    score = np.round(rng.normal(size=(n, ncol)), 1)  # ties happen
    score[rng.random((n, ncol)) < 0.1] = -np.inf
    violated = (rng.random((n, ncol, k)) < 0.4) & valid[:, :, None]
    priority = np.array([5, 5, 1])
    levels = ((5, (0, 1)), (1, (2,)))
    winner = rng.integers(0, ncol, size=n)
    out = []
    for wide in (10**9, 0):  # the loops, then the one-call passes
        monkeypatch.setattr(trace, "WIDE", wide)
        fav = trace.favourite(np.ascontiguousarray(valid.T), np.ascontiguousarray(score.T))
        resp = trace.attribute(valid, violated, priority, levels, fav, winner, hard)
        out.append((fav.tolist(), resp.tolist()))
    assert out[0] == out[1]


def test_a_hard_constraint_decides_the_favourite_it_excludes() -> None:
    """Columns: keep (violates the hard H), the favourite (violates H, satisfies the higher S),
    a proposal satisfying H but not S. The levels alone would keep the favourite to the end; H
    excluded it, and is responsible even though the winner, keep-current, violates H too."""
    valid = np.ones((1, 3), dtype=bool)
    violated = np.array([[[True, False], [True, False], [False, True]]])  # (1, C, K): K = H, S
    priority = np.array([5, 20])
    levels = ((20, (1,)), (5, (0,)))
    fav, winner = np.array([1]), np.array([0])
    soft = trace.attribute(valid, violated, priority, levels, fav, winner)
    hard = trace.attribute(valid, violated, priority, levels, fav, winner, np.array([True, False]))
    assert soft.tolist() == [[False, False]]
    assert hard.tolist() == [[True, False]]
