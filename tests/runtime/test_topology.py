"""The topology: every cell has one owner, the routes are exactly the cells a worker reads and
another worker owns (checked against the plan's gather tables cell by cell), the split is chosen
to keep the halo small, and `lmpm show --plan --workers N` prints it."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from lmpm.bindings import Bindings
from lmpm.cli import main
from lmpm.errors import UsageError
from lmpm.ir import compile_file
from lmpm.resolve.plan import Plan, resolve
from lmpm.resolve.topology import Topology, partition, runs

EX = Path(__file__).resolve().parents[2] / "examples"
CASES = {
    "gpt": (EX / "gpt.lmpm", {"N": 24}),
    "sudoku": (EX / "sudoku.lmpm", {}),
    "video": (
        EX / "video.lmpm",
        {"T": 2, "W": 16, "H": 16, "x1": 4, "x2": 11, "y1": 8, "y2": 13},
    ),
    "latent": (EX / "latent.lmpm", {"W": 6, "H": 5}),
}


def _plan(name: str) -> Plan:
    path, params = CASES[name]
    front = compile_file(path, overrides=params)
    return resolve(front.ir, params, Bindings((), {}))


def _expected_routes(plan: Plan, topo: Topology) -> dict[tuple[str, int, int], set[int]]:
    """Brute force over every read of every owned target cell."""
    out: dict[tuple[str, int, int], set[int]] = {}
    for acc in plan.gathers:
        if topo.replicated[acc.source]:
            continue
        for t in range(acc.index.shape[0]):
            row = 0 if acc.uniform else t
            r = int(topo.owner[acc.target][t])
            for s, ok in zip(acc.index[row].tolist(), acc.valid[row].tolist(), strict=True):
                q = int(topo.owner[acc.source][s])
                if ok and q != r:
                    out.setdefault((acc.source, q, r), set()).add(s)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_owners_and_routes_match_the_gather_tables(name: str, workers: int) -> None:
    plan = _plan(name)
    topo = partition(plan, workers, replicate_bytes=0)
    for value, vp in plan.values.items():
        own = topo.owner[value]
        assert own.shape == (vp.ncells,) and own.dtype == torch.int64
        assert int(own.min()) >= 0 and int(own.max()) < workers
        if not topo.replicated[value]:
            # every worker gets a share of a value that has at least W cells
            counts = torch.bincount(own, minlength=workers)
            assert int(counts.min()) > 0 or vp.ncells < workers
            assert sum(topo.owned(value, w).numel() for w in range(workers)) == vp.ncells
    want = _expected_routes(plan, topo)
    got = {k: set(v.tolist()) for k, v in topo.routes.items()}
    assert got == want
    for cells in topo.routes.values():
        assert torch.equal(cells, cells.sort().values)
    if workers == 1:
        assert topo.routes == {} and topo.halo_bytes() == 0


def test_partition_is_deterministic() -> None:
    plan = _plan("video")
    a, b = partition(plan, 3, replicate_bytes=0), partition(plan, 3, replicate_bytes=0)
    assert a.layout == b.layout
    assert all(torch.equal(a.owner[v], b.owner[v]) for v in a.owner)
    assert a.routes.keys() == b.routes.keys()
    assert all(torch.equal(a.routes[k], b.routes[k]) for k in a.routes)


def test_the_split_with_the_smaller_halo_wins() -> None:
    """Video reads neighbouring frames: ranges of the raster order (whole frames) would send
    every boundary frame; tiles across the frames' rows send one row band per frame."""
    plan = _plan("video")
    topo = partition(plan, 2, replicate_bytes=0)
    assert topo.layout["Vid"] != "ranges"
    vid = plan.values["Vid"]
    ranges = torch.arange(vid.ncells) * 2 // vid.ncells
    forced = Topology(
        2, {**topo.owner, "Vid": ranges}, topo.replicated, topo.layout, {}, topo.cell_bytes
    )
    halo_ranges = sum(len(c) for k, c in _expected_routes(plan, forced).items() if k[0] == "Vid")
    assert topo.halo_bytes("Vid") < halo_ranges * topo.cell_bytes["Vid"]


def test_small_and_static_values_are_replicated() -> None:
    plan = _plan("video")  # Txt is an input no rule writes; Vid/Coarse are small at this size
    topo = partition(plan, 3)
    assert topo.replicated["Txt"] and not any(k[0] == "Txt" for k in topo.routes)
    assert topo.replicated["Vid"]
    n = plan.values["Vid"].ncells
    assert {k for k in topo.routes if k[0] == "Vid"} == {("Vid", 0, 1), ("Vid", 0, 2)}
    assert topo.route_bytes(("Vid", 0, 1)) == n * 8  # int64 tokens


def test_bad_worker_count() -> None:
    with pytest.raises(UsageError) as e:
        partition(_plan("gpt"), 0)
    assert e.value.code == "U080"


def test_runs() -> None:
    assert runs(torch.tensor([0, 1, 2, 5, 6, 9])) == [(0, 3), (5, 7), (9, 10)]
    assert runs(torch.zeros(0, dtype=torch.int64)) == []


def test_show_plan_workers() -> None:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert main(["show", str(EX / "sudoku.lmpm"), "--plan", "--workers", "2"]) == 0
    text = out.getvalue()
    assert "partition over 2 workers" in text and "routes" in text and "Grid" in text
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["show", str(EX / "sudoku.lmpm"), "--plan", "--workers", "0"]) != 0
    assert "U080" in err.getvalue()
