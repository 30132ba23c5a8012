"""The one-open-cell stages (causal generation: one cell per epoch) compute what the general
stages compute: clocks (Clocks.advance_one against Clocks.advance), metadata (write_cell against
write_meta) and the payload write (DataPlane's numpy store against index_copy_). End to end, the
differential tests run random raster k=1 programs against the reference."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch

from lmpm.ir import compile_file
from lmpm.resolve.plan import resolve
from lmpm.runtime.data.clocks import Clocks, Opened
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.decide import CellArrays, write_cell, write_meta
from lmpm.runtime.records import CellState
from lmpm.runtime.session import Run

EX = Path(__file__).resolve().parents[2] / "examples"


# latent: a masked read of another value; sudoku: two sources; video: a uniform read
@pytest.mark.parametrize("example", ["latent", "sudoku", "text", "video"])
def test_advance_one_matches_advance(example: str) -> None:
    plan = resolve(compile_file(EX / f"{example}.lmpm").ir)
    gen = torch.Generator().manual_seed(0)
    state = {name: CellState.empty(vp.ncells) for name, vp in plan.values.items()}
    clocks = Clocks(plan.rules)
    for bump in (0, 7):  # the numpy views see in-place writes of the clocks made after them
        for st in state.values():
            st.clock.copy_(torch.randint(0, 50, st.clock.shape, generator=gen) + bump)
        for rp in plan.rules:
            n = plan.values[rp.target].ncells
            for c in torch.randperm(n, generator=gen)[:16].tolist():
                for fresh in (True, False):
                    own = 0 if fresh else int(state[rp.target].clock[c])
                    opened = Opened(torch.tensor([own]), torch.tensor([c]), None, fresh)
                    one = torch.tensor([True])
                    want = clocks.advance(state, (rp,), opened, one, 1, None)
                    assert clocks.advance_one(state, rp, c, own) == int(want), (rp.name, c)


def test_write_cell_matches_write_meta() -> None:
    general, one = CellState.empty(10), CellState.empty(10)
    score = torch.tensor([-0.25], dtype=torch.float64)
    write_meta(general, torch.tensor([3]), torch.tensor([5]), 2, 7, score)
    write_cell(CellArrays.of(one), 3, 5, 2, 7, -0.25)
    for f in fields(CellState):
        assert torch.equal(getattr(general, f.name), getattr(one, f.name)), f.name


def test_one_cell_payload_write_matches_and_moves_versions() -> None:
    def plane() -> DataPlane:
        run = Run(compile_file(EX / "text.lmpm"), inputs={"Txt": str(EX / "text" / "prompt.txt")})
        return run.engine.dataplane

    one, general = plane(), plane()
    cells, new = torch.tensor([40]), torch.tensor([101])
    payload, committed = one.payload["Txt"], one.committed["Txt"]
    before = (payload._version, committed._version)
    one._write("Txt", cells, new)  # numpy stores
    # the general path's writes (two cells at once), of which cell 40 is the one above
    general._write("Txt", torch.tensor([40, 41]), torch.tensor([101, 0]))
    assert int(payload[40]) == 101 and bool(committed[40])
    assert torch.equal(payload[:41], general.payload["Txt"][:41])
    assert torch.equal(committed[:41], general.committed["Txt"][:41])
    # the read caches key on the versions: a numpy store must move them as a tensor write does
    assert payload._version > before[0] and committed._version > before[1]
