"""The per-value decision as named stages over tensors: written once, called by every epoch path.

One value's epoch is a list of stages, each a short function over tensors:

1. **open** -- which cells the schedule opens (:meth:`lmpm.runtime.data.owner.Owner.open_cells`);
2. **fold candidates** -- the workers' proposals as one (n, C) table
   (:class:`~lmpm.runtime.protocol.Candidates`; a group merges its workers' columns);
3. **check** -- each candidate's constraint verdicts (n, C, K), counted by :func:`count_violations`;
4. **agree** -- the value's policy (:func:`lmpm.runtime.data.agree.agree`), a quorum's
   :func:`quorum_lost` cells, the schedule's quota; the result waits as a :class:`Pending`;
5. **apply** -- the workers write the winners (:meth:`Pending.decision`), then
   :func:`applied_changed` folds in what they report as written;
6. **advance clocks** -- :func:`contributions` names the rules each committed cell's clock reads
   (:mod:`lmpm.runtime.data.clocks` advances them);
7. **write metadata** -- :func:`write_meta`, the ONE writer of a value's cell metadata (committed,
   clock, rule, epoch, score; :func:`write_cell` is its one-cell form, through numpy views): the
   eager owner's commits, the shard owners' exchanged commits, the device step's
   :meth:`~lmpm.runtime.data.owner.Owner.settle`, inputs and resume all call it;
8. **record why** -- :func:`blocked_why`: why each cell left unset stays unset.

The eager :class:`~lmpm.runtime.data.owner.Owner` runs the stages in order; the shard owner
(:mod:`lmpm.runtime.data.shard`) overrides only those that exchange data between owners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmpm.resolve.plan import RulePlan
from lmpm.resolve.policies import quorum_eligible
from lmpm.runtime.protocol import Applied, Candidates, ValueDecision
from lmpm.runtime.records import NO_QUORUM, NO_WINNER, CellState, ValueEpoch


@dataclass(slots=True)
class Pending:
    """One value agreed on (stage 4), waiting for the workers' apply (stage 5)."""

    cand: Candidates
    score: Tensor  # (n, C) the policy's scores
    winner: Tensor  # (n,) int64 chosen column
    changed: Tensor  # (n,) bool: the winner commits
    weights: Tensor | None  # (n, C) an aggregate's weights (None: one winner per cell)
    rows: Tensor | None  # the committing rows (None: every row)
    was: Tensor  # (n,) bool: the open cell was committed before the epoch
    commits: int
    disagreed: Tensor | None = None  # (n,) bool, under a quorum: no proposal had its k votes

    def decision(self) -> ValueDecision:
        """What the workers write: the committing rows and their winners (or weights)."""
        if self.rows is None:
            return ValueDecision(None, self.winner, self.weights)
        w = self.weights
        return ValueDecision(
            self.rows,
            self.winner.index_select(0, self.rows),
            None if w is None else w.index_select(0, self.rows),
        )


# ---- check -------------------------------------------------------------------------------------
def count_violations(violated: Tensor) -> int:
    """Candidates of an (n, C, K) verdict table that violate some constraint."""
    k = violated.shape[2]
    if not k:
        return 0
    return int((violated if k == 1 else violated.any(dim=2)).count_nonzero())


# ---- agree -------------------------------------------------------------------------------------
def quorum_lost(cand: Candidates, k: int | None) -> Tensor | None:
    """(n,) bool under a quorum of ``k`` votes: the cells where some replica proposed but no
    proposed payload had its k votes (None: no quorum, or no checksums to compare)."""
    if k is None or cand.checksum is None:
        return None
    agreed = quorum_eligible(cand.checksum, cand.valid, cand.col_rule, cand.col_slot, k)
    return cand.valid[:, 1:].any(dim=1) & ~agreed[:, 1:].any(dim=1)


# ---- apply -------------------------------------------------------------------------------------
def applied_changed(p: Pending, got: Applied) -> tuple[Tensor, int, Tensor | None]:
    """(changed, commits, committing rows) once the workers reported what they wrote: an
    aggregate equal to the committed payload is no commit (rows None: recompute from changed)."""
    if got.changed is None:
        return p.changed, p.commits, p.rows
    if p.rows is None:
        changed = p.changed & got.changed
    else:
        changed = p.changed.clone()
        changed[p.rows] = got.changed
    return changed, int(changed.count_nonzero()), None


# ---- advance clocks ----------------------------------------------------------------------------
def contributions(
    rules: tuple[RulePlan, ...], cand: Candidates, winner: Tensor, weights: Tensor | None
) -> tuple[dict[int, Tensor] | None, Tensor | None]:
    """With several rules: per rule, (n,) bool the cells whose commit it contributed to (the
    winner's rule, or every rule an aggregate weighs), and (n,) each cell's winning rule. One rule:
    (None, None), every committing column is that rule's."""
    if len(rules) < 2:
        return None, None
    won_rule = cand.col_rule.index_select(0, winner)
    if weights is None:
        return {rp.id: won_rule == rp.id for rp in rules}, won_rule
    used = weights > 0
    return {rp.id: used[:, cand.col_rule == rp.id].any(dim=1) for rp in rules}, won_rule


# ---- write metadata ----------------------------------------------------------------------------
class CellArrays(NamedTuple):
    """numpy views of a host :class:`CellState`'s tensors (they share its memory): one cell's
    metadata read and written without a tensor operation (:func:`write_cell`)."""

    committed: np.ndarray  # (N,) bool
    clock: np.ndarray  # (N,) int64
    rule: np.ndarray  # (N,) int64
    epoch: np.ndarray  # (N,) int64
    score: np.ndarray  # (N,) float64

    @staticmethod
    def of(st: CellState) -> CellArrays:
        return CellArrays(
            st.committed.numpy(),
            st.clock.numpy(),
            st.rule.numpy(),
            st.epoch.numpy(),
            st.score.numpy(),
        )


def write_meta(
    st: CellState,
    idx: Tensor,
    clock: Tensor,
    rule: Tensor | int,
    epoch: Tensor | int,
    score: Tensor | float,
) -> None:
    """The one writer of cell metadata: mark ``idx`` (m,) committed in ``epoch`` ((m,) or one
    epoch) with clocks ``clock`` (m,), provenance ``rule`` ((m,) or one id) and scores ``score``
    ((m,) or one value). ``st``'s tensors are written in place (they may share memory with numpy arrays)."""
    if not idx.numel():
        return
    st.committed.index_fill_(0, idx, True)
    st.clock.index_put_((idx,), clock)
    if isinstance(rule, Tensor):
        st.rule.index_put_((idx,), rule)
    else:
        st.rule.index_fill_(0, idx, rule)
    if isinstance(epoch, Tensor):
        st.epoch.index_put_((idx,), epoch)
    else:
        st.epoch.index_fill_(0, idx, epoch)
    if isinstance(score, Tensor):
        st.score.index_put_((idx,), score)
    else:
        st.score.index_fill_(0, idx, score)


def write_cell(st: CellArrays, c: int, clock: int, rule: int, epoch: int, score: float) -> None:
    """:func:`write_meta` of one cell ``c`` (causal generation's commit) through numpy views: the
    same five fields, a few scalar stores instead of five indexed tensor writes."""
    st.committed[c] = True
    st.clock[c] = clock
    st.rule[c] = rule
    st.epoch[c] = epoch
    st.score[c] = score


def newly_set(ve: ValueEpoch) -> int:
    """Cells of the record committed for the first time."""
    return int((ve.changed & ~ve.was_committed).count_nonzero())


# ---- record why --------------------------------------------------------------------------------
def blocked_why(
    valid: Tensor,
    violated: Tensor,
    priority: Tensor,
    constraint_ids: Tensor,
    lost: Tensor | None,
) -> Tensor:
    """(m,) int64 why each of m proposed cells stays unset, from their rows of the candidates'
    ``valid`` (m, C) and ``violated`` (m, C, K) (column 0 is keep-current): where a quorum's
    replicas disagreed (``lost`` (m,) bool), NO_QUORUM; else the highest-``priority`` constraint
    every valid proposal violates, else one some proposal violates, else NO_WINNER."""
    why = torch.full((valid.shape[0],), NO_WINNER, dtype=torch.int64)
    if violated.shape[2]:
        valid = valid[:, 1:]  # (m, C-1) proposals only
        viol = violated[:, 1:, :]  # (m, C-1, K)
        order = torch.sort(-priority, stable=True).indices  # highest priority first
        some = valid.any(dim=1, keepdim=True)  # (m, 1)
        every = ((viol | ~valid.unsqueeze(2)).all(dim=1) & some)[:, order]  # (m, K)
        anyv = (viol & valid.unsqueeze(2)).any(dim=1)[:, order]  # (m, K)
        ids = constraint_ids[order]
        for hit in (anyv, every):  # `every` overrides `some`
            first = hit.to(torch.uint8).argmax(dim=1)
            why = torch.where(hit.any(dim=1), ids[first], why)
    if lost is not None:  # no proposal had its k votes: the disagreement, not a constraint
        why = torch.where(lost.to(why.device), NO_QUORUM, why)
    return why
