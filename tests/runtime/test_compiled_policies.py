"""The compiled step decides with the policies' own functions (one copy of each behaviour).

The step's agree stage (``compiled._agree``) is traced with ``make_fx`` under fake tensors, as
``--compile`` traces it, and the traced graph is run on random candidate tables: its winner equals
what the policy function (:mod:`lmpm.resolve.policies`) picks eagerly on the same tables, for every
policy LMPM ships, alone and under a quorum, with 0..4 constraints over 1..3 priority levels (the
packed key and the level loop), `hard` constraints included. And compiled.py defines no policy of
its own (read with ``ast``)."""

from __future__ import annotations

import ast
import inspect
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from lmpm.resolve import policies
from lmpm.resolve.policies import Agree, levels_of
from lmpm.runtime.data import compiled
from lmpm.runtime.data.agree import drop_hard
from lmpm.runtime.data.compiled import StepSpec, _agree, _Check, _Cols, columns_of
from lmpm.runtime.protocol import checksum

# (policy, quorum k, priorities, hard flags, layout: (rule id, replica, width) per column group)
CASES: list[tuple[str, int, tuple[int, ...], tuple[bool, ...], compiled.Layout]] = [
    ("satisfy", 0, (), (), ((7, 0, 3),)),
    ("satisfy", 0, (4,), (False,), ((7, 0, 2), (8, 0, 2))),
    ("satisfy", 0, (9, 2), (False, False), ((7, 0, 4),)),
    ("satisfy", 0, (5, 5, 1), (False, True, False), ((7, 0, 2), (8, 0, 3))),
    ("satisfy", 0, (6, 6, 6, 6), (False,) * 4, ((7, 0, 5),)),
    ("winner_takes_all", 0, (3,), (False,), ((7, 0, 3),)),
    ("winner_takes_all", 0, (3, 1), (True, False), ((7, 0, 2), (8, 0, 2))),
    ("average", 0, (), (), ((7, 0, 3),)),
    ("average", 0, (2,), (True,), ((7, 0, 2), (8, 0, 1))),
    ("satisfy", 2, (4, 1), (False, False), ((7, 0, 2), (7, 1, 2), (7, 2, 2))),
    ("winner_takes_all", 2, (), (), ((7, 0, 1), (7, 1, 1), (7, 2, 1))),
    ("average", 3, (1,), (True,), ((7, 0, 2), (7, 1, 2), (7, 2, 2))),
]


def _spec(policy: str, k: int, priority: tuple[int, ...], hard: tuple[bool, ...]) -> StepSpec:
    dtype = torch.float32 if policy == "average" else torch.int64
    return StepSpec(
        value="V",
        rules=(7, 8),
        cdims=0,
        dtype=dtype,
        policy=policy,
        quorum=k,
        folds=policy != "average",
        checks=tuple(_Check(True, True, True, False, h) for h in hard),
        priority=priority,
        order=(),
        ids=(),
        clock_rule=(),
        clock_sources=(),
        clock_uniform=(),
        clock_masked=(),
        others=(),
        tracks_inputs=False,
        quota=False,
    )


def _tables(g: torch.Generator, n: int, c: int, k: int, dtype: torch.dtype) -> list[Tensor]:
    """Random candidates: payload (n, C) of few distinct values (replicas agree and disagree),
    few distinct scores (ties), unset cells' keep-current at -inf, some missing proposals."""
    payload = torch.randint(0, 3, (n, c), generator=g).to(dtype)
    score = torch.randint(0, 3, (n, c), generator=g).double()
    score[torch.rand(n, generator=g) > 0.5, 0] = -torch.inf
    valid = torch.rand(n, c, generator=g) > 0.3
    valid[:, 0] = True
    violated = (torch.rand(n, c, k, generator=g) > 0.5) & valid[:, :, None]
    was = torch.rand(n, generator=g) > 0.5
    return [payload, score, valid, violated, was]


def _traced(spec: StepSpec, layout: compiled.Layout, args: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The agree stage traced as the compiled step traces it, run on ``args``: (winner, new)."""
    columns = columns_of(layout)

    def stage(payload: Tensor, score: Tensor, valid: Tensor, violated: Tensor, was: Tensor) -> Any:
        c = _Cols(
            list(payload.unbind(1)),
            list(score.unbind(1)),
            list(valid.unbind(1)),
            was,
            score[:, 0],
            *columns,
        )
        ag = _agree(spec, c, (score, valid, violated), torch.zeros(2, dtype=torch.int64))
        return ag.winner, ag.new

    gm = make_fx(stage, tracing_mode="fake")(*args)
    # a graph the compiled step's direct call can run: no tensor constants, only its inputs
    assert [n.target for n in gm.graph.nodes if n.op == "get_attr"] == []
    winner, new = gm(*args)
    return winner, new


def _eager(policy: str, k: int, spec: StepSpec, layout: compiled.Layout, args: list[Tensor]) -> Any:
    """The policy function itself, as the eager agreement calls it, on the same tables."""
    payload, score, valid, violated, _ = args
    rule, replica, slot = (torch.tensor(t) for t in columns_of(layout))
    hard = torch.tensor([ck.hard for ck in spec.checks], dtype=torch.bool)
    eligible = drop_hard(valid, violated, hard) if bool(hard.any()) else valid
    sums = torch.stack([checksum(payload[:, j], 0) for j in range(payload.shape[1])], dim=1)
    a = Agree(
        sums,
        eligible,
        score,
        violated,
        levels_of(spec.priority, torch.device("cpu")),
        rule,
        replica,
        slot,
        spec.dtype.is_floating_point,
    )
    if k:
        return policies.quorum(a, k, policy)
    return policies.get_policy(policy)(a)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", range(3))
def test_the_traced_agree_stage_picks_the_policy_functions_winner(case: int, seed: int) -> None:
    policy, k, priority, hard, layout = CASES[case]
    spec = _spec(policy, k, priority, hard)
    g = torch.Generator().manual_seed(1000 * case + seed)
    ncol = 1 + sum(w for _, _, w in layout)
    args = _tables(g, 64, ncol, len(priority), spec.dtype)
    winner, new = _traced(spec, layout, args)
    want = _eager(policy, k, spec, layout, args)
    assert winner.tolist() == want.winner.tolist()
    payload = args[0]
    if want.weights is None:  # the winner's payload
        assert torch.equal(new, payload.gather(1, want.winner[:, None]).squeeze(1))
    else:  # the worker's weighted mean of the proposals the policy weighs
        w = want.weights
        mean = (w * payload.double()).sum(dim=1) / w.sum(dim=1).clamp(min=1e-300)
        assert torch.equal(new, mean.to(spec.dtype))


# the policies' functions and the helpers they decide with: compiled.py defines none of them
POLICY_FUNCTIONS = {
    *policies.POLICIES,
    "best_by_score",
    "lexicographic",
    "quorum_eligible",
    "quorum_lost",
    "drop_hard",
    "keep_top",
    "_best",
    "_narrow",
    "_votes",
    "_average",
}


def _names(tree: ast.AST) -> set[str]:
    """The plain names a module calls (``drop_hard(...)``)."""
    return {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def test_compiled_defines_no_policy_of_its_own() -> None:
    tree = ast.parse(inspect.getsource(compiled))
    defined = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    assert defined & POLICY_FUNCTIONS == set()
    # and its agree stage calls the policies: the quorum and the registry's functions
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert {"quorum", "get_policy", "quorum_lost", "drop_hard"} <= called | _names(tree)
