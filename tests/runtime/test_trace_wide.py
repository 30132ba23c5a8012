"""The trace's passes over many candidates (k in the thousands) agree with its per-column loops."""

from __future__ import annotations

import numpy as np
import pytest

from lmpm.runtime.control import trace


@pytest.mark.parametrize("ncol", [3, 70, 300])
def test_wide_and_narrow_passes_agree(ncol: int, monkeypatch: pytest.MonkeyPatch) -> None:
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
        resp = trace.attribute(valid, violated, priority, levels, fav, winner)
        out.append((fav.tolist(), resp.tolist()))
    assert out[0] == out[1]
