"""The control plane's side of a training commit: from the workers' metadata to per-cell weights.

Input: one :class:`~lmpm.train.worker.Proposal` per worker (None for a worker lost this epoch),
which holds per parameter cell a norm, a checksum and a changed bit, plus losses. Output
(:class:`Decision`): for each worker and cell the weight ``a[w][c]`` of that candidate in the
all-reduced sum Σ_w a_w·θ_w, which cells may change, and the constraint rows for the log. No
tensor reaches this module.

- ``forbid change(P[sel])``: a candidate that changed a selected cell violates it; a violating
  candidate is left out for that cell (its weight is 0). The workers also lower the freeze (the
  cells are not trained), so in practice it shows as ``frozen`` with no violations.
- ``require NormAtMost(P[sel], R)``: candidates over the bound are counted as violations; the
  commit enforces the bound by projecting the committed cell onto the ball (the workers report
  which cells they projected).
- ``average`` and ``diloco``: the valid candidates of a cell weigh 1/k each; ``best``: the valid
  candidate with the best score (the lowest held-out loss, else the lowest mean inner loss; ties
  to the lower worker) weighs 1.
- A cell with no valid candidate keeps its value (``rejected``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmpm.train.log import ConstraintRow
from lmpm.train.spec import TrainSpec
from lmpm.train.worker import Proposal, select


@dataclass(frozen=True, slots=True)
class Decision:
    weights: list[list[float]]  # [worker][cell]
    keep: list[bool]  # per cell: may change
    frozen: int  # cells held by a freeze
    rejected: int  # cells with no valid candidate (not counting frozen ones)
    constraints: list[ConstraintRow]


def _score(p: Proposal) -> float:
    if p.eval_loss is not None:
        return p.eval_loss
    return sum(p.losses) / max(len(p.losses), 1)


def decide(spec: TrainSpec, names: list[str], epoch: int, props: list[Proposal | None]) -> Decision:
    n = len(names)
    alive = [p for p in props if p is not None]
    valid = {p.worker: [True] * n for p in alive}
    frozen_cells: set[int] = set()
    rows: list[ConstraintRow] = []
    for c in spec.constraints:
        idx = select(names, c.select)
        violations = 0
        for p in alive:
            for i in idx:
                if c.kind == "freeze" and p.changed[i]:
                    valid[p.worker][i] = False
                    violations += 1
                elif c.kind == "norm" and c.bound is not None and p.norms[i] > c.bound:
                    violations += 1
        if c.kind == "freeze":
            frozen_cells.update(idx)
            action = "frozen" if idx else "none"
        else:
            action = "projected" if violations else "none"
        rows.append(ConstraintRow(epoch, c.name, c.kind, len(idx) * len(alive), violations, action))
    weights = [[0.0] * n for _ in props]
    keep = [False] * n
    rejected = 0
    best = spec.policy.kind == "best"
    for i in range(n):
        ok = [p for p in alive if valid[p.worker][i]]
        if not ok:
            if i not in frozen_cells:
                rejected += 1
            continue
        keep[i] = True
        if best:
            win = min(ok, key=lambda p: (_score(p), p.worker))
            weights[win.worker][i] = 1.0
        else:
            for p in ok:
                weights[p.worker][i] = 1.0 / len(ok)
    for i in frozen_cells:
        keep[i] = False  # a frozen cell never changes (its valid candidates did not change it)
    return Decision(weights, keep, len(frozen_cells), rejected, rows)
