"""Commit policies on hand-made candidate tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmpm.errors import BindError
from lmpm.resolve.policies import Agree, get_policy, levels_of


def agree(
    payload: list[list[int]],
    score: list[list[float]],
    violated: list[list[list[bool]]],
    priority: list[int],
    rule: list[int] | None = None,
    slot: list[int] | None = None,
) -> Agree:
    p = torch.tensor(payload)
    c = p.shape[1]
    return Agree(
        p,
        torch.ones_like(p, dtype=torch.bool),
        torch.tensor(score, dtype=torch.float64),
        torch.tensor(violated, dtype=torch.bool).reshape(p.shape[0], c, len(priority)),
        levels_of(tuple(priority), torch.device("cpu")),
        torch.tensor(rule or [-1] + [0] * (c - 1)),
        torch.tensor([-1, *range(c - 1)]),
        torch.tensor(slot or [-1] + [0] * (c - 1)),
    )


def test_satisfy_is_lexicographic_by_priority_then_score() -> None:
    # keep, a (violates the low constraint, high score), b (violates the high one, highest score)
    a = agree(
        [[0, 1, 2]], [[0.0, 5.0, 9.0]], [[[False, False], [False, True], [True, False]]], [100, 1]
    )
    d = get_policy("satisfy")(a, "max_constraints_then_score")
    assert d.winner.tolist() == [0]  # keep satisfies both
    a = agree(
        [[0, 1, 2]], [[0.0, 5.0, 9.0]], [[[True, True], [False, True], [True, False]]], [100, 1]
    )
    assert get_policy("satisfy")(a).winner.tolist() == [1]


def test_satisfy_counts_constraints_within_a_level_and_breaks_ties_by_column() -> None:
    a = agree(
        [[0, 1, 2]], [[1.0, 1.0, 1.0]], [[[True, True], [False, True], [True, False]]], [5, 5]
    )
    assert get_policy("satisfy")(a).winner.tolist() == [1]  # 1 vs 1 satisfied: tie -> lowest column


def test_winner_takes_all_ignores_constraints() -> None:
    a = agree([[0, 1, 2]], [[9.0, 1.0, 3.0]], [[[False], [False], [True]]], [10])
    assert get_policy("winner_takes_all")(a).winner.tolist() == [2]


def test_average_needs_numbers() -> None:
    a = agree([[0, 1, 2]], [[0.0, 0.0, 0.0]], [[[False], [False], [False]]], [1])
    with pytest.raises(BindError, match="numeric"):
        get_policy("average")(a)
    f = Agree(
        torch.tensor([[0, 1, 3]]),
        torch.ones(1, 3, dtype=torch.bool),
        torch.zeros(1, 3, dtype=torch.float64),
        torch.zeros(1, 3, 0, dtype=torch.bool),
        levels_of((), torch.device("cpu")),
        torch.tensor([-1, 0, 0]),
        torch.tensor([-1, 0, 0]),
        torch.tensor([-1, 0, 1]),
        True,
    )
    d = get_policy("average")(f)
    assert d.winner.tolist() == [1] and d.weights is not None
    assert d.weights.tolist() == [[0.0, 1.0, 1.0]]  # the worker averages columns 1 and 2


def test_quorum_requires_agreeing_replicas() -> None:
    # two replicas of one rule, same slot: agree on 3 in row 0, disagree in row 1
    a = agree(
        [[0, 3, 3], [0, 3, 4]],
        [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]],
        [[[False], [False], [False]], [[False], [False], [False]]],
        [1],
        rule=[-1, 0, 0],
        slot=[-1, 0, 0],
    )
    d = get_policy("quorum")(a, 2, "satisfy")
    assert d.winner.tolist() == [1, 0]  # row 0: replicas agree (checksum 3); row 1: they differ


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(BindError, match="satisfy"):
        get_policy("nope")


def _satisfy_by_hand(a: Agree) -> list[int]:
    """satisfy() as its definition reads: per cell, the valid candidate maximizing (satisfied
    constraints per priority level, highest level first; score; -column)."""
    levels = sorted(set(a.levels.priority), reverse=True)
    winners = []
    for i in range(a.checksum.shape[0]):
        best: tuple[Any, ...] | None = None
        win = 0
        for c in range(a.checksum.shape[1]):
            if not a.valid[i, c]:
                continue
            sat = tuple(
                sum(
                    not bool(a.violated[i, c, k])
                    for k, p in enumerate(a.levels.priority)
                    if p == level
                )
                for level in levels
            )
            key = (sat, float(a.score[i, c]), -c)
            if best is None or key > best:
                best, win = key, c
        winners.append(win)
    return winners


PRIORITIES = (
    [3],
    [7, 7],
    [9, 2],
    [5, 5, 1],
    [4, 8, 4, 8],
    [6, 6, 6, 2, 2, 9, 6],  # a level of 4: a 3-bit field in the packed key
    list(range(60, 0, -1)),  # 60 one-constraint levels: 60 bits, past float64's 53 (the loop)
)


@pytest.mark.parametrize("seed", range(2 * len(PRIORITIES)))
def test_satisfy_equals_its_definition_on_random_candidates(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    priority = PRIORITIES[seed % len(PRIORITIES)]
    k = len(priority)
    n, c = (40, 6) if k < 10 else (6, 6)
    valid = torch.rand(n, c, generator=g) > 0.3
    valid[:, 0] = True  # keep-current always exists
    # few distinct scores (ties) and unset cells' keep-current at -inf
    score = torch.randint(0, 3, (n, c), generator=g).double()
    score[torch.rand(n, generator=g) > 0.5, 0] = -torch.inf
    if seed % 2:  # -inf elsewhere too: an eligible -inf still beats every ineligible column
        score[torch.rand(n, c, generator=g) > 0.8] = -torch.inf
    a = Agree(
        torch.randint(0, 9, (n, c), generator=g),
        valid,
        score,
        torch.rand(n, c, k, generator=g) > 0.5,
        levels_of(tuple(priority), torch.device("cpu")),
        torch.tensor([-1] + [0] * (c - 1)),
        torch.tensor([-1] + [0] * (c - 1)),
        torch.tensor([-1, *range(c - 1)]),
    )
    d = get_policy("satisfy")(a)
    want = _satisfy_by_hand(a)
    assert d.winner.tolist() == want
