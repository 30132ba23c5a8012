"""Owner.note_broken's queued records (one-cell ones: causal generation; wide ones: a video's
epochs) write what the general path writes, record by record, and what a run's summary counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmpm.ir import compile_file
from lmpm.runtime.data.owner import Owner
from lmpm.runtime.records import ValueEpoch
from lmpm.runtime.session import Run

EX = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def owner() -> Owner:
    run = Run(compile_file(EX / "text.lmpm"), inputs={"Txt": str(EX / "text" / "prompt.txt")})
    return run.engine.dataplane.owner


def record(
    cells: list[int], violated: torch.Tensor, winner: int, changed: bool, was: bool
) -> ValueEpoch:
    n, c, k = len(cells), violated.shape[1], violated.shape[2]
    return ValueEpoch(
        "Txt",
        torch.tensor(cells),
        torch.ones((n, c), dtype=torch.bool),
        torch.zeros((n, c), dtype=torch.float64),
        torch.full((c,), -1),
        violated.expand(n, c, k).clone(),
        torch.arange(k),
        torch.full((n,), winner),
        torch.full((n,), changed),
        torch.zeros(n, dtype=torch.int64),
        torch.full((n,), was),
        torch.ones((n, k), dtype=torch.bool),
    )


@pytest.mark.parametrize(
    ("changed", "was"), [(True, False), (True, True), (False, True), (False, False)]
)
def test_one_cell_matches_the_general_path(owner: Owner, changed: bool, was: bool) -> None:
    broken = owner.broken["Txt"]
    k = broken.shape[1]
    gen = torch.Generator().manual_seed(int(changed) * 2 + int(was))
    for cell in (0, 17, broken.shape[0] - 1):
        violated = torch.rand((1, 9, k), generator=gen) < 0.5
        violated[0, 0] = True  # keep-current violates: a cell left unset must not count it
        broken.fill_(True)  # what the path writes over, not what it leaves
        owner.note_broken(record([cell, cell], violated, 3, changed, was))  # general path
        want = owner.get_broken()["Txt"].clone()
        broken.fill_(True)
        owner.note_broken(record([cell], violated, 3, changed, was))  # one open cell: queued
        assert torch.equal(owner.get_broken()["Txt"], want)  # (written before it is read)
        expect = (
            violated[0, 3 if changed else 0] if changed or was else torch.zeros(k, dtype=torch.bool)
        )
        assert torch.equal(broken[cell], expect)
    broken.zero_()


def test_queued_records_write_what_each_record_writes(owner: Owner) -> None:
    """Many one-cell records (cells opened again, two table widths, some more than the queue
    holds) written together leave what writing each one as it came leaves."""
    broken = owner.broken["Txt"]
    k = broken.shape[1]
    gen = torch.Generator().manual_seed(7)
    records = []
    for _ in range(150):
        c = 9 if torch.rand((), generator=gen) < 0.7 else 5
        violated = torch.rand((1, c, k), generator=gen) < 0.5
        cell = int(torch.randint(0, 12, (), generator=gen))  # few cells: each opened again
        winner = int(torch.randint(0, c, (), generator=gen))
        flags = torch.rand(2, generator=gen) < 0.5
        records.append(record([cell], violated, winner, bool(flags[0]), bool(flags[1])))
    broken.fill_(True)
    for ve in records:
        owner.note_broken(ve)
        owner.get_broken()  # each written alone
    want = broken.clone()
    broken.fill_(True)
    for ve in records:
        owner.note_broken(ve)
    assert torch.equal(owner.get_broken()["Txt"], want)
    assert not torch.equal(want, torch.ones_like(want))  # (the records wrote something)
    broken.zero_()


def test_a_wide_record_writes_each_cells_verdicts(owner: Owner) -> None:
    """A record of many open cells (a video epoch's), each with its own winner and flags, leaves
    in each cell's row the winner's verdicts where it committed, keep-current's where the cell kept
    a committed payload, and nothing where it stays unset; other cells' rows are untouched."""
    broken = owner.broken["Txt"]
    k = broken.shape[1]
    gen = torch.Generator().manual_seed(11)
    for trial in range(6):
        n, c = 40, 2 + trial
        cells = torch.randperm(broken.shape[0], generator=gen)[:n].sort().values
        violated = torch.rand((n, c, k), generator=gen) < 0.5
        winner = torch.randint(0, c, (n,), generator=gen)
        changed = torch.rand(n, generator=gen) < 0.5
        was = torch.rand(n, generator=gen) < 0.5
        if trial == 0:
            changed |= was  # every row kept or committed (the path's no-mask case)
        ve = record(cells.tolist(), violated[:1], 0, False, False)
        ve.violated, ve.winner, ve.changed, ve.was_committed = violated, winner, changed, was
        broken.fill_(True)
        owner.note_broken(ve)
        got = owner.get_broken()["Txt"]
        for i, cell in enumerate(cells.tolist()):
            if changed[i]:
                want = violated[i, winner[i]]
            elif was[i]:
                want = violated[i, 0]
            else:
                want = torch.zeros(k, dtype=torch.bool)
            assert torch.equal(got[cell], want), (trial, i)
        untouched = torch.ones(broken.shape[0], dtype=torch.bool)
        untouched[cells] = False
        assert bool(got[untouched].all())
    broken.zero_()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("strategy", ["all", "raster"])
def test_queued_wide_records_count_what_the_run_committed(compiled: bool, strategy: str) -> None:
    """Records queued and written together (wide ones: every cell opened epoch after epoch, the
    later verdicts winning; one-cell ones: raster): the stop summary counts exactly the committed
    cells that break the soft require, eagerly and compiled (whose step's outputs the queue
    holds)."""
    from test_runtime_termination import program

    src = program(
        strategy, constraints="constraint Low: require A[t] in Set(0..1) priority 10", tiles=""
    )
    run = Run.from_source(src, compile=compiled)
    res = run.run(until_stable=True, max_epochs=60)
    out = run.outputs()["A"].tolist()
    bad = sum(1 for x in out if x not in (0, 1))
    assert res.stop is not None
    assert res.stop.broken == ({"A": {"Low": bad}} if bad else {})
    # ("all": every cell opened every epoch, the first epoch's breaks mended by later ones)
    assert res.epochs >= 3 and (bad > 0 or strategy == "all")
