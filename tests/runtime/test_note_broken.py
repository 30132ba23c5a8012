"""Owner.note_broken's queued one-cell records (causal generation) write what the general path
writes, record by record."""

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
        want = broken.clone()
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
