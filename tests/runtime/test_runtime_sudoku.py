"""examples/sudoku.lmpm through the real `lmpm run` CLI: solved grids are valid, keep their givens,
and the same seed gives the same output. Plus the model's predicate and token layout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmpm.models import sudoku

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "examples" / "sudoku.lmpm"
PUZZLES = ROOT / "examples" / "sudoku" / "puzzles.json"
# 30 and 45 blanks (solved by propagation alone), 54 blanks (needs guesses and restarts)
IDS = (0, 50, 96)


def _lmpm() -> list[str]:
    exe = Path(sys.executable).with_name("lmpm")
    found = str(exe) if exe.exists() else shutil.which("lmpm")
    return [found] if found else [sys.executable, "-m", "lmpm.cli"]


def _valid(grid: list[list[int]]) -> bool:
    digits = list(range(1, 10))
    rows = [list(r) for r in grid]
    cols = [[grid[r][c] for r in range(9)] for c in range(9)]
    boxes = [
        [grid[br + a][bc + b] for a in range(3) for b in range(3)]
        for br in (0, 3, 6)
        for bc in (0, 3, 6)
    ]
    return all(sorted(unit) == digits for unit in rows + cols + boxes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str, dict]]:
    """Run every selected puzzle (and one twice) as concurrent `lmpm run` processes."""
    base = tmp_path_factory.mktemp("sudoku")
    puzzles = {p["id"]: p for p in json.loads(PUZZLES.read_text())}
    jobs = {f"p{i}": puzzles[i] for i in IDS} | {"again": puzzles[IDS[-1]]}
    # concurrent processes: one intra-op thread each, or tiny tensor ops oversubscribe the cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for name, p in jobs.items():
        src = base / f"{name}.json"
        src.write_text(json.dumps(p["puzzle"]))
        out = base / name
        cmd = [
            *_lmpm(),
            "run",
            str(PROGRAM),
            "--input",
            f"Grid={src}",
            "--out",
            str(out),
            "--quiet",
        ]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        procs[name] = (proc, out, p)
    done = {}
    for name, (proc, out, p) in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        done[name] = (out, err, p)
    return done


@pytest.mark.parametrize("pid", IDS)
def test_cli_solves_puzzle(runs: dict[str, tuple[Path, str, dict]], pid: int) -> None:
    out, err, p = runs[f"p{pid}"]
    grid = json.loads((out / "Grid.json").read_text())
    assert len(grid) == 9 and all(len(row) == 9 for row in grid)
    assert all(isinstance(v, int) and 1 <= v <= 9 for row in grid for v in row), grid
    givens = [(r, c) for r in range(9) for c in range(9) if p["puzzle"][r][c] is not None]
    assert all(grid[r][c] == p["puzzle"][r][c] for r, c in givens)
    assert _valid(grid)
    assert grid == p["solution"]  # the bundled puzzles have unique solutions
    assert "(stable, every cell set)" in err


def test_cli_same_seed_same_output(runs: dict[str, tuple[Path, str, dict]]) -> None:
    (first, err1, _), (second, err2, _) = runs[f"p{IDS[-1]}"], runs["again"]
    for name in ("Grid.json", "Cand.json", "Grid.npy"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert err1.split(" epochs")[0] == err2.split(" epochs")[0]


def test_duplicate_ignores_empty_cells() -> None:
    from lmpm import PredicateInput  # the documented name (docs/runtime.md)

    peers = torch.tensor([[0, 3, 5]])
    ctx = PredicateInput(
        candidates=torch.tensor([[0, 3, 4, 5]]),
        valid=torch.ones(1, 4, dtype=torch.bool),
        current=torch.tensor([0]),
        committed=torch.tensor([True]),
        cells=torch.tensor([9]),
        coords=torch.tensor([[1, 0]]),
        accesses=((peers, torch.tensor([[True, True, False]]), torch.tensor([[1, 2, 9]])),),
        args=(),
        epoch=0,
    )
    # 0 is empty (never a duplicate); 3 is held by a committed peer; 5 only by an uncommitted one
    assert sudoku.duplicate(ctx).tolist() == [[False, True, False, False]]


def test_candidates_token_layout() -> None:
    # one open cell (index 0) whose row holds 1 and 2; everything else empty / unknown
    idx = torch.arange(9)[None, :]
    row = torch.tensor([[0, 1, 2, 0, 0, 0, 0, 0, 0]])
    none = torch.zeros(1, 9, dtype=torch.bool)
    inputs = {"cells": torch.tensor([0]), "coords": torch.tensor([[0, 0]])}
    for name in sudoku.UNITS:
        inputs |= {name: row, f"{name}_mask": row > 0, f"{name}_index": idx}
        inputs |= {f"c{name}": torch.zeros(1, 9, dtype=torch.int64)}
        inputs |= {f"c{name}_mask": none, f"c{name}_index": idx}
    out = sudoku.candidates(inputs, vocab=sudoku.cand_vocab(3), patience=3)
    token = int(out["proposal"][0, 0])
    assert token % sudoku.MARKS == 0b111111100  # digits 3..9 free
    assert token // sudoku.MARKS == 0  # no calm yet (no previous marks), no alarm
    with pytest.raises(ValueError, match="at least"):
        sudoku.candidates(inputs, vocab=512, patience=3)
