"""The plain records both planes and the run directory share: the metadata of a value's cells,
what an epoch did, why a run stopped, and the codes they use. No behaviour lives here, and it
imports nothing of the runtime (nor torch, until a record is made), so every part of it can
import this module.
"""

from __future__ import annotations

import copyreg
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # torch-free at import: `lmpm trace` and the run directory's reader use it
    from torch import Tensor

INPUT_RULE = -2  # provenance of cells committed from an input file
NO_RULE = -1

# Why an unset cell is unset (the last time the schedule opened it), beside constraint ids >= 0:
NEVER_OPENED = -3  # the schedule never opened it
NOT_FIRED = -2  # opened, but no rule's `on`/`when` fires there
NO_WINNER = -1  # a rule proposed, but no candidate beat leaving it unset (invalid, score)
UNKNOWN = -4  # a resumed run: not recorded since the resume
HELD = -5  # a candidate won, but the schedule's quota held it back for a later epoch
NO_SOURCE = -6  # a value no rule proposes and no input gave (every cell unset)
NO_QUORUM = -7  # the replicas of a quorum disagreed: no proposed payload had its k votes

# Policies that compare candidates' payloads (by checksum): the worker computes checksums for them.
CHECKSUM_POLICIES = frozenset(("quorum",))


@dataclass(frozen=True, slots=True)
class RuleSetEvent:
    """One committed change of the RuleSet: constraint ``name`` added to (``op`` "add") or removed
    from ("remove") the active set from the start of ``epoch`` on; ``clock``: Lamport clock of the
    event; ``by``: who asked (api, cli)."""

    epoch: int
    op: str
    name: str
    clock: int
    by: str


@dataclass
class CellState:
    """Metadata of one value's cells (the payload itself lives on the data plane)."""

    committed: Tensor  # (N,) bool
    clock: Tensor  # (N,) int64 Lamport clock
    rule: Tensor  # (N,) int64 provenance: rule id, INPUT_RULE, or NO_RULE
    epoch: Tensor  # (N,) int64 provenance: epoch of the last commit (-1: never / input)
    score: Tensor  # (N,) float64 score of the committed candidate (-inf when unset)

    @staticmethod
    def empty(n: int) -> CellState:
        import torch

        return CellState(
            torch.zeros(n, dtype=torch.bool),
            torch.zeros(n, dtype=torch.int64),
            torch.full((n,), NO_RULE, dtype=torch.int64),
            torch.full((n,), -1, dtype=torch.int64),
            torch.full((n,), -torch.inf, dtype=torch.float64),
        )


class AccessInput(NamedTuple):
    """One further access argument of a predicate call, per open cell: the K cells it reads."""

    payload: Tensor  # (n, K[, *cell]) their payload
    mask: Tensor  # (n, K) bool: the cell exists and is committed
    cells: Tensor  # (n, K) int64 their flat cell index within the accessed value


@dataclass(frozen=True, slots=True)
class PredicateInput:
    """What a user-bound predicate receives (n open cells, C candidates each). Copies: a predicate
    that writes into them changes nothing."""

    candidates: Tensor  # (n, C, *cell) candidate payloads
    valid: Tensor  # (n, C) bool
    current: Tensor  # (n, *cell) committed payload (undefined where not committed)
    committed: Tensor  # (n,) bool
    cells: Tensor  # (n,) flat cell index within the value
    coords: Tensor  # (n, rank)
    accesses: tuple[AccessInput, ...]  # per further access argument (P(A, B): B's)
    args: tuple[Any, ...]  # literal arguments
    epoch: int


@dataclass
class ValueEpoch:
    """What happened to one value in one epoch (metadata, handed to observers: log, trace)."""

    value: str
    cells: Tensor  # (n,) open cells that had candidates
    valid: Tensor  # (n, C)
    score: Tensor  # (n, C)
    col_rule: Tensor  # (C,) rule id per column (-1 keep)
    violated: Tensor  # (n, C, K)
    constraint_ids: Tensor  # (K,) ids into plan.constraints
    winner: Tensor  # (n,) chosen column
    changed: Tensor  # (n,) bool: the winner changes the cell (a commit)
    new_clock: Tensor  # (n,)
    was_committed: Tensor  # (n,) bool, before this epoch
    applies: Tensor  # (n, K) bool: the constraint speaks about the cell (its verdicts count)
    checksum: Tensor | None = None  # (n,) int64 committed payload checksum where changed
    # (C,) the candidates' replica and proposal slot per column: set by a group's owners, whose
    # records are merged into one owner's columns (lmpm.runtime.data.shard.merge_records)
    col_replica: Tensor | None = None
    col_slot: Tensor | None = None
    # (n,) bool under a quorum: the cells whose replicas disagreed (no proposed payload had the
    # k votes), so no constraint decided them (the trace's attribution, the cell story)
    disagreed: Tensor | None = None


ONE_CELL_COLUMNS = 64  # candidates a OneCell reads as numbers


@dataclass(frozen=True, slots=True)
class OneCell:
    """A :class:`ValueEpoch` of one open cell (a decode's epoch) as Python numbers, each tensor
    read once (a small tensor's ``tolist`` costs a fraction of a NumPy view and an index): what
    the commit log's row, the epoch's counts and the trace's summary of such an epoch read."""

    cell: int
    valid: list[bool]  # (C,)
    score: list[float]  # (C,)
    col_rule: list[int]  # (C,)
    violated: list[list[bool]]  # (C, K)
    applies: list[bool]  # (K,)
    winner: int
    changed: bool
    clock: int  # the cell's clock after the epoch
    checksum: int | None  # the committed payload's (None: the record carries none)
    disagreed: bool  # a quorum's replicas disagreed on the cell

    @staticmethod
    def of(ve: ValueEpoch) -> OneCell | None:
        """``ve`` read into Python numbers; None unless it has exactly one open cell with at most
        ``ONE_CELL_COLUMNS`` candidates (k = V's table stays with the tensor paths, whose cost
        does not grow with k)."""
        if ve.cells.numel() != 1 or ve.valid.shape[-1] > ONE_CELL_COLUMNS:
            return None
        return OneCell(
            ve.cells.tolist()[0],
            ve.valid.tolist()[0],
            ve.score.tolist()[0],
            ve.col_rule.tolist(),
            ve.violated.tolist()[0],
            ve.applies.tolist()[0],
            ve.winner.tolist()[0],
            ve.changed.tolist()[0],
            ve.new_clock.tolist()[0],
            None if ve.checksum is None else ve.checksum.tolist()[0],
            False if ve.disagreed is None else ve.disagreed.tolist()[0],
        )


def wire_code(cls: type, code: int) -> type:
    """Pickle references to ``cls`` as a two-byte extension code (``copyreg``; codes 240-255 are
    for private use) instead of its module and name. The messages between the planes are a few
    dozen bytes each; their class's path would be a third of that."""
    copyreg.add_extension(cls.__module__, cls.__qualname__, code)
    return cls


class Compact:
    """A record pickled as its class and its field values in order, without the field names:
    the messages that cross between the planes every epoch stay a few dozen bytes."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), tuple(getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]


def box_text(value: str, lo: Sequence[int], hi: Sequence[int]) -> str:
    """``Vid[0..3, 5, 2..9]``: the box of cells from ``lo`` to ``hi`` (inclusive) per axis."""
    return f"{value}[" + ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in zip(lo, hi)) + "]"


@dataclass(frozen=True, slots=True)
class Box(Compact):
    """A box of a value's cells (a trace summary's ``blocked_where``), kept as numbers until it
    is written, so that the boxes of several owners merge."""

    value: str
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    def union(self, other: Box | None) -> Box:
        if other is None:
            return self
        return Box(
            self.value,
            tuple(map(min, self.lo, other.lo)),
            tuple(map(max, self.hi, other.hi)),
        )

    def text(self) -> str:
        return box_text(self.value, self.lo, self.hi)


@dataclass(frozen=True, slots=True)
class LogShare(Compact):
    """What a group's owners leave to the control plane's log of one epoch when they write the
    per-cell rows (commits, trace cells and candidates) into their own stores: the counts the
    ``epochs`` row needs and the ``trace_summary`` rows (``(epoch, constraint, rule, checked,
    violations, won, lost, where)``, ``where`` a :class:`Box` or None)."""

    candidates: int = 0
    decided: int = 0
    summary: tuple[tuple[Any, ...], ...] = ()
    checksum: int | None = None  # committed_sum of the owner's records (None: not asked for)


def merge_logs(shares: Sequence[LogShare]) -> LogShare:
    """Several owners' shares of one epoch as one owner's: counts summed, summary rows of the
    same (epoch, constraint, rule) summed, their boxes united."""
    rows: dict[tuple[int, int, int], list[Any]] = {}
    for share in shares:
        for e, cid, rule, checked, viol, won, lost, where in share.summary:
            got = rows.get((e, cid, rule))
            if got is None:
                rows[(e, cid, rule)] = [checked, viol, won, lost, where]
                continue
            got[0] += checked
            got[1] += viol
            got[2] += won
            got[3] += lost
            got[4] = where.union(got[4]) if where is not None else got[4]
    sums = [s.checksum for s in shares if s.checksum is not None]
    return LogShare(
        sum(s.candidates for s in shares),
        sum(s.decided for s in shares),
        tuple((*k, *v) for k, v in sorted(rows.items())),
        wrap64(sum(sums)) if sums else None,
    )


def wrap64(n: int) -> int:
    """``n`` as a signed 64-bit integer (two's complement): sums of checksums wrap like int64."""
    n &= (1 << 64) - 1
    return n - (1 << 64) if n >= 1 << 63 else n


def committed_sum(values: Sequence[ValueEpoch]) -> int | None:
    """The sum (int64, wrapping) of the payload checksums of the cells committed in ``values``
    (the epochs table's ``checksum``: the same for any number of workers); None when the records
    carry no checksums."""
    # (NumPy on the host copies: a tensor's boolean index and sum cost tens of µs an epoch)
    import numpy as np

    sums = [
        int(ve.checksum.cpu().numpy()[ve.changed.cpu().numpy()].sum(dtype=np.int64))
        for ve in values
        if ve.checksum is not None
    ]
    if not sums:
        return None
    return wrap64(sum(sums))


@dataclass(frozen=True, slots=True)
class Dissent(Compact):
    """A quorum replica outvoted in one epoch: in ``cells`` committed cells of ``value`` its
    proposal (the winning rule's, same proposal slot) differed from the payload committed."""

    value: str
    replica: int
    worker: str  # the worker that ran the replica ("owners": each cell's owner)
    cells: int

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "replica": self.replica,
            "worker": self.worker,
            "cells": self.cells,
        }


@dataclass
class EpochRecord:
    epoch: int
    values: list[ValueEpoch]
    open_cells: int
    commits: int
    attempts: int
    violations: int
    seconds: float
    model_seconds: float
    message_bytes: int = 0  # tensor bytes exchanged with the workers (metadata only)
    halo_bytes: int = 0  # payload bytes moved worker to worker (partitioned workers; 0 for one)
    # bytes into and out of the control plane, every message serialised as it crosses a process
    # boundary (lmpm.runtime.protocol.wire_bytes); one in-process worker: 0 unless it counts them
    control_bytes: int = 0
    driver_cpu_s: float = 0.0  # the control plane's process CPU time in the epoch
    # worker faults survived while running this epoch (lmpm.runtime.data.raygroup.Fault): the epoch
    # was redone after each
    faults: tuple[Any, ...] = ()
    # quorum replicas outvoted in this epoch's commits, per value and replica
    dissent: tuple[Dissent, ...] = ()
    # the workers acknowledged this epoch's commits as durable (EpochReport.durable)
    durable: bool = True
    # the owners wrote this epoch's per-cell log rows into their stores; what is left for the
    # control plane's log (None: the control plane writes the rows from ``values``)
    log: LogShare | None = None


@dataclass(frozen=True, slots=True)
class StopReason:
    """Why a run ended, and why the cells left unset are unset.

    ``kind``: ``"stable"`` (:meth:`Engine.is_stable`: a full schedule cycle without a commit,
    after every epoch-guarded trigger has settled) or ``"epochs"`` (the epoch limit came first).
    ``unset``: per value, unset cell counts by reason, as of the last epoch that opened the cell
    (:func:`lmpm.runtime.control.engine.why_text` words them): ``"never opened by the
    schedule"``, ``"no rule fires there"``, ``"no candidate beat leaving it unset"``, ``"held
    back by the schedule's quota ..."`` (confidence), ``"the quorum's replicas disagreed ..."``,
    ``"no rule proposes it and no input gave it"``, ``"not attempted since the resume"``, or
    ``"every candidate violates `Name`"`` (the highest-priority constraint that blocked the
    cell's proposals)."""

    kind: str
    epoch: int  # epochs complete when the run ended
    unset: dict[str, dict[str, int]]
    # per value, committed cells whose payload violates a live constraint, by constraint name
    # (as of the last epoch that opened each cell)
    broken: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total_unset(self) -> int:
        return sum(sum(v.values()) for v in self.unset.values())

    @property
    def total_broken(self) -> int:
        """Committed cells that violate some live constraint (a cell counted once per value and
        constraint it breaks)."""
        return sum(sum(v.values()) for v in self.broken.values())

    def message(self, detail: bool = True) -> str:
        """One line for people: "stable, every cell set" / "stable with 3 unset cells (A: 3 no
        rule fires there)", then how many committed cells break which constraint ("; 2
        committed cells break `Plain` (Txt)"); ``detail=False`` leaves out the unset cells'
        reasons."""
        head = {"stable": "stable", "epochs": "epoch limit reached"}.get(self.kind, self.kind)
        n = self.total_unset
        if not n:
            text = f"{head}, every cell set"
        elif not detail:
            text = f"{head} with {n} unset cell{'s' if n != 1 else ''}"
        else:
            parts = [
                f"{name}: " + ", ".join(f"{c} {why}" for why, c in reasons.items())
                for name, reasons in self.unset.items()
            ]
            text = f"{head} with {n} unset cell{'s' if n != 1 else ''} ({'; '.join(parts)})"
        return text + self.broken_text()

    def broken_text(self) -> str:
        """ "; 2 committed cells break `Plain` (Txt)", or "" when none does."""
        parts = [
            f"{c} committed cell{'s' if c != 1 else ''} break{'' if c != 1 else 's'} `{cname}` "
            f"({name})"
            for name, by in self.broken.items()
            for cname, c in by.items()
        ]
        return "; " + ", ".join(parts) if parts else ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self.epoch, "unset": self.unset, "broken": self.broken}


@dataclass
class RunResult:
    epochs: int
    stable: bool
    commits: int
    attempts: int
    seconds: float
    model_seconds: float
    records: list[EpochRecord] = field(default_factory=list)
    stop: StopReason | None = None


# the records that cross between the planes every epoch (protocol.py registers its messages)
wire_code(Box, 240)
wire_code(LogShare, 241)
wire_code(Dissent, 242)
