"""Agreement: one value's candidates (metadata) → which cells commit, and with which column.

A pure function of the workers' :class:`~lmpm.runtime.protocol.Candidates` and the owner's cell
metadata (:mod:`lmpm.runtime.data.owner`); it never sees payload. The commit policy picks a winner per cell (or aggregation
weights); a schedule with a quota (confidence) keeps the most confident commits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lmpm.resolve import policies
from lmpm.resolve.plan import ValuePlan
from lmpm.resolve.policies import Agree, Decision, Levels, levels_of
from lmpm.runtime.protocol import Candidates

# The policies shipped with LMPM never write into their inputs; any other policy gets copies.
_TRUSTED = frozenset(
    (policies.satisfy, policies.winner_takes_all, policies.average, policies.quorum)
)


_NO_CHECKSUMS = torch.empty(0, dtype=torch.int64)  # the policy does not compare payloads


@dataclass(slots=True)
class Agreed:
    score: Tensor  # (n, C) float64 with keep-current's score filled in
    winner: Tensor  # (n,) int64 chosen column (0: keep)
    changed: Tensor  # (n,) bool: the cell commits (before the worker's aggregate check)
    weights: Tensor | None  # (n, C) aggregation weights of an aggregating policy


def agree(
    vp: ValuePlan,
    cand: Candidates,
    kept_score: Tensor,
    priority: tuple[int, ...],
    quota: int | None,
    fresh: bool = False,
    hard: Tensor | None = None,
) -> Agreed:
    """Run ``vp``'s policy on ``cand``. ``kept_score``: (n,) committed score of each open cell
    (-inf when unset); ``priority``: the K constraints' priorities (host values, built once per
    value); ``quota``: at most this many cells
    commit, the highest-scoring winners first (ties: lower cell); ``fresh``: every open cell is
    unset; ``hard``: (K,) bool, the `hard` constraints: a proposal violating one is not eligible
    (keep-current always is, so such a cell keeps its value, or stays unset)."""
    score = cand.score
    if cand.refreshed is not None:
        score[:, 0] = torch.where(cand.refreshed, score[:, 0], kept_score)
    elif not fresh:  # (unset cells: the worker's column 0 is -inf already)
        score[:, 0] = kept_score
    checksum = cand.checksum if cand.checksum is not None else _NO_CHECKSUMS
    valid = cand.valid
    if hard is not None:
        valid = drop_hard(valid, cand.violated, hard.to(cand.violated.device))
    a = Agree(
        checksum,
        valid,
        score,
        cand.violated,
        levels_of(priority, cand.violated.device),
        cand.col_rule,
        cand.col_replica,
        cand.col_slot,
        vp.dtype.is_floating_point,
    )
    if vp.policy not in _TRUSTED:
        a = Agree(*(_copy(t) for t in _fields(a)))  # type: ignore[arg-type]
    decision: Decision = vp.policy(a, *vp.policy_args)
    winner = decision.winner
    changed = winner != 0
    if quota is not None and int(changed.count_nonzero()) > quota:
        n = winner.numel()
        conf = torch.where(changed, score[torch.arange(n), winner], -torch.inf)
        changed = changed & keep_top(conf, quota)
    return Agreed(score, winner, changed, decision.weights)


def drop_hard(valid: Tensor, violated: Tensor, hard: Tensor) -> Tensor:
    """(n, C) bool: ``valid`` less the proposals (column 1 on) that violate a `hard` constraint
    (``violated`` (n, C, K), ``hard`` (K,) bool); keep-current always stays eligible. The eager
    agreement and the compiled step (traced) both call it."""
    out = (violated & hard).any(dim=2)
    out.select(1, 0).fill_(False)
    return valid & ~out


def keep_top(conf: Tensor, quota: int | Tensor) -> Tensor:
    """(n,) bool: the ``quota`` rows of highest confidence ``conf`` (rows in cell order; ties:
    the lower cell first). ``quota`` an int, or a 0-d int64 tensor (the compiled step's input:
    the same function traced)."""
    order = torch.sort(-conf, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        0, order, torch.arange(conf.numel(), device=conf.device)
    )
    return rank < quota


def _fields(a: Agree) -> tuple[object, ...]:
    return tuple(getattr(a, f) for f in a.__dataclass_fields__)


def _copy(t: object) -> object:
    """A copy of one :class:`Agree` field for a policy LMPM does not ship (it may write it)."""
    if isinstance(t, Tensor):
        return t.clone()
    if isinstance(t, Levels) and t.key is not None:
        return Levels(t.priority, t.key.clone())
    return t
