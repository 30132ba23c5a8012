"""Generate the bundled Sudoku puzzles (deterministic): examples/sudoku/puzzles.json + puzzle.json.

The standard "dig holes" generator: a full random solution (randomized backtracking), then cells are
emptied in random order, each kept empty only if the puzzle still has exactly one solution (checked
by a counting backtracking solver), until the puzzle has its target number of blanks — 30 to 55,
evenly spread over the set. A solution that cannot be dug that far is discarded for a fresh one.
Every puzzle therefore has a unique solution; it is stored beside the puzzle (`null` = blank), and
any valid completion that keeps the givens counts as solved.

    python scripts/gen_sudoku.py [--count 100] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "examples" / "sudoku"
MIN_BLANKS, MAX_BLANKS = 30, 55


def _peers() -> list[list[int]]:
    out = []
    for i in range(81):
        r, c = divmod(i, 9)
        br, bc = r // 3 * 3, c // 3 * 3
        s = {r * 9 + k for k in range(9)} | {k * 9 + c for k in range(9)}
        s |= {(br + a) * 9 + bc + b for a in range(3) for b in range(3)}
        s.discard(i)
        out.append(sorted(s))
    return out


PEERS = _peers()


def solution(rng: random.Random) -> list[int]:
    """A uniformly shuffled backtracking fill, row-major (81,)."""
    grid = [0] * 81

    def fill(k: int) -> bool:
        if k == 81:
            return True
        digits = list(range(1, 10))
        rng.shuffle(digits)
        for d in digits:
            if all(grid[p] != d for p in PEERS[k]):
                grid[k] = d
                if fill(k + 1):
                    return True
        grid[k] = 0
        return False

    assert fill(0)
    return grid


def count_solutions(grid: list[int], limit: int = 2) -> int:
    """Number of completions of ``grid`` (0 = blank), counting up to ``limit``."""
    g = list(grid)
    found = 0

    def rec() -> None:
        nonlocal found
        best, best_mask, best_count = -1, 0, 10
        for i in range(81):
            if g[i] == 0:
                mask = 0x3FE
                for p in PEERS[i]:
                    mask &= ~(1 << g[p])
                count = bin(mask).count("1")
                if count == 0:
                    return
                if count < best_count:
                    best, best_mask, best_count = i, mask, count
        if best < 0:
            found += 1
            return
        for d in range(1, 10):
            if best_mask >> d & 1:
                g[best] = d
                rec()
                g[best] = 0
                if found >= limit:
                    return

    rec()
    return found


def dig(sol: list[int], blanks: int, rng: random.Random) -> list[int] | None:
    """Empty ``blanks`` cells of ``sol`` keeping the solution unique; None if it gets stuck."""
    g = list(sol)
    order = list(range(81))
    rng.shuffle(order)
    removed = 0
    for k in order:
        if removed == blanks:
            break
        g[k] = 0
        if count_solutions(g) == 1:
            removed += 1
        else:
            g[k] = sol[k]
    return g if removed == blanks else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    puzzles = []
    span = MAX_BLANKS - MIN_BLANKS
    for i in range(args.count):
        blanks = MIN_BLANKS + (i * span) // max(args.count - 1, 1)  # 30..55, evenly spread
        while True:
            sol = solution(rng)
            dug = dig(sol, blanks, rng)
            if dug is not None:
                break
        rows = [sol[r * 9 : r * 9 + 9] for r in range(9)]
        puzzle = [[v or None for v in dug[r * 9 : r * 9 + 9]] for r in range(9)]
        puzzles.append({"id": i, "blanks": blanks, "puzzle": puzzle, "solution": rows})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "puzzles.json").write_text(json.dumps(puzzles, separators=(",", ":")) + "\n")
    (OUT / "puzzle.json").write_text(json.dumps(puzzles[len(puzzles) // 2]["puzzle"]) + "\n")
    print(f"wrote {len(puzzles)} puzzles to {OUT}")


if __name__ == "__main__":
    main()
