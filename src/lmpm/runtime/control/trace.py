"""The constraint-level trace: what every constraint did to every proposal, in the run's database.

Recording (:class:`Tracer`, fed each epoch by the commit log, written in the epoch's transaction):

- ``summary`` — per epoch × constraint × rule (``rule = -1`` is the keep-current candidate):
  candidates *checked* (valid candidates of that rule in cells the constraint speaks about),
  *violations* (those that violate it), and decisions *lost* / *won* because of it (below), with the
  bounding box of the cells where it decided (``Vid[0..3, 0..63, 0..15]``).
  Computed from the epoch's metadata alone (validity, scores, column rules, violation bits,
  coverage, winners), never from a payload.
- ``cells`` — additionally, per cell and attempt in a region (default: every cell): its candidates
  (payload, score, rule, a bitmask of the constraints each violates), the constraints covering the
  cell, the score favourite, the winner, whether it committed and the clock after the epoch.

**Decided by a constraint.** In each cell's agreement, the *score favourite* is the candidate that
would win on score alone (highest score among valid candidates; ties to the lowest column, so
keep-current). The satisfy policy narrows the candidates priority level by level (most satisfied
constraints first); the favourite is eliminated at one level or never. When the winner is not the
favourite and the favourite was eliminated at level *p*, the decision was *decided* at *p*; every
constraint of priority *p* that the favourite violates and the winner satisfies is *responsible*:
the favourite's rule **lost** a decision because of it, and the winner's rule **won** one because of
it. A decision counts once per responsible constraint. Under policies other than satisfy, the same
definition is applied to whatever winner the policy chose (a winner that violates the constraint
never makes it responsible). A `hard` constraint goes first: a favourite that is a proposal
violating one was never eligible, and the highest-priority hard constraints it violates are
responsible, whatever the winner (keep-current, eligible even when it breaks them, included); else
the levels narrow the eligible candidates only.

Reading (:func:`report`, :func:`cell_story`) needs no torch: ``lmpm trace`` starts instantly.
"""

from __future__ import annotations

import io
import json
import re
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lmpm.errors import UsageError
from lmpm.runtime.records import Box, OneCell, box_text  # torch-free, as the run directory format
from lmpm.runtime.rundir import (  # the torch-free run directory format: `lmpm trace` stays fast
    EPOCH_COLUMNS,
    checkpoint_shards,
    completed_epochs,
    decode,
    epoch_rows,
    load_checkpoint,
    quorum_dissent,
    read_candidates,
    read_cell_payload,
    read_meta,
    ruleset_events,
    worker_faults,
)
from lmpm.runtime.runfiles import atomic_write
from lmpm.runtime.vocab import Vocabulary, run_texts, run_vocabularies  # torch-free

if TYPE_CHECKING:
    from torch import Tensor

    from lmpm.ir.nodes import Program
    from lmpm.resolve.plan import Plan
    from lmpm.runtime.control.engine import Engine
    from lmpm.runtime.records import EpochRecord, ValueEpoch

LEVELS = ("off", "summary", "cells")
DEFAULT_LEVEL = "summary"
# the epochs table's columns in `lmpm trace --json` (the counted costs are None in a schema-2 run)
EPOCH_FIELDS = tuple(c for c in EPOCH_COLUMNS if c not in ("model_seconds", "maskplan", "at"))
MAX_CELL_CONSTRAINTS = 63  # cells level: violations are an int64 bitmask over constraint ids
# Candidates per cell above which a pass reduces along the candidates in one NumPy call (a loop
# over a few columns is faster for many cells and few candidates; one call per epoch for k = V)
WIDE = 64
FEW = 8  # ... and open cells at or below which the one-call reduction is the cheaper too
# Candidates × constraints of a one-cell epoch up to which its summary is counted from Python
# lists (a decode with k up to a few hundred; k = V goes through the NumPy passes)
ONE_CELL = 1024


# ---- regions: `Vid[0, 0..15, *]` ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Region:
    """A box of cells of one value: an inclusive ``(lo, hi)`` per axis."""

    value: str
    box: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        return box_text(self.value, [lo for lo, _ in self.box], [hi for _, hi in self.box])

    @property
    def is_cell(self) -> bool:
        return all(lo == hi for lo, hi in self.box)

    def mask(self, dims: Sequence[int]) -> np.ndarray:
        """(ncells,) bool over the value's cells (row-major ids)."""
        m = np.zeros(tuple(dims), dtype=bool)
        m[tuple(slice(lo, hi + 1) for lo, hi in self.box)] = True
        return m.reshape(-1)

    def flat(self, dims: Sequence[int]) -> int:
        """The flat id of a single-cell region."""
        return int(np.ravel_multi_index(tuple(lo for lo, _ in self.box), tuple(dims)))


_REGION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\[(.*)\])?\s*$")
_AXIS = re.compile(r"^\s*(?:(\*)|(\d+)\s*(?:\.\.\s*(\d+))?)\s*$")


def parse_region(text: str, dims: Mapping[str, Sequence[int]]) -> Region:
    """``Vid[0, 0..15, 0..15]``, ``Vid[3, 10, 12]``, ``Txt[0..9]``, ``Vid[*, 0..7, *]``, ``Vid``.

    >>> str(parse_region("Vid[0, 0..15, *]", {"Vid": (4, 32, 32)}))
    'Vid[0, 0..15, 0..31]'
    """
    m = _REGION.match(text)
    if m is None:
        raise UsageError(
            f"cannot read the region {text!r}",
            code="U031",
            hint="write VALUE[i, a..b, *], e.g. Vid[0, 0..15, 0..15]",
        )
    name, inner = m.group(1), m.group(2)
    if name not in dims:
        raise UsageError(
            f"region {text!r}: there is no value `{name}` with cells",
            code="U031",
            hint="values: " + ", ".join(dims),
        )
    shape = tuple(int(d) for d in dims[name])
    parts = [] if inner is None else [p for p in inner.split(",")]
    if inner is not None and len(parts) == 1 and parts[0].strip() == "*":
        parts = []  # `Vid[*]`: the whole value, as in `commit Vid[*]`
    if parts and len(parts) != len(shape):
        raise UsageError(
            f"region {text!r} has {len(parts)} indices; `{name}` has {len(shape)} axes "
            f"(shape {list(shape)})",
            code="U031",
        )
    box: list[tuple[int, int]] = []
    for k, d in enumerate(shape):
        if not parts:
            box.append((0, d - 1))
            continue
        a = _AXIS.match(parts[k])
        if a is None:
            raise UsageError(
                f"region {text!r}: axis {k} is {parts[k].strip()!r}; use an index, a..b or *",
                code="U031",
            )
        if a.group(1):
            lo, hi = 0, d - 1
        else:
            lo = int(a.group(2))
            hi = int(a.group(3)) if a.group(3) is not None else lo
        if not 0 <= lo <= hi < d:
            raise UsageError(
                f"region {text!r}: axis {k} selects {lo}..{hi}, outside 0..{d - 1} "
                f"(`{name}` has shape {list(shape)})",
                code="U031",
            )
        box.append((lo, hi))
    return Region(name, tuple(box))


def epoch_ranges(epochs: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` → ``'0..2, 5, 7..8'``."""
    out: list[str] = []
    es = sorted(set(epochs))
    i = 0
    while i < len(es):
        j = i
        while j + 1 < len(es) and es[j + 1] == es[j] + 1:
            j += 1
        out.append(str(es[i]) if i == j else f"{es[i]}..{es[j]}")
        i = j + 1
    return ", ".join(out)


# ---- recording ------------------------------------------------------------------------------------
@dataclass
class TraceRows:
    """One epoch's trace rows, inserted inside the epoch's transaction."""

    summary: list[tuple[Any, ...]] = field(default_factory=list)
    cells: list[tuple[Any, ...]] = field(default_factory=list)
    candidates: list[tuple[Any, ...]] = field(default_factory=list)
    decided: int = 0  # decisions decided by a constraint

    def summary_rows(self) -> list[tuple[Any, ...]]:
        """The ``trace_summary`` rows as written (``blocked_where`` as text)."""
        return [(*r[:7], r[7].text() if isinstance(r[7], Box) else r[7]) for r in self.summary]

    def insert(self, conn: sqlite3.Connection) -> None:
        if self.summary:
            conn.executemany(
                "INSERT INTO trace_summary VALUES (?,?,?,?,?,?,?,?)", self.summary_rows()
            )
        if self.cells:
            conn.executemany(
                "INSERT INTO trace_cells VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", self.cells
            )
        if self.candidates:
            conn.executemany(
                "INSERT INTO trace_candidates VALUES (?,?,?,?,?,?,?,?)", self.candidates
            )


_NONE = np.iinfo(np.int64).min  # "the favourite was never eliminated"


@dataclass(frozen=True, slots=True)
class _Constraints:
    """A value's evaluated constraints as the summary needs them (fixed by the plan, built once)."""

    ids: tuple[int, ...]  # (K,) ids into plan.constraints, in the epoch's column order
    priority: np.ndarray  # (K,) int64
    hard: np.ndarray  # (K,) bool: the `hard` constraints
    # The satisfy policy's levels, highest priority first: (priority, indices into the K axis).
    levels: tuple[tuple[int, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class _Decisions:
    """One value's epoch as the summary counts it (host NumPy arrays)."""

    valid_t: np.ndarray  # (C, n) bool: valid candidates, candidate-major
    violated: np.ndarray  # (n, C, K) bool
    fav: np.ndarray  # (n,) the score favourite's column
    winner: np.ndarray  # (n,) the winner's column
    sub: np.ndarray  # (m,) the cells whose winner is not the favourite
    resp: np.ndarray  # (m, K) bool: the constraints responsible for those decisions


@dataclass(frozen=True, slots=True)
class _Layout:
    """The candidate columns grouped by the rule that proposed them."""

    rules: list[int]  # (R,) the rules' ids, sorted (-1: keep-current)
    col_r: np.ndarray  # (C,) each column's index into ``rules``
    starts: np.ndarray  # where each run of one rule's columns starts
    run_rule: list[int]  # each run's index into ``rules``

    def by_rule(self, per_col: np.ndarray) -> list[int]:
        """(C,) per-column counts summed per rule, (R,)."""
        nr = len(self.rules)
        # each rule's columns are one run in practice (keep-current, then each rule's proposals):
        # sum the runs (np.add.reduceat, a pass over C); else weigh the columns by rule
        if len(self.starts) != nr:
            return [int(x) for x in np.bincount(self.col_r, weights=per_col, minlength=nr)]
        out = [0] * nr
        for r, x in zip(self.run_rule, np.add.reduceat(per_col, self.starts).tolist()):
            out[r] = int(x)
        return out


def _checked_and_violations(
    layout: _Layout, applies: np.ndarray, d: _Decisions, nk: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(R, K) per rule: valid candidates in the cells each constraint covers (``applies``,
    (n, K)), and those that violate it (a few NumPy passes per rule, whatever the number of
    candidates)."""
    nr = len(layout.rules)
    # (a bool array's sum is its count: one ufunc call, without count_nonzero's Python wrapper)
    viol_kc = np.ascontiguousarray(d.violated.sum(axis=0).T)  # (K, C)
    viol_rk = [layout.by_rule(viol_kc[k]) for k in range(nk)]  # (K, R)
    if applies.all():  # every constraint covers every open cell (the common case)
        per_rule = layout.by_rule(d.valid_t.sum(axis=1))
        checked = [[c] * nk for c in per_rule]
    else:
        checked_kc = applies.T.astype(np.int64) @ d.valid_t.T.astype(np.int64)  # (K, C)
        checked_rk = [layout.by_rule(checked_kc[k]) for k in range(nk)]
        checked = [[checked_rk[k][r] for k in range(nk)] for r in range(nr)]
    viol = [[viol_rk[k][r] for k in range(nk)] for r in range(nr)]
    return checked, viol


def favourite(valid: np.ndarray, score: np.ndarray) -> np.ndarray:
    """(n,) the score favourite of each cell: the highest score among valid candidates, ties to the
    lowest column (0, keep-current, when no candidate is valid or a valid score is NaN).

    ``valid`` is (C, n) and ``score`` (C, n) or its transpose's view: candidates along the first
    axis, so every step is one vectorized pass over the cells (NumPy reduces slowly along a short
    trailing axis).

    >>> favourite(np.array([[True, True], [True, False]]), np.array([[0.0, 1.0], [2.0, 5.0]]))
    array([1, 0])
    """
    s = np.where(valid, score, -np.inf)  # (C, n)
    # many candidates (k in the thousands), or few cells (a decode's one open cell: a handful of
    # NumPy calls, not three per column): reduce along the candidates at once
    if s.shape[0] > WIDE or s.shape[1] <= FEW:
        top = s.max(axis=0)  # NaN propagates: then no column hits
        hits = (s == top) & valid
        return np.where(hits.any(axis=0), hits.argmax(axis=0), 0).astype(np.int64)
    best = s[0].copy()
    for c in range(1, s.shape[0]):
        np.maximum(best, s[c], out=best)  # NaN propagates, as in a max: then no column hits
    fav = np.zeros(best.shape[0], dtype=np.int64)
    for c in range(s.shape[0] - 1, -1, -1):  # the lowest column among the hits is written last
        hit = s[c] == best
        hit &= valid[c]
        fav[hit] = c
    return fav


def attribute(
    valid: np.ndarray,
    violated: np.ndarray,
    priority: np.ndarray,
    levels: Sequence[tuple[int, Sequence[int]]],
    fav: np.ndarray,
    winner: np.ndarray,
    hard: np.ndarray | None = None,
) -> np.ndarray:
    """(m, K) bool: the constraints responsible for each decision (see the module docstring).

    Arguments are the m cells whose winner is not the score favourite (the only ones a constraint
    can have decided; usually few): ``valid`` (m, C), ``violated`` (m, C, K), their favourite and
    winner (m,); ``priority`` (K,), ``levels`` and ``hard`` (K,) bool as in :class:`_Constraints`.

    A favourite that breaks a `hard` constraint (a proposal: keep-current is always eligible) was
    excluded by it: the highest-priority hard constraints it violates are responsible, whatever
    the winner (keep-current may violate them too). Otherwise the satisfy levels narrow the
    eligible candidates (a proposal breaking a hard constraint is not) as the policy does.
    """
    m = valid.shape[0]
    rows = np.arange(m)
    fav_viol = violated[rows, fav]  # (m, K)
    eligible = valid
    excluded = np.zeros((m, priority.shape[0]), dtype=bool)
    if hard is not None and hard.any():
        out = (violated & hard).any(axis=2)  # (m, C): proposals a hard constraint rules out
        out[:, 0] = False
        eligible = valid & ~out
        broke = fav_viol & hard & (fav != 0)[:, None]  # (m, K)
        top = np.where(broke, priority[None, :], np.iinfo(np.int64).min).max(axis=1)  # (m,)
        excluded = broke & (priority[None, :] == top[:, None])
    elim = np.full(m, _NONE, dtype=np.int64)  # the level the favourite fell at
    for prio, ks in levels:
        count = (~violated[:, :, ks[0]]).astype(np.int64)  # (m, C) satisfied at this level
        for k in ks[1:]:
            count += ~violated[:, :, k]
        count[~eligible] = -1
        if count.shape[1] > WIDE:
            most = count.max(axis=1)
        else:
            most = count[:, 0].copy()
            for c in range(1, count.shape[1]):  # (NumPy reduces slowly along the short axis)
                np.maximum(most, count[:, c], out=most)
        narrowed = eligible & (count == most[:, None])
        gone = eligible[rows, fav] & ~narrowed[rows, fav]
        elim[gone] = prio
        eligible = narrowed
    by_level = (
        (elim != _NONE)[:, None]
        & (priority[None, :] == elim[:, None])
        & fav_viol
        & ~violated[rows, winner]
    )
    gone_by_hard = np.any(excluded, axis=1, keepdims=True)  # (m, 1)
    return np.where(gone_by_hard, excluded, by_level)


def favourite_of_one(valid: Sequence[bool], score: Sequence[float]) -> int:
    """:func:`favourite` of one cell from Python lists (its C candidates' validity and scores):
    the lowest valid column with the highest score; 0 when none is valid or a valid score is NaN.

    >>> favourite_of_one([True, True, False], [0.5, 2.0, 9.0])
    1
    """
    scores = [s for ok, s in zip(valid, score) if ok]
    if not scores or any(s != s for s in scores):  # (NaN is not equal to itself)
        return 0
    top = max(scores)
    return next(c for c, (ok, s) in enumerate(zip(valid, score)) if ok and s == top)


def _one_cell_summary(
    ve: ValueEpoch,
    one: OneCell,
    e: int,
    static: _Constraints,
    layout_of: Callable[[Tensor], _Layout],
    out: TraceRows,
) -> bool:
    """The summary rows of ``ve``, an epoch of one open cell (``one``: its numbers) whose winner
    is its score favourite (a decode's usual epoch: no constraint decided it), appended to ``out``
    from Python lists: the rows :meth:`Tracer._summary` writes (the tests hold them equal),
    without its few dozen NumPy calls on arrays of a handful of elements. False (nothing
    appended) for any other epoch: more than :data:`ONE_CELL` candidate verdicts, or a cell a
    constraint may have decided."""
    k = len(static.ids)
    if len(one.valid) * max(k, 1) > ONE_CELL:
        return False
    ok = one.valid  # (C,)
    if favourite_of_one(ok, one.score) != one.winner and not one.disagreed:
        return False  # a constraint may have decided it: the general path attributes it
    layout = layout_of(ve.col_rule)
    nr = len(layout.rules)
    violated = one.violated  # (C, K)
    valid_r = [0] * nr  # valid candidates per rule
    viol_rk = [[0] * k for _ in range(nr)]  # (R, K) candidates violating each constraint
    for col, r in enumerate(layout.col_r.tolist()):
        valid_r[r] += ok[col]
        row = viol_rk[r]
        for j, v in enumerate(violated[col]):
            row[j] += v
    applies = one.applies  # (K,)
    for r, rule in enumerate(layout.rules):
        for j, cid in enumerate(static.ids):
            if applies[j] and valid_r[r]:
                out.summary.append((e, cid, rule, valid_r[r], viol_rk[r][j], 0, 0, None))
    return True


class Tracer:
    """Turns each epoch's :class:`~lmpm.runtime.records.EpochRecord` into trace rows.

    The summary reads only the epoch's metadata (validity, scores, column rules, violations,
    coverage, winners, cells), never a payload: it stays on the control plane's side of the
    runtime. Its cost is a few vectorized passes over each value's open cells; the level-by-level
    attribution runs on the cells whose winner is not the score favourite alone.
    """

    def __init__(
        self, plan: Plan, level: str = DEFAULT_LEVEL, region: Region | None = None
    ) -> None:
        import torch

        if level not in LEVELS:
            raise UsageError(f"--trace {level}: use one of {', '.join(LEVELS)}", code="U032")
        self.level = level
        self.plan = plan
        self.seconds = 0.0  # time spent turning epochs into rows (the trace's cost, less SQLite)
        self._priority = {cp.id: cp.priority for cp in plan.constraints}
        self._hard = {cp.id: cp.ir.hard for cp in plan.constraints}
        self._constraints: dict[tuple[str, tuple[int, ...]], _Constraints] = {}
        self._coords: dict[str, np.ndarray] = {}  # (rank, ncells) per value, on first use
        # id(col_rule) -> (the tensor, its layout): see _layout
        self._layouts: dict[int, tuple[Tensor, _Layout]] = {}
        self._regions: dict[str, Tensor] = {}
        if region is not None:
            dims = plan.values[region.value].dims
            self._regions[region.value] = torch.from_numpy(region.mask(dims))
        self.region = region
        if level == "cells" and len(plan.constraints) > MAX_CELL_CONSTRAINTS:
            raise UsageError(
                f"--trace cells records violations as a bitmask of at most {MAX_CELL_CONSTRAINTS} "
                f"constraints; this program has {len(plan.constraints)}",
                code="U033",
                hint="use --trace summary",
            )

    def recorded_cells(self) -> dict[str, Tensor]:
        """The cells whose candidate payloads the worker records (``--trace cells``)."""
        import torch

        if self._regions:
            return {v: m.reshape(-1).nonzero().squeeze(1) for v, m in self._regions.items()}
        return {name: torch.arange(vp.ncells) for name, vp in self.plan.values.items()}

    def record(self, engine: Engine, record: EpochRecord) -> TraceRows:
        return self.rows(record.epoch, record.values)

    def rows(
        self,
        epoch: int,
        values: Sequence[ValueEpoch],
        ones: Sequence[OneCell | None] | None = None,
    ) -> TraceRows:
        """The trace rows of one epoch's records (one owner's, or every owner's merged);
        ``ones``: per value, its numbers when it had one open cell, where the caller read them
        already (:meth:`OneCell.of`)."""
        t0 = time.perf_counter()
        out = TraceRows()
        for i, ve in enumerate(values):
            self._value(ve, epoch, out, None if ones is None else ones[i])
        self.seconds += time.perf_counter() - t0
        return out

    def _static(self, ve: ValueEpoch) -> _Constraints:
        """The value's constraint table, built on its first epoch (the ids are fixed by the plan)."""
        ids = tuple(ve.constraint_ids.tolist())
        key = (ve.value, ids)
        found = self._constraints.get(key)
        if found is None:
            prio = [self._priority[i] for i in ids]
            levels = tuple(
                (p, tuple(k for k, q in enumerate(prio) if q == p))
                for p in sorted(set(prio), reverse=True)
            )
            hard = np.array([self._hard[i] for i in ids], dtype=bool)
            found = _Constraints(ids, np.array(prio, dtype=np.int64), hard, levels)
            self._constraints[key] = found
        return found

    def _value(self, ve: ValueEpoch, e: int, out: TraceRows, one: OneCell | None) -> None:
        static = self._static(ve)
        ids = static.ids
        if not ids and self.level != "cells":
            return  # nothing to count, nothing decided by a constraint
        if self.level != "cells":
            one = one if one is not None else OneCell.of(ve)
            if one is not None and _one_cell_summary(ve, one, e, static, self._layout, out):
                return  # one open cell its favourite won (a decode's epoch): counted from lists
        valid = ve.valid.cpu().numpy()  # (n, C)
        violated = ve.violated.cpu().numpy()  # (n, C, K)
        winner = ve.winner.cpu().numpy()  # (n,)
        valid_t = np.ascontiguousarray(valid.T)  # (C, n): per-candidate passes are contiguous
        fav = favourite(valid_t, ve.score.cpu().numpy().T)
        lost = winner != fav
        if ve.disagreed is not None:  # a quorum that found no agreeing payload decided those
            lost &= ~ve.disagreed.cpu().numpy()
        sub = lost.nonzero()[0]  # the only cells a constraint can have decided
        if sub.size:
            resp = attribute(
                valid[sub],
                violated[sub],
                static.priority,
                static.levels,
                fav[sub],
                winner[sub],
                static.hard,
            )  # (m, K)
            out.decided += int(np.count_nonzero(resp.any(axis=1)))
        else:  # every winner is its cell's favourite (a decode's usual epoch): nothing decided
            resp = np.zeros((0, len(ids)), dtype=bool)
        if ids:
            self._summary(ve, e, static, _Decisions(valid_t, violated, fav, winner, sub, resp), out)
        if self.level == "cells":
            import torch

            full = np.zeros((valid.shape[0], len(ids)), dtype=bool)
            full[sub] = resp
            self._cells(ve, e, torch.from_numpy(fav), torch.from_numpy(full), out)

    def _layout(self, col_rule: Tensor) -> _Layout:
        """The candidate columns' layout by rule (:class:`_Layout`). A worker hands the same
        ``col_rule`` tensor for the same layout every epoch: worked out once per tensor (k = V
        columns would otherwise cost passes over them every epoch)."""
        hit = self._layouts.get(id(col_rule))
        if hit is not None and hit[0] is col_rule:
            return hit[1]
        cols = col_rule.cpu().numpy()
        rule_ids = np.flatnonzero(np.bincount(cols + 1)) - 1  # sorted (-1: keep-current)
        col_r = np.searchsorted(rule_ids, cols).astype(np.int64)  # (C,) rule index
        starts = np.flatnonzero(np.diff(col_r, prepend=-1))
        out = _Layout(rule_ids.tolist(), col_r, starts, col_r[starts].tolist())
        if len(self._layouts) > 64:  # (layouts change with the rules that fire: keep a few)
            self._layouts.clear()
        self._layouts[id(col_rule)] = (col_rule, out)
        return out

    def _summary(
        self, ve: ValueEpoch, e: int, static: _Constraints, d: _Decisions, out: TraceRows
    ) -> None:
        """Rows per constraint × rule, from per-column counts ((C, K): a handful of numbers)."""
        ids = static.ids
        layout = self._layout(ve.col_rule)
        checked, viol = _checked_and_violations(layout, ve.applies.cpu().numpy(), d, len(ids))
        fr, wr = layout.col_r[d.fav[d.sub]], layout.col_r[d.winner[d.sub]]  # (m,) rule indices
        # (K, R): decisions won by the winner's rule / lost by the favourite's, per constraint
        won = [
            np.bincount(wr[d.resp[:, k]], minlength=len(layout.rules)).tolist()
            for k in range(len(ids))
        ]
        lost = [
            np.bincount(fr[d.resp[:, k]], minlength=len(layout.rules)).tolist()
            for k in range(len(ids))
        ]
        cells = ve.cells.cpu().numpy()
        coords = self._value_coords(ve.value)
        for r, rule in enumerate(layout.rules):
            for k, cid in enumerate(ids):
                if checked[r][k] == 0:
                    continue
                where = None
                if lost[k][r]:
                    sel = coords[:, cells[d.sub[d.resp[:, k] & (fr == r)]]]  # (rank, cells)
                    lo, hi = sel.min(axis=1).tolist(), sel.max(axis=1).tolist()
                    where = Box(ve.value, tuple(lo), tuple(hi))
                out.summary.append(
                    (e, cid, rule, checked[r][k], viol[r][k], won[k][r], lost[k][r], where)
                )

    def _value_coords(self, value: str) -> np.ndarray:
        """(rank, ncells) the value's cell coordinates, on first use: a box's bounds reduce along
        contiguous rows."""
        coords = self._coords.get(value)
        if coords is None:
            coords = np.ascontiguousarray(self.plan.values[value].coords.numpy().T)
            self._coords[value] = coords
        return coords

    def _cells(self, ve: ValueEpoch, e: int, fav: Tensor, resp: Tensor, out: TraceRows) -> None:
        import torch

        region = self._regions.get(ve.value)
        if self.region is not None and region is None:
            return  # the traced region is another value
        cells = ve.cells.cpu()
        rows = torch.arange(cells.numel()) if region is None else region[cells].nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        ids = ve.constraint_ids.tolist()
        bit = torch.tensor([1 << i for i in ids], dtype=torch.int64)
        valid = ve.valid.cpu()[rows]
        violated = ve.violated.cpu()[rows]
        covered = (ve.applies.cpu()[rows].long() * bit).sum(dim=1)  # (m,)
        vbits = (violated.long() * bit).sum(dim=2)  # (m, C)
        col_rule = ve.col_rule.cpu()
        winner = ve.winner.cpu()[rows]
        changed = ve.changed.cpu()[rows]
        was = ve.was_committed.cpu()[rows]
        score = ve.score.cpu()[rows]
        # payloads stay with the worker (its store records this region's candidates): the story
        # reader joins them in (lmpm.runtime.data.store)
        coords = self.plan.values[ve.value].coords[cells[rows]]
        decided = resp[rows]
        cell_ids = cells[rows].tolist()
        for i, (cell, crd, nc, w, f, ch, _wa, clk, cov, dec) in enumerate(
            zip(
                cell_ids,
                coords.tolist(),
                valid.sum(dim=1).tolist(),
                winner.tolist(),
                fav[rows].tolist(),
                changed.tolist(),
                was.tolist(),
                ve.new_clock.cpu()[rows].tolist(),
                covered.tolist(),
                decided.tolist(),
            )
        ):
            by = [cid for cid, d in zip(ids, dec) if d]
            out.cells.append(
                (
                    e,
                    ve.value,
                    cell,
                    ",".join(map(str, crd)),
                    nc,
                    w,
                    int(col_rule[w]),
                    f,
                    int(ch),
                    None,
                    clk,
                    cov,
                    json.dumps(by) if by else None,
                )
            )
            vrow, srow, ok = vbits[i].tolist(), score[i].tolist(), valid[i]
            for c in ok.nonzero().squeeze(1).tolist():
                s = srow[c]
                out.candidates.append(
                    (
                        e,
                        ve.value,
                        cell,
                        c,
                        int(col_rule[c]),
                        None,
                        s if np.isfinite(s) else None,
                        vrow[c],
                    )
                )


# ---- reading --------------------------------------------------------------------------------------
def _dims(conn: sqlite3.Connection) -> dict[str, list[int]]:
    return {name: json.loads(d) for name, d in conn.execute("SELECT name, dims FROM value_defs")}


def _rule_names(conn: sqlite3.Connection) -> dict[int, str]:
    return {int(i): str(n) for i, n in conn.execute("SELECT id, name FROM rule_defs")}


def _union(boxes: Sequence[str]) -> str | None:
    """Bounding box of ``Vid[a..b, c, ...]`` boxes (all of one value)."""
    lo: list[int] | None = None
    hi: list[int] | None = None
    value = ""
    for b in boxes:
        value, inner = b.split("[", 1)
        ax = [p.strip().split("..") for p in inner.rstrip("]").split(",")]
        blo = [int(a[0]) for a in ax]
        bhi = [int(a[-1]) for a in ax]
        lo = blo if lo is None else [min(x, y) for x, y in zip(lo, blo)]
        hi = bhi if hi is None else [max(x, y) for x, y in zip(hi, bhi)]
    return None if lo is None or hi is None else box_text(value, lo, hi)


def report(conn: sqlite3.Connection, run_dir: str | Path = "") -> dict[str, Any]:
    """The whole trace of a run as plain data (what ``lmpm trace --json`` prints)."""
    meta = read_meta(conn)
    epochs = epoch_rows(conn, EPOCH_FIELDS)
    constraints = _constraint_totals(conn)
    names = {c["id"]: c["name"] for c in constraints}
    traced = meta.get("trace", "off") != "off"
    return {
        "run": _run_summary(conn, meta, run_dir, epochs, traced),
        "constraints": constraints,
        "blocked": _blocked(conn, names, _rule_names(conn)),
        "never_fired": [
            c["name"]
            for c in constraints
            if traced and c["status"] == "evaluated" and c["violations"] == 0
        ],
        "proved": [c["name"] for c in constraints if c["status"] == "proved"],
        "epochs": epochs,
        "violations_per_epoch": _violation_series(conn, constraints, epochs),
        "ruleset": ruleset_changes(conn),
        "faults": worker_faults(conn),
        "dissent": quorum_dissent(conn),
        # value -> its output as text, for a value of a tokenizer's vocabulary (--tokenizer)
        "texts": run_texts(run_dir, meta) if run_dir else {},
    }


def _run_summary(
    conn: sqlite3.Connection,
    meta: Mapping[str, Any],
    run_dir: str | Path,
    epochs: Sequence[Mapping[str, Any]],
    traced: bool,
) -> dict[str, Any]:
    """The report's ``run`` entry: the run's settings, status and totals over its epochs."""
    return {
        "dir": str(run_dir),
        "program": meta.get("program_file"),
        "program_hash": meta.get("program_hash"),
        "seed": meta.get("seed"),
        "params": meta.get("params"),
        "status": meta.get("status"),
        "error": meta.get("error"),  # why a failed run failed (None otherwise)
        # why the run stopped and why cells stayed unset (None: an older run, or still running)
        "stop": meta.get("stop"),
        "trace": meta.get("trace"),
        "trace_region": meta.get("trace_region"),
        "epochs": completed_epochs(conn),
        "commits": sum(int(ep["commits"]) for ep in epochs),
        "attempts": sum(int(ep["attempts"]) for ep in epochs),
        # commits no model attempt made: the VM's teacher-forced and tool tokens
        "unattempted": _unattempted(conn),
        "workers": int(meta.get("workers") or 1),  # --workers (the VM: one process)
        "decided": sum(int(ep["decided"] or 0) for ep in epochs) if traced else None,
    }


def _constraint_totals(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every constraint (highest priority first) with its totals over the run's trace."""
    totals = {
        int(r[0]): r[1:]
        for r in conn.execute(
            "SELECT constraint_id, sum(checked), sum(violations), sum(won), sum(lost), "
            "group_concat(CASE WHEN violations > 0 THEN epoch END) FROM trace_summary "
            "GROUP BY constraint_id"
        )
    }
    constraints = []
    for cid, name, value, kind, pred, prio, status, source, text, cells in conn.execute(
        "SELECT id, name, value, kind, pred, priority, status, source, text, cells "
        "FROM constraint_defs ORDER BY priority DESC, id"
    ):
        checked, viol, won, lost, fired = totals.get(cid, (0, 0, 0, 0, None))
        fired_epochs = sorted({int(x) for x in fired.split(",")}) if fired else []
        constraints.append(
            {
                "id": cid,
                "name": name,
                "value": value,
                "kind": kind,
                "pred": pred,
                "priority": prio,
                "status": status,
                "source": source,
                "text": text,
                "cells": cells,
                "checked": checked or 0,
                "violations": viol or 0,
                "won": won or 0,
                "lost": lost or 0,
                "fired_epochs": epoch_ranges(fired_epochs),
                "epochs_fired": len(fired_epochs),
            }
        )
    return constraints


def _blocked(
    conn: sqlite3.Connection, names: Mapping[int, str], rules: Mapping[int, str]
) -> list[dict[str, Any]]:
    """The decisions each constraint took from each rule, most first: where and when."""
    groups: dict[tuple[int, int], dict[str, Any]] = {}
    for cid, rule, e, lost, where in conn.execute(
        "SELECT constraint_id, rule, epoch, lost, blocked_where FROM trace_summary WHERE lost > 0 "
        "ORDER BY constraint_id, rule, epoch"
    ):
        g = groups.setdefault((cid, rule), {"epochs": [], "boxes": [], "lost": 0})
        g["epochs"].append(e)
        g["lost"] += lost
        if where:
            g["boxes"].append(where)
    return sorted(
        (
            {
                "constraint": names.get(cid, str(cid)),
                "rule": rules.get(rule, str(rule)),
                "decisions": g["lost"],
                "where": _union(g["boxes"]),
                "when": epoch_ranges(g["epochs"]),
            }
            for (cid, rule), g in groups.items()
        ),
        key=lambda b: -int(b["decisions"]),
    )


def _violation_series(
    conn: sqlite3.Connection,
    constraints: Sequence[Mapping[str, Any]],
    epochs: Sequence[Mapping[str, Any]],
) -> dict[str, list[int]]:
    """Each evaluated constraint's violations per logged epoch."""
    names = {c["id"]: c["name"] for c in constraints}
    series: dict[str, list[int]] = {
        c["name"]: [0] * len(epochs) for c in constraints if c["status"] == "evaluated"
    }
    index = {ep["epoch"]: i for i, ep in enumerate(epochs)}
    for cid, e, v in conn.execute(
        "SELECT constraint_id, epoch, sum(violations) FROM trace_summary GROUP BY constraint_id, epoch"
    ):
        if names.get(cid) in series and e in index:
            series[names[cid]][index[e]] = int(v)
    return series


def _unattempted(conn: sqlite3.Connection) -> int:
    """Committed cells no model proposed: the token-stream VM's forced and tool tokens (their
    rules have no model in ``rule_defs``)."""
    row = conn.execute(
        "SELECT sum(c.count) FROM commits c JOIN rule_defs r ON c.rule = r.id "
        "WHERE r.model IS NULL AND r.name IN ('forced', 'tool')"
    ).fetchone()
    return int(row[0] or 0)


def ruleset_changes(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The RuleSet's committed changes, one per event: the epoch it took effect, the constraint
    added or removed, by whom, and the active set from that epoch on (every constraint before the
    first event)."""
    events = ruleset_events(conn)
    if not events:
        return []
    names = [str(n) for (n,) in conn.execute("SELECT name FROM constraint_defs ORDER BY id")]
    active = set(names)
    out = []
    for epoch, op, name, clock, by in events:
        if op == "add":
            active.add(name)
        else:
            active.discard(name)
        out.append(
            {
                "epoch": epoch,
                "change": "added" if op == "add" else "removed",
                "constraint": name,
                "clock": clock,
                "by": by,
                "active": [n for n in names if n in active],
            }
        )
    return out


@dataclass(frozen=True, slots=True)
class _Cell:
    """The cell a story is about, and what reading its story needs from the run directory."""

    run_dir: Path
    value: str
    cell: int  # its flat id
    rules: Mapping[int, str]  # rule id -> name
    workers: tuple[str, ...]  # the worker shards whose stores hold payloads
    # the value's constraints, highest priority first: id, name, priority, kind, status
    constraints: list[dict[str, Any]]
    quorum: _Quorum | None  # the value's quorum policy, explained when replicas disagree
    vocab: Vocabulary | None  # a tokenizer's vocabulary: payloads get strings


def cell_story(conn: sqlite3.Connection, run_dir: str | Path, text: str) -> dict[str, Any]:
    """Every attempt on one cell: candidates, each constraint's verdict, the winner and why."""
    meta = read_meta(conn)
    dims = _dims(conn)
    region = parse_region(text, dims)
    if not region.is_cell:
        raise UsageError(
            f"--cell {text!r} names {region}, not one cell",
            code="U031",
            hint="give one index per axis, e.g. Vid[3, 10, 12]",
        )
    program = _stored_program(meta)
    at = _story_cell(conn, meta, Path(run_dir), region, program)
    # Payload lives in the workers' stores (lmpm.runtime.data.store); the log holds metadata.
    committed_payload: dict[int, Any] = {}
    for w in at.workers:
        committed_payload.update(
            {e: _val(a) for e, a in read_cell_payload(run_dir, w, at.value, at.cell).items()}
        )
    story: dict[str, Any] = {
        "cell": str(region),
        "value": at.value,
        "id": at.cell,
        "constraints": at.constraints,
        "start": _start_state(conn, at),
        "commits": _story_commits(conn, at, committed_payload),
        "attempts": [],
    }
    # a value no rule proposes has no attempts to trace (None: no IR to tell)
    story["proposed"] = (
        None if program is None else any(r.target == at.value for r in program.rules)
    )
    covered = meta.get("trace") == "cells"
    if covered and meta.get("trace_region"):
        traced = parse_region(str(meta["trace_region"]), dims)
        covered = traced.value == at.value and bool(traced.mask(dims[at.value])[at.cell])
    story["traced"] = covered
    if covered:
        start = story["start"]["payload"] if story["start"] else None
        after_of: dict[int, Any] = {}  # epoch -> the cell's payload after it
        current = start
        for e in range(completed_epochs(conn)):
            current = committed_payload.get(e, current)
            after_of[e] = current
        cands = _traced_candidates(conn, at, after_of, start)
        story["attempts"] = _attempts(conn, at, cands, after_of)
    if at.vocab is not None:
        story["vocabulary"] = at.vocab.name
        _with_tokens([story["start"], *story["commits"], *story["attempts"]], at.vocab)
    return story


def _story_cell(
    conn: sqlite3.Connection,
    meta: Mapping[str, Any],
    run_dir: Path,
    region: Region,
    program: Program | None,
) -> _Cell:
    """What the story of the one cell of ``region`` reads, gathered once."""
    value = region.value
    hard = {c.name for c in program.constraints if c.hard} if program is not None else set()
    cons = [
        {"id": i, "name": n, "priority": p, "kind": k, "status": s, "hard": n in hard}
        for i, n, p, k, s in conn.execute(
            "SELECT id, name, priority, kind, status FROM constraint_defs WHERE value = ? "
            "ORDER BY priority DESC, id",
            (value,),
        )
    ]
    return _Cell(
        run_dir=run_dir,
        value=value,
        cell=region.flat(_dims(conn)[value]),
        rules=_rule_names(conn),
        workers=tuple(checkpoint_shards(run_dir, _first_checkpoint(conn) or "")),
        constraints=cons,
        quorum=_quorum_of(program, value),
        vocab=run_vocabularies(run_dir, meta).get(value),
    )


def _start_state(conn: sqlite3.Connection, at: _Cell) -> dict[str, Any] | None:
    """The cell before epoch 0 (an input), from the first checkpoint; None when unset."""
    row = conn.execute("SELECT file, sha256 FROM checkpoints WHERE epoch = 0").fetchone()
    if row is None:
        return None
    arrays = load_checkpoint(at.run_dir, str(row[0]), str(row[1]))
    if not bool(arrays[f"{at.value}.committed"][at.cell]):
        return None
    return {
        "payload": _shard_payload(at.run_dir, str(row[0]), at.value, at.cell),
        "clock": int(arrays[f"{at.value}.clock"][at.cell]),
        "rule": at.rules.get(int(arrays[f"{at.value}.rule"][at.cell]), "input"),
    }


def _story_commits(
    conn: sqlite3.Connection, at: _Cell, payloads: Mapping[int, Any]
) -> list[dict[str, Any]]:
    """The cell's commits in epoch order (``payloads``: epoch -> the payload it committed)."""
    out = []
    for e, rule, first, step, cmin, clocks, smin, scores in conn.execute(
        "SELECT epoch, rule, first, step, clock_min, clocks, score_min, scores "
        "FROM commits WHERE value = ? AND first <= ? AND last >= ? AND (? - first) % step = 0 "
        "ORDER BY epoch",
        (at.value, at.cell, at.cell, at.cell),
    ):
        j = (at.cell - first) // step
        out.append(
            {
                "epoch": e,
                "rule": at.rules.get(rule, str(rule)),
                "payload": payloads.get(int(e)),
                "clock": int(cmin if clocks is None else cmin + int(decode(clocks)[j])),
                "score": float(smin if scores is None else decode(scores)[j]),
            }
        )
    return out


def _traced_candidates(
    conn: sqlite3.Connection, at: _Cell, after_of: Mapping[int, Any], start: Any
) -> dict[int, list[tuple[Any, ...]]]:
    """epoch -> the cell's candidates (col, rule, payload, score, violation bits); keep-current
    of a cell still unset has no payload."""
    cand_payload: dict[tuple[int, int], Any] = {}
    for w in at.workers:
        cand_payload.update(
            {k: _val(a) for k, a in read_candidates(at.run_dir, w, at.value, at.cell).items()}
        )
    cands: dict[int, list[tuple[Any, ...]]] = {}
    for r in conn.execute(
        "SELECT epoch, col, rule, score, violated FROM trace_candidates "
        "WHERE value = ? AND cell = ? ORDER BY epoch, col",
        (at.value, at.cell),
    ):
        e, col = int(r[0]), int(r[1])
        before = after_of.get(e - 1, start)
        pay = cand_payload.get((e, col)) if (col or before is not None) else None
        cands.setdefault(e, []).append((col, r[2], pay, r[3], r[4]))
    return cands


def _attempts(
    conn: sqlite3.Connection,
    at: _Cell,
    cands: Mapping[int, list[tuple[Any, ...]]],
    after_of: Mapping[int, Any],
) -> list[dict[str, Any]]:
    """Each traced attempt on the cell: its candidates with their verdicts, and why it went so."""
    by_id = {c["id"]: c for c in at.constraints}
    out = []
    for e, w, fav, committed, _after, clock, cov, dec in conn.execute(
        "SELECT epoch, winner, favourite, committed, payload, clock, covered, decided_by "
        "FROM trace_cells WHERE value = ? AND cell = ? ORDER BY epoch",
        (at.value, at.cell),
    ):
        rows = [
            {
                "col": col,
                "rule": "keep" if col == 0 else at.rules.get(rule, str(rule)),
                "payload": payload,
                "score": score,
                "verdicts": _verdicts(at.constraints, cov, vbits),
                "winner": col == w,
                "favourite": col == fav,
            }
            for col, rule, payload, score, vbits in cands.get(e, [])
        ]
        decided = [by_id[i]["name"] for i in json.loads(dec)] if dec else []
        if at.vocab is not None:  # the token strings, also in the sentence saying why
            _with_tokens(rows, at.vocab)
        out.append(
            {
                "epoch": e,
                "candidates": rows,
                "winner": w,
                "favourite": fav,
                "committed": bool(committed),
                "payload": after_of.get(int(e)),
                "clock": clock,
                "decided_by": decided,
                "why": _why(rows, w, fav, decided, bool(committed), by_id, dec, at.quorum),
            }
        )
    return out


def _verdicts(cons: Sequence[Mapping[str, Any]], covered: int, vbits: int) -> dict[str, str]:
    """Each constraint's verdict on one candidate (``covered``, ``vbits``: bitmasks over the
    constraint ids of those covering the cell, and of those the candidate violates)."""
    verdicts = {}
    for c in cons:
        if c["status"] == "proved":
            verdicts[c["name"]] = "proved"
        elif not (covered >> c["id"]) & 1:
            verdicts[c["name"]] = "n/a"
        else:
            verdicts[c["name"]] = "violated" if (vbits >> c["id"]) & 1 else "ok"
    return verdicts


def _with_tokens(entries: Sequence[dict[str, Any] | None], vocab: Vocabulary) -> None:
    """Each token payload of ``entries`` with its string (``token``), from the run's tokenizer."""
    for e in entries:
        if e is not None and isinstance(e.get("payload"), int):
            e["token"] = vocab.token(e["payload"])


def _val(a: Any) -> Any:
    """A cell's payload for the story: a number, or a list for a vector cell."""
    arr = np.asarray(a)
    return arr.reshape(-1)[0].item() if arr.size == 1 else arr.tolist()


def _first_checkpoint(conn: sqlite3.Connection) -> str | None:
    row = conn.execute("SELECT file FROM checkpoints ORDER BY epoch LIMIT 1").fetchone()
    return None if row is None else str(row[0])


def _shard_payload(run_dir: Path, rel: str, value: str, cell: int) -> Any:
    """A cell's payload in the worker shards of control checkpoint ``rel``."""
    for shard in checkpoint_shards(run_dir, rel).values():
        arrays = load_checkpoint(
            run_dir, str(shard["file"]), str(shard["sha256"]), "payload checkpoint"
        )
        if f"{value}.payload" in arrays:
            return _val(arrays[f"{value}.payload"][cell])
    return None


@dataclass(frozen=True, slots=True)
class _Quorum:
    """A value's ``quorum(k of n, ...)`` commit policy, as the cell story explains it."""

    k: int  # the votes a payload needs
    n: int  # the replicas that propose
    text: str  # the policy as written, e.g. quorum(2 of 2, satisfy)


def _stored_program(meta: Mapping[str, Any]) -> Program | None:
    """The IR the run stored (None: a log without it, or of a version this one cannot read)."""
    from lmpm.ir.serialize import from_json

    try:
        return from_json(str(meta["ir_json"]))
    except Exception:
        return None


def _quorum_of(program: Program | None, value: str) -> _Quorum | None:
    """``value``'s quorum policy (None: another policy, or no IR to tell)."""
    from lmpm.ir.nodes import ArgKind
    from lmpm.ir.printer import call_str

    if program is None:
        return None
    policy = next((cm.policy for cm in program.commits if cm.access.value == value), None)
    if policy is None or policy.func != "quorum":
        return None
    first = policy.args[0] if policy.args else None
    parts = first.parts if first is not None and first.kind == ArgKind.OF else (first,)
    try:
        counts = [2 if a is None else int(a.value) for a in parts]  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # an expression over a parameter: not explained
    return _Quorum(counts[0], counts[-1], call_str(policy))


def _disagreed(rows: list[dict[str, Any]], quorum: _Quorum) -> str | None:
    """How the quorum's replicas disagreed on a cell, or None when a payload had its votes."""
    votes: dict[tuple[str, str], int] = {}
    for r in rows:
        if r["col"] != 0:
            key = (str(r["rule"]), json.dumps(r["payload"]))
            votes[key] = votes.get(key, 0) + 1
    if not votes or max(votes.values()) >= quorum.k:
        return None
    payloads = ", ".join(p for _, p in votes)
    return (
        f"the quorum's replicas disagreed ({payloads}): no payload was proposed by {quorum.k} "
        f"of the {quorum.n} replicas {quorum.text} needs"
    )


def _why(
    rows: list[dict[str, Any]],
    w: int,
    fav: int,
    decided: list[str],
    committed: bool,
    by_id: Mapping[int, dict[str, Any]],
    dec: str | None,
    quorum: _Quorum | None = None,
) -> str:
    def desc(col: int) -> str:
        r = next((x for x in rows if x["col"] == col), None)
        if r is None:
            return f"candidate {col}"
        if col == 0:
            return "keep current" + ("" if r["payload"] is not None else " (unset)")
        token = f" {r['token']!r}" if "token" in r else ""
        return f"{r['rule']} proposing {r['payload']}{token} (score {r['score']:g})"

    disagreed = _disagreed(rows, quorum) if quorum is not None and w == 0 else None
    if disagreed is not None:
        reason = disagreed
    elif decided:
        first = by_id[json.loads(dec or "[]")[0]]
        if first.get("hard"):  # (a hard constraint holds whatever keep-current does)
            reason = (
                f"the score favourite, {desc(fav)}, violates the hard constraint"
                f"{'s' if len(decided) > 1 else ''} {', '.join(decided)} "
                f"(priority {first['priority']}), so it was not eligible; {desc(w)} won"
            )
        else:
            reason = (
                f"the score favourite, {desc(fav)}, violates {', '.join(decided)} "
                f"(priority {first['priority']}), which {desc(w)} satisfies"
            )
    elif len(rows) == 1:
        reason = "no proposal differed from the committed value"
    elif w == fav:
        reason = f"{desc(w)} has the best score; no constraint overruled it"
    else:
        reason = f"the commit policy chose {desc(w)} (no constraint decided it)"
    if committed:
        outcome = "committed"
    elif w == 0:
        outcome = "kept current"
    else:
        outcome = "winner not committed (schedule quota)"
    return f"{reason}; {outcome}"


def plot(rep: Mapping[str, Any], out: str | Path) -> Path:
    """Violations per constraint per epoch, as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [ep["epoch"] for ep in rep["epochs"]]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    for name, ys in rep["violations_per_epoch"].items():
        ax.plot(epochs, ys, marker="o" if len(epochs) < 40 else None, label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("violating candidates")
    ax.set_title(f"constraint violations — {rep['run'].get('program')}")
    if rep["violations_per_epoch"]:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(out)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".").lower() or "png")
    plt.close(fig)
    atomic_write(path, buf.getvalue())  # beside and renamed: no link at `out` written through
    return path


__all__ = [
    "DEFAULT_LEVEL",
    "LEVELS",
    "Region",
    "TraceRows",
    "Tracer",
    "attribute",
    "cell_story",
    "parse_region",
    "plot",
    "report",
]
