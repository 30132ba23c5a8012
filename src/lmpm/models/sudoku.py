"""Models for examples/sudoku.lmpm: constraint propagation, guessing and restarts as local
message passing. Each open cell sees only its row, column and box (digits and pencil marks).

``Candidates`` (rule ``Notes`` on the helper value ``Cand``), one token per cell packing
    * the cell's *pencil marks*: the digits no committed peer holds (9-bit mask);
    * an *alarm* level: ``ALARM`` where the cell sees a dead end — it is empty with no digit left,
      or one of its units has a digit that is neither placed nor possible in any empty cell — else
      the loudest alarm among its row/column/box minus one. Peers of peers cover the whole grid,
      so an alarm reaches every cell and then fades;
    * a *calm* counter: how many of the cell's updates in a row found its marks unchanged and no
      alarm, up to ``patience``; a calm cell with an empty cell in sight then ticks between
      ``patience`` and ``patience + 1``, so an unsolved grid never looks stable to the engine (the
      search goes on) while a solved one settles and the run stops.

    Token = ``marks + 512 * (calm + (patience + 2) * alarm)``; the value needs
    :func:`cand_vocab` tokens. A pure function of the snapshot: once the grid settles it stops
    committing.

``Digits`` (rule ``Propose`` on ``Grid``); 0 is an empty cell. An empty cell proposes, in order:

    * a *forced* digit: the only digit left (naked single) or the only place for a digit in one of
      its units (hidden single, from the peers' pencil marks);
    * a *guess* (uniform over the digits left) — only when every pencil mark in sight is calm, so
      propagation has settled, and only at the most constrained empty cell among its empty peers
      (fewest marks, ties by a counter-based priority that changes every two epochs): guessing
      cells are pairwise not peers, and a settled unsolved grid has one in every red-black pair
      of epochs that shares the priorities;
    * otherwise 0 ("stay empty").

    A filled cell keeps its digit. While an alarm is in sight every cell proposes 0: filled cells
    erase themselves and nothing is filled, a restart from the givens (which propose 0 too, but the
    `Givens` constraint refuses). After the alarm fades, propagation redoes the forced digits and
    the next guess is drawn afresh.

    Every proposal is two candidates: the choice (score 1) and the alternative (score 0) — 0 for a
    filled cell, so a digit that duplicates a peer (two peers opened in the same epoch can commit
    the same digit) loses to 0 through the no-duplicate constraints.

``Duplicate`` (predicate of the Row/Column/Box constraints)
    ``Duplicate(A[x,y], B[...])``: the candidate is a digit (1–9) held by a committed cell of B other
    than the cell itself. 0 is "empty", not a digit: two empty cells are no duplicate.

The models only use what their reads show them; randomness comes from :mod:`lmpm.workers.rng`, so
a run is a function of its seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lmpm.models import weights
from lmpm.workers import rng

if TYPE_CHECKING:
    from lmpm.runtime.records import PredicateInput

MARKS = 512  # 9-bit pencil-mark mask; the calm and alarm counters sit above it
ALARM = (
    4  # updates an alarm lasts: it floods the grid (peers of peers) and fades one step per update
)


def _tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(digits 1..9, bit of each digit, 2**bit), each (9,) int64, on ``device`` (cached)."""

    def make() -> tuple[Tensor, Tensor, Tensor]:
        bits = torch.arange(9, dtype=torch.int64)  # bit d-1 marks digit d
        return bits + 1, bits, 1 << bits

    tables: tuple[Tensor, Tensor, Tensor] = weights.table("sudoku", make, device)
    return tables


UNITS = ("row", "col", "box")


def cand_vocab(patience: int) -> int:
    """Tokens a `Cand` value needs: marks × calm (0..patience+1) × alarm (0..ALARM)."""
    return MARKS * (patience + 2) * (ALARM + 1)


def _encode(marks: Tensor, calm: Tensor, alarm: Tensor, patience: int) -> Tensor:
    return marks + MARKS * (calm + (patience + 2) * alarm)


@dataclass(frozen=True, slots=True)
class _Unit:
    """One read unit (row, column or box) of n open cells, K = 9 cells each."""

    me: Tensor  # (n, K) the open cell itself
    held: Tensor  # (n, K, 9) cell k holds digit d+1
    filled: Tensor  # (n, K)
    marks: Tensor  # (n, K, 9) pencil marks (unknown: every digit)
    calm: Tensor  # (n, K) calm counter (unknown: 0)
    alarm: Tensor  # (n, K) alarm level (unknown: 0)
    index: Tensor  # (n, K) flat cell index


def _units(inputs: dict[str, Tensor], patience: int) -> list[_Unit]:
    cells = inputs["cells"]
    digits, bits, _ = _tables(cells.device)
    out = []
    for name in UNITS:
        vals, mask, index = inputs[name], inputs[f"{name}_mask"], inputs[f"{name}_index"]
        cvals, cmask = inputs[f"c{name}"], inputs[f"c{name}_mask"]
        if not torch.equal(index, inputs[f"c{name}_index"]):
            raise ValueError(f"reads `{name}` and `c{name}` must cover the same cells")
        held = (vals[:, :, None] == digits) & mask[:, :, None]
        rest = cvals // MARKS
        marks = (cvals[:, :, None] >> bits) & 1 == 1
        out.append(
            _Unit(
                me=index == cells[:, None],
                held=held,
                filled=held.any(dim=2),
                marks=torch.where(cmask[:, :, None], marks, torch.ones_like(marks)),
                calm=torch.where(cmask, rest % (patience + 2), torch.zeros_like(rest)),
                alarm=torch.where(cmask, rest // (patience + 2), torch.zeros_like(rest)),
                index=index,
            )
        )
    return out


def _free(units: list[_Unit]) -> Tensor:
    """(n, 9): digits that no committed peer of the cell holds (exact for this snapshot)."""
    held = torch.zeros(units[0].me.shape[0], 9, dtype=torch.bool, device=units[0].me.device)
    for u in units:
        held |= (u.held & ~u.me[:, :, None]).any(dim=1)
    return ~held


def _empty(units: list[_Unit]) -> Tensor:
    """(n,): the open cell holds no digit (unset or 0)."""
    u = units[0]
    return ~(u.filled & u.me).any(dim=1)


def candidates(
    inputs: dict[str, Tensor], *, vocab: int | None = None, patience: int = 3, **_: Any
) -> dict[str, Tensor]:
    """Pencil marks, calm and alarm of every open cell: (n, 1) tokens (see :func:`cand_vocab`)."""
    if vocab is None or vocab < cand_vocab(patience):
        raise ValueError(
            f"Candidates with patience={patience} needs a token value of at least "
            f"{cand_vocab(patience)} tokens, got {vocab}"
        )
    units = _units(inputs, patience)
    n, dev = inputs["cells"].shape[0], inputs["cells"].device
    free, empty = _free(units), _empty(units)
    marks = (free.to(torch.int64) * _tables(dev)[2]).sum(dim=1)  # (n,)
    # a dead end in sight: this cell is empty with no digit left, or one of its units has a digit
    # that is neither placed nor possible in any empty cell (peers' marks are one epoch old)
    dead = empty & ~free.any(dim=1)
    heard = torch.zeros(n, dtype=torch.int64, device=dev)
    for u in units:
        placed = u.held.any(dim=1)
        possible = (u.marks & (~u.filled & ~u.me)[:, :, None]).any(dim=1) | (free & empty[:, None])
        dead |= ~(placed | possible).all(dim=1)
        heard = torch.maximum(heard, u.alarm.max(dim=1).values)
    alarm = torch.where(dead, torch.full_like(heard, ALARM), (heard - 1).clamp(min=0))
    me = units[0].me
    prev_known = (inputs["crow_mask"] & me).any(dim=1)
    prev_marks = (inputs["crow"] * me).sum(dim=1) % MARKS
    prev_calm = (units[0].calm * me).sum(dim=1)
    settled = prev_known & (prev_marks == marks) & (alarm == 0)  # a restart is no calm either
    waiting = torch.zeros(
        n, dtype=torch.bool, device=dev
    )  # an empty cell in sight: the search is not over
    for u in units:
        waiting |= (~u.filled).any(dim=1)
    tick = torch.where(prev_calm == patience, patience + 1, patience)
    calm = torch.where(waiting & (prev_calm >= patience), tick, (prev_calm + 1).clamp(max=patience))
    calm = torch.where(settled, calm, torch.zeros_like(calm))
    token = _encode(marks, calm, alarm, patience)
    return {
        "proposal": token[:, None],
        "score": torch.zeros(n, 1, dtype=torch.float64, device=dev),
    }


def digits(
    inputs: dict[str, Tensor],
    *,
    seed: int = 0,
    epoch: int = 0,
    patience: int = 3,
    **_: Any,
) -> dict[str, Tensor]:
    """Forced digit, guess, keep or erase for every open Grid cell: (n, 2) proposals and scores."""
    cells = inputs["cells"]
    n, dev = cells.shape[0], cells.device
    units = _units(inputs, patience)
    free, empty = _free(units), _empty(units)
    me = units[0].me
    current = (torch.where(inputs["row_mask"], inputs["row"], 0) * me).sum(dim=1)
    current = torch.where(empty, torch.zeros_like(current), current)

    calm = torch.ones(n, dtype=torch.bool, device=dev)  # every pencil mark in sight has settled
    alarmed = torch.zeros(n, dtype=torch.bool, device=dev)  # a dead end was seen within two hops
    hidden = torch.zeros(n, 9, dtype=torch.bool, device=dev)  # the only place in a unit for a digit
    leader = empty.clone()  # the most constrained empty cell among its empty peers
    for u in units:
        calm &= (u.calm >= patience).all(dim=1)
        alarmed |= (u.alarm > 0).any(dim=1)
        empty_peer = ~u.filled & ~u.me
        elsewhere = (u.marks & empty_peer[:, :, None]).any(dim=1)
        hidden |= free & empty[:, None] & ~elsewhere & ~u.held.any(dim=1)
        # key = (number of marks, a counter-based priority of the cell shared for two epochs, so
        # both red-black halves see the same keys and the global minimum opens within them)
        prio = rng.uniform(seed, "Grid", u.index.reshape(-1), epoch // 2, "Digits/lead")
        key = u.marks.sum(dim=2).to(torch.float64) + prio.reshape(u.index.shape)
        mine = (key * u.me).sum(dim=1)
        leader &= ~(empty_peer & (key <= mine[:, None])).any(dim=1)

    nfree = free.sum(dim=1)
    forced_set = torch.where(hidden.any(dim=1, keepdim=True), hidden, free & (nfree == 1)[:, None])
    forced = empty & (forced_set.sum(dim=1) == 1)
    forced_digit = forced_set.to(torch.int64).argmax(dim=1) + 1

    noise = rng.uniform(seed, "Grid", cells, epoch, "Digits", draws=9)  # (n, 9)
    guess = empty & ~forced & (nfree > 0) & leader & calm
    guess_digit = torch.where(free, noise, torch.full_like(noise, -1.0)).argmax(dim=1) + 1

    choice = torch.zeros(n, dtype=torch.int64, device=dev)
    choice = torch.where(forced, forced_digit, choice)
    choice = torch.where(guess, guess_digit, choice)
    choice = torch.where(empty, choice, current)
    choice = torch.where(alarmed, torch.zeros_like(choice), choice)  # back out: erase, fill nothing
    other = torch.where(alarmed, current, torch.zeros_like(current))
    proposal = torch.stack([choice, other], dim=1)
    score = torch.zeros(n, 2, dtype=torch.float64, device=dev)  # (made on the device: no copy)
    score[:, 0] = 1.0
    return {"proposal": proposal, "score": score}


def duplicate(ctx: PredicateInput) -> Tensor:
    """`Duplicate(A[x,y], B[...])`: the candidate is a digit (not 0) that a committed cell of B other
    than the cell itself already holds — the all-different constraint of a row, column or box."""
    if not ctx.accesses:
        raise ValueError("Duplicate(A, B) needs a second access B: the cells that must differ")
    payload, mask, index = ctx.accesses[0]  # (n, K)
    others = mask & (index != ctx.cells[:, None])
    same = (payload[:, None, :] == ctx.candidates[:, :, None]) & others[:, None, :]  # (n, C, K)
    return same.any(dim=2) & (ctx.candidates != 0)
