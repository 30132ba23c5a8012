"""Run a benchmark script on this tree and on an earlier commit, interleaved, in one invocation.

A regression check for changes that touch the runtime: ``REF`` (default: the commit before the
runtime redesign) is checked out once as a git worktree under ``.bench/`` (ignored by git) and each
round runs the script there and here, alternating which goes first. Each tree runs its *own* copy
of the script (the same workload written against its own API), with its own ``src`` on
``PYTHONPATH``. For every JSON line (keyed by ``benchmark``/``case``) it prints one JSON line with
the median of each numeric field on both sides and ``change`` = this tree / the baseline for the
fields named with ``--metric``.

    python benchmarks/baseline.py runtime.py --epochs 6
    python benchmarks/baseline.py --here runtime.py \
        --reference-dir $PWD/.bench/baseline-3287e81/tests/runtime   # one reference for both
    python benchmarks/baseline.py examples.py --repeats 3 --metric outside_model_share
    python benchmarks/baseline.py --ref HEAD~3 --rounds 5 trace.py
    python benchmarks/baseline.py --here --rounds 6 epoch_overhead.py --program P --metric outside_us_p10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRE_REDESIGN = "3287e81"  # the last commit whose engine gathered and wrote payload itself
DEFAULT_METRICS = (
    "attempts_per_s",
    "control_plane_attempts_per_s",
    "ratio",
    "outside_model_share",
    "ms_per_epoch",
    "outside_us_p10",
    "epoch_us_p10",
    "outside_share_p10",
)


def worktree(ref: str) -> Path:
    """A checkout of ``ref`` under .bench/ (made once; the directory is ignored by git)."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    path = ROOT / ".bench" / f"baseline-{sha}"
    if not (path / "src").is_dir():
        path.parent.mkdir(exist_ok=True)
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha],
            check=True,
            capture_output=True,
        )
    return path


def run(
    tree: Path, script: str, args: list[str], scripts: Path | None = None
) -> dict[tuple[str, str], dict[str, Any]]:
    """Run ``scripts``' copy of ``script`` (default: ``tree``'s) with ``tree``'s src."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    proc = subprocess.run(
        [sys.executable, str((scripts or tree) / "benchmarks" / script), *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"{script} failed in {tree}:\n{proc.stderr[-3000:]}")
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[(str(rec.get("benchmark")), str(rec.get("case")))] = rec
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("script", help="a script in benchmarks/, e.g. runtime.py")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ap.add_argument("--ref", default=PRE_REDESIGN, help="the baseline commit")
    ap.add_argument(
        "--new",
        help="compare this commit instead of the working tree (e.g. to hold the examples "
        "fixed while the baseline's engine runs them)",
    )
    ap.add_argument(
        "--here",
        action="store_true",
        help="run this tree's copy of the script on both sides (for scripts written against an "
        "API both trees share, e.g. epoch_overhead.py), each side with its own src",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--metric", action="append", help="fields to compare (default: throughputs)")
    a = ap.parse_args()
    base = worktree(a.ref)
    new = worktree(a.new) if a.new else ROOT
    metrics = tuple(a.metric or DEFAULT_METRICS)
    runs: dict[str, list[dict[tuple[str, str], dict[str, Any]]]] = {"base": [], "new": []}
    for r in range(a.rounds):
        order = [("base", base), ("new", new)]
        for side, tree in order if r % 2 == 0 else order[::-1]:
            runs[side].append(run(tree, a.script, a.args, ROOT if a.here else tree))
    for key in runs["new"][0]:
        med: dict[str, dict[str, float]] = {}
        for side in ("base", "new"):
            recs = [rs[key] for rs in runs[side] if key in rs]
            fields = {k for rec in recs for k, v in rec.items() if isinstance(v, int | float)}
            med[side] = {
                k: statistics.median(float(rec[k]) for rec in recs if k in rec)
                for k in sorted(fields)
                if not isinstance(recs[0].get(k), bool)
            }
        change = {
            m: round(med["new"][m] / med["base"][m], 3)
            for m in metrics
            if m in med["new"] and med["base"].get(m)
        }
        print(
            json.dumps(
                {
                    "benchmark": "baseline",
                    "script": a.script,
                    "case": key[1],
                    "ref": a.ref,
                    "new": a.new or "working tree",
                    "rounds": a.rounds,
                    "change": change,
                    "baseline": med["base"],
                    "measured": med["new"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
