"""A worker's candidate tables: per proposed value, column 0 keep-current and every rule replica's
proposals after it; a proposal equal to the committed payload folded into keep-current; every
constraint checked on every candidate (:mod:`lmpm.runtime.data.checks`). The table stays on the
worker until apply (:class:`Staged`); its metadata goes to the owner
(:class:`~lmpm.runtime.protocol.Candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lmpm.resolve.plan import Plan, ValuePlan
from lmpm.runtime.data.calls import Proposal
from lmpm.runtime.data.checks import CandidateTable, Checks
from lmpm.runtime.data.resident import Resident
from lmpm.runtime.protocol import Candidates, checksum

Columns = tuple[Tensor, Tensor, Tensor]  # (C,) each: rule id, replica and slot of every column


@dataclass(slots=True)
class Staged:
    """One value's candidate table between propose and apply (never leaves the worker)."""

    cells: Tensor  # (n,) on the device
    table: Tensor  # (n, C, *cell) candidate payloads; column 0 is the committed payload
    committed: Tensor  # (n,) bool before the epoch


def fold(
    vp: ValuePlan,
    table: Tensor,
    current: Tensor,
    committed: Tensor,
    valid: Tensor,
    score: Tensor,
    all_valid: bool,
) -> tuple[Tensor, Tensor]:
    """A proposal equal to the committed payload *is* keep-current, freshly scored: fold it into
    column 0 (its best such score, written into ``score``) so a stale committed score never
    outranks the rule's current opinion. ``current``: (n, 1, *cell) the committed payload. Returns
    the candidates still valid and (n,) which cells were refreshed."""
    same = table == current
    if vp.cell_shape:
        same = same.flatten(2).all(dim=2)
    same &= committed.unsqueeze(1)
    if not all_valid:
        same &= valid
    same[:, 0] = False
    refreshed = same.any(dim=1)
    score[:, 0] = torch.where(same, score, -torch.inf).amax(dim=1)
    return valid & ~same, refreshed


class Staging:
    """Builds, checks and keeps a worker's candidate tables (see the module doc). ``taps``: the
    worker's instrumentation, tap(epoch, value, cells, table (n, C, *cell), valid (n, C)) on every
    table built."""

    def __init__(self, plan: Plan, res: Resident, checks: Checks, taps: list[Any]) -> None:
        self.plan = plan
        self.res = res
        self.checks = checks
        self.taps = taps
        self.staged: dict[str, Staged] = {}
        self._columns_cache: dict[tuple[tuple[int, int, int], ...], Columns] = {}
        # per table shape (n, C): its constant parts, made once (see _fills)
        self._fill_cache: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}
        # per value: (its payload, the payload as a column (N, 1, *cell)), made once per tensor
        self._column: dict[str, tuple[Tensor, Tensor]] = {}

    def build(
        self,
        name: str,
        e: int,
        parts: list[Proposal],
        fresh: bool,
    ) -> Candidates:
        """Build, fold and check one value's candidate table; stage it for apply."""
        vp = self.plan.values[name]
        tabs = self.checks.tables[name]
        res = self.res
        one = len(parts) == 1
        if one:  # one rule fired (the common case): no generators
            part = parts[0]
            cells = part.cells
            widths = [part.proposals.shape[1]]
            key: tuple[tuple[int, int, int], ...] = ((part.rule.id, part.replica, widths[0]),)
            ncol = 1 + widths[0]
        else:
            cells = torch.unique(torch.cat([p.cells for p in parts]))
            widths = [p.proposals.shape[1] for p in parts]
            key = tuple((p.rule.id, p.replica, w) for p, w in zip(parts, widths))
            ncol = 1 + sum(widths)
        n = cells.shape[0]
        fills = self._fill_cache.get((n, ncol)) or self._fills(n, ncol)
        payload = res.payload[name]
        column = self._column.get(name)
        if column is None or column[0] is not payload:
            column = self._column[name] = (payload, payload.unsqueeze(1))
        current = column[1].index_select(0, cells)  # (n, 1, *cell): the table's column 0
        committed = fills[0] if fresh else res.committed[name].index_select(0, cells)
        if one:  # keep-current, then the part's proposals (every candidate valid)
            prop = part.proposals
            table = torch.cat((current, prop if prop.dtype == vp.dtype else prop.to(vp.dtype)), 1)
            valid, score, all_valid = fills[2], torch.cat((fills[1], part.scores), 1), True
        else:
            table, valid, score, all_valid = self._layout(vp, parts, widths, cells, current, fills)
        refreshed: Tensor | None = None
        any_committed = not fresh and bool(committed.any())
        if any_committed and tabs.folds:
            valid, refreshed = fold(vp, table, current, committed, valid, score, all_valid)
            all_valid = False
        ct = CandidateTable(
            name, vp, e, cells, table, valid, current, committed, any_committed, all_valid
        )
        violated, applies = self.checks.check(ct, tabs)
        layout = self._columns_cache.get(key) or self.columns(key)  # (rule, replica, slot)
        sums = checksum(table, len(vp.cell_shape)) if tabs.checksums else None
        self.staged[name] = Staged(cells, table, committed)
        for tap in self.taps:
            tap(e, name, cells, table, valid)
        cand = Candidates(name, cells, valid, score, violated, applies, *layout, refreshed, sums)
        return cand if res.host else cand.to_host()

    def _fills(self, n: int, ncol: int) -> tuple[Tensor, Tensor, Tensor]:
        """The constant parts of an (n, ncol) table, made once per shape: (n,) bool committed
        before the epoch (False: a fresh schedule's unset cells), (n, 1) float64 keep-current's
        score (-inf), (n, ncol) bool valid (all True). Never written in place, never handed to
        user code as its own (predicates get copies)."""
        dev = self.res.device
        hit = self._fill_cache[(n, ncol)] = (
            torch.zeros(n, dtype=torch.bool, device=dev),
            torch.full((n, 1), -torch.inf, dtype=torch.float64, device=dev),
            torch.ones((n, ncol), dtype=torch.bool, device=dev),
        )
        return hit

    def _layout(
        self,
        vp: ValuePlan,
        parts: list[Proposal],
        widths: list[int],
        cells: Tensor,
        current: Tensor,
        fills: tuple[Tensor, Tensor, Tensor],
    ) -> tuple[Tensor, Tensor, Tensor, bool]:
        """The table of ``cells`` (sorted) of several parts before folding: (table (n, C, *cell),
        valid (n, C), score (n, C) float64, every candidate valid: False). Column 0 keeps
        ``current`` (n, 1, *cell); each part's proposals follow in order, invalid where its rule
        did not fire. ``fills``: the table's constant parts (:meth:`_fills`); one part's table is
        :meth:`build`'s."""
        n, ncol = fills[2].shape
        dev = self.res.device
        table = torch.zeros((n, ncol, *vp.cell_shape), dtype=vp.dtype, device=dev)
        table[:, :1] = current
        valid = torch.zeros((n, ncol), dtype=torch.bool, device=dev)
        valid[:, 0] = True
        score = torch.full((n, ncol), -torch.inf, dtype=torch.float64, device=dev)
        c = 1
        for p, w in zip(parts, widths):
            rows = torch.searchsorted(cells, p.cells)
            table[rows, c : c + w] = p.proposals.to(vp.dtype)
            valid[rows, c : c + w] = True
            score[rows, c : c + w] = p.scores
            c += w
        return table, valid, score, False

    def columns(self, key: tuple[tuple[int, int, int], ...]) -> Columns:
        """(C,) rule id, replica and slot of each candidate column (-1: keep) of the layout
        ``key`` (per part: rule id, replica, width); made once per layout."""
        hit = self._columns_cache.get(key)
        if hit is None:
            rule, rep, slot = [-1], [-1], [-1]
            for rid, replica, w in key:
                rule += [rid] * w
                rep += [replica] * w
                slot += list(range(w))
            hit = (torch.tensor(rule), torch.tensor(rep), torch.tensor(slot))
            self._columns_cache[key] = hit
        return hit  # (the engine hands policies it does not ship copies)
