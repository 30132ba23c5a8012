"""Sudoku: solve rate, median epochs and wall time per puzzle of examples/sudoku.lmpm (issue 5).

Runs the 100 bundled puzzles (examples/sudoku/puzzles.json, 30–55 blanks, unique solutions) with
default settings — what `lmpm run examples/sudoku.lmpm --input Grid=PUZZLE` does: no --epochs, so
each run stops at the first stable red-black cycle — in one process through the same session API as
the CLI. A puzzle counts as solved when every cell holds a digit, the givens are kept and every row,
column and box is all-different. `median_wall_s_per_puzzle` is load + run of one puzzle, without
the interpreter start-up; `cli_wall_s` is one whole `lmpm run` process on the example puzzle.

Prints one JSON line. Goal: solve_rate >= 0.95.

    python benchmarks/sudoku.py [--seed 0] [--threads N] [--no-cli]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "sudoku.lmpm"
PUZZLES = ROOT / "examples" / "sudoku" / "puzzles.json"
GOAL = 0.95


def solved(grid: list[list[int]], puzzle: list[list[int | None]]) -> bool:
    digits = list(range(1, 10))
    if any(
        puzzle[r][c] is not None and grid[r][c] != puzzle[r][c] for r in range(9) for c in range(9)
    ):
        return False
    cols = [[grid[r][c] for r in range(9)] for c in range(9)]
    boxes = [
        [grid[br + a][bc + b] for a in range(3) for b in range(3)]
        for br in (0, 3, 6)
        for bc in (0, 3, 6)
    ]
    return all(sorted(unit) == digits for unit in [*grid, *cols, *boxes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    ap.add_argument("--no-cli", action="store_true", help="skip the whole-process `lmpm run`")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short run for the benchmark summary (python -m benchmarks)" + ": 10 puzzles",
    )
    args = ap.parse_args()

    import torch

    from lmpm.ir import compile_file
    from lmpm.runtime.session import Run

    if args.threads:
        torch.set_num_threads(args.threads)
    front = compile_file(PROGRAM)
    puzzles = json.loads(PUZZLES.read_text())
    if args.quick:
        puzzles, args.no_cli = puzzles[:10], True
    ok, epochs, walls = 0, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for p in puzzles:
            path = Path(tmp) / f"{p['id']}.json"
            path.write_text(json.dumps(p["puzzle"]))
            t0 = time.perf_counter()
            run = Run(front, inputs={"Grid": str(path)}, seed=args.seed)
            res = run.run(None)
            grid = run.outputs()["Grid"].tolist()
            walls.append(time.perf_counter() - t0)
            epochs.append(res.epochs)
            ok += solved(grid, p["puzzle"])
        cli_wall = None
        if not args.no_cli:
            exe = Path(sys.executable).with_name("lmpm")
            cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lmpm.cli"]
            puzzle = ROOT / "examples" / "sudoku" / "puzzle.json"
            t0 = time.perf_counter()
            subprocess.run(
                [*cmd, "run", str(PROGRAM), "--input", f"Grid={puzzle}", "--out", tmp, "--quiet"],
                check=True,
                capture_output=True,
            )
            cli_wall = round(time.perf_counter() - t0, 3)
    total = len(puzzles)
    walls_sorted = sorted(walls)
    print(
        json.dumps(
            {
                "benchmark": "sudoku",
                "solved": ok,
                "total": total,
                "solve_rate": round(ok / total, 4),
                "median_epochs": statistics.median(epochs),
                "median_wall_s_per_puzzle": round(statistics.median(walls), 4),
                "goal": GOAL,
                "max_epochs": max(epochs),
                "p90_wall_s_per_puzzle": round(walls_sorted[int(0.9 * (total - 1))], 4),
                "max_wall_s_per_puzzle": round(walls_sorted[-1], 4),
                "cli_wall_s": cli_wall,
                "seed": args.seed,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
