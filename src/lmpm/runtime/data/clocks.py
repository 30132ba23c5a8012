"""Lamport clocks on commit: ``clock(cell) = 1 + max(clock(cell), clock of every cell read)``.

Control-plane metadata: the reads a commit depends on come from the plan's static gather tables
(indices), never from payload. Per rule, its reads of one source are merged into one table, so a
commit's clock costs one gather per source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from lmpm.resolve.plan import RulePlan

_MAX = np.maximum.reduce  # one C call (ndarray.max goes through two Python functions first)


@dataclass(frozen=True, slots=True)
class ClockRead:
    """The cells of one source a rule's commit takes the clock max over."""

    source: str
    uniform: bool  # every cell reads the same cells: ``index`` is their (valid) flat ids
    index: Tensor  # uniform: (R,) cells; else (target cells, K) flat source index
    valid: Tensor | None  # (target cells, K) bool; None: every entry counts


def clock_reads(rp: RulePlan) -> tuple[ClockRead, ...]:
    """A rule's reads grouped by source (empty reads dropped)."""
    out: list[ClockRead] = []
    for source in dict.fromkeys(rd.source for rd in rp.reads):
        reads = [rd for rd in rp.reads if rd.source == source]
        rows = [rd.index[0][rd.valid[0]] for rd in reads if rd.uniform]
        if rows and sum(r.numel() for r in rows):
            out.append(ClockRead(source, True, torch.cat(rows), None))
        gathered = [rd for rd in reads if not rd.uniform and rd.index.shape[1]]
        if not gathered:
            continue
        index = torch.cat([rd.index for rd in gathered], dim=1)
        valid = torch.cat([rd.valid for rd in gathered], dim=1)
        if bool(valid.all()):
            out.append(ClockRead(source, False, index, None))
        elif source == rp.target:
            # A cell's own clock is in the max anyway: pointing the invalid entries at the cell
            # itself makes them count for nothing, with no mask at run time.
            own = torch.arange(index.shape[0]).unsqueeze(1)
            out.append(ClockRead(source, False, torch.where(valid, index, own), None))
        else:
            out.append(ClockRead(source, False, index, valid))
    return tuple(out)


class Clocked(Protocol):
    """A value's control-plane state: its (N,) int64 Lamport clocks."""

    clock: Tensor


class Opened(NamedTuple):
    """A value's open cells in an epoch, as :meth:`Clocks.advance` reads them."""

    own: Tensor  # (n,) their clocks before the epoch
    cells: Tensor  # (n,) flat cell ids
    phase: int | None  # the schedule's phase (the same cells every time it recurs) or None
    fresh: bool  # every open cell is unset (own clocks are 0)


class Clocks:
    """New clocks of an epoch's committing cells."""

    def __init__(self, rules: list[RulePlan]) -> None:
        self.reads = {rp.id: clock_reads(rp) for rp in rules}
        # (rule, read, phase) -> rows of the read's tables for that phase's cells: a cyclic
        # schedule opens the same cells every few epochs, so they are gathered once
        self._rows: dict[tuple[int, int, int], tuple[Tensor, Tensor | None]] = {}
        # numpy views of the reads' tables, and of each source's clocks (made once per tensor):
        # one open cell's clock is read in numpy (:meth:`advance_one`)
        self._tables = {
            rid: tuple(
                (cr.index.numpy(), None if cr.valid is None else cr.valid.numpy()) for cr in crs
            )
            for rid, crs in self.reads.items()
        }
        self._clocks: dict[str, tuple[Tensor, np.ndarray]] = {}

    def _gather(
        self, rp: RulePlan, j: int, cr: ClockRead, cells: Tensor, phase: int | None
    ) -> tuple[Tensor, Tensor | None]:
        if phase is not None:
            hit = self._rows.get((rp.id, j, phase))
            if hit is not None:
                return hit
        if cells.numel() == 1:  # one open cell (causal generation): views of its rows
            c = int(cells)
            out = (cr.index.narrow(0, c, 1), None if cr.valid is None else cr.valid.narrow(0, c, 1))
        else:
            out = (
                cr.index.index_select(0, cells),
                None if cr.valid is None else cr.valid.index_select(0, cells),
            )
        if phase is not None:
            self._rows[(rp.id, j, phase)] = out
        return out

    def _read_max(
        self,
        state: Mapping[str, Clocked],
        rp: RulePlan,
        cells: Tensor,
        phase: int | None,
    ) -> Tensor | None:
        """(n,) or () max clock over what ``rp`` reads for ``cells`` (None: it reads nothing)."""
        read_max: Tensor | None = None
        for j, cr in enumerate(self.reads[rp.id]):
            src = state[cr.source].clock
            if cr.uniform:
                top = src.index_select(0, cr.index).amax()  # (), broadcast over the cells
            else:
                idx, valid = self._gather(rp, j, cr, cells, phase)
                got = src.take(idx)  # (n, K)
                if valid is not None:
                    got = got * valid
                top = got.squeeze(1) if got.shape[1] == 1 else got.amax(dim=1)
            read_max = top if read_max is None else torch.maximum(read_max, top)
        return read_max

    def _host_clock(self, source: str, clock: Tensor) -> np.ndarray:
        hit = self._clocks.get(source)
        if hit is None or hit[0] is not clock:
            hit = self._clocks[source] = (clock, clock.numpy())
        return hit[1]

    def advance_one(self, state: Mapping[str, Clocked], rp: RulePlan, c: int, own: int) -> int:
        """:meth:`advance` of one committing cell ``c`` (own clock ``own``) of a one-rule value,
        on host clocks: 1 + max(own, every clock ``rp`` reads for it), read in numpy."""
        top = own
        views = self._clocks
        for cr, (index, valid) in zip(self.reads[rp.id], self._tables[rp.id]):
            clock = state[cr.source].clock
            hit = views.get(cr.source)
            src = (
                hit[1]
                if hit is not None and hit[0] is clock
                else self._host_clock(cr.source, clock)
            )
            got = src[index] if cr.uniform else src[index[c]]
            if valid is not None and not cr.uniform:
                got = got * valid[c]
            most = int(_MAX(got))  # (a read is never empty: clock_reads drops empty ones)
            if most > top:
                top = most
        return top + 1

    def advance(
        self,
        state: Mapping[str, Clocked],
        rules: tuple[RulePlan, ...],
        opened: Opened,
        changed: Tensor,
        commits: int,
        contributed: Mapping[int, Tensor] | None,
    ) -> Tensor:
        """(n,) clocks of the ``opened`` cells after the epoch: a committing cell (``changed``)
        gets 1 + max(its own clock, the clocks read by every rule that contributed to its new
        payload: the winner's rule, or every rule an aggregate averaged); the others keep their
        own. ``commits``: how many cells commit. ``contributed``: rule id -> (n,) bool, the cells
        the rule contributed to (None: the value has one rule, which contributed everywhere).
        Clocks are never negative, so an invalid read contributes 0, the max's identity."""
        own, cells, phase, fresh = opened
        n = cells.numel()
        if contributed is None:  # one rule: the common case, no masks
            (rp,) = rules
            read_max = self._read_max(state, rp, cells, phase)
            if read_max is None:
                bumped = own + 1
            elif fresh and read_max.dim() == 1:
                bumped = read_max + 1  # max(0, read_max)
            else:
                bumped = torch.maximum(own, read_max) + 1
            return bumped if commits == n else torch.where(changed, bumped, own)
        top = own
        for rp in rules:
            sel = contributed.get(rp.id)
            if sel is None:
                continue
            sel = sel & changed
            if not bool(sel.any()):
                continue
            read_max = self._read_max(state, rp, cells, phase)
            if read_max is not None:
                top = torch.where(sel, torch.maximum(top, read_max), top)
        return torch.where(changed, top + 1, own)
