"""`--compile` coverage (issue 45): how many proposed values compile, over every bundled example
that runs offline and N random programs (the differential tests' generators:
tests/runtime/compile_cases.py), and how many satisfy the coverage rule (compiled, or eager only
for a bound Python predicate).
Nothing is run or timed: the coverage is read from each plan (lmpm.runtime.data.coverage).

One JSON line:

    {"benchmark": "compile_coverage", "compiled": .., "total": .., "ratio": compiled / total,
     "allowed": .., "examples": {...}, "random": {...}, "eager_reasons": {reason kind: count}}

    python benchmarks/compile_coverage.py [--random 500]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from compile_cases import (  # noqa: E402
    EX,
    EXAMPLES,
    bindings_for,
    example_inputs,
    random_programs,
)

from lmpm.ir import compile_file, compile_source  # noqa: E402
from lmpm.runtime.data.coverage import Coverage, coverage  # noqa: E402
from lmpm.runtime.session import Run  # noqa: E402


def _tally(covs: list[Coverage]) -> dict[str, int]:
    return {
        "compiled": sum(c.compiled for c in covs),
        "total": sum(c.total for c in covs),
        "allowed": sum(v.allowed for c in covs for v in c.values),
        "programs": len(covs),
    }


def _kind(why: str) -> str:
    """A reason without its names and numbers (`2 rules propose it` -> `N rules propose it`)."""
    return re.sub(r"\d+", "N", re.sub(r"`[^`]*`", "`X`", why))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=500, help="random programs (default 500)")
    args = ap.parse_args()
    examples = []
    for program, inputs, _ in EXAMPLES:
        run = Run(compile_file(EX / program), inputs=example_inputs(inputs), seed=0)
        examples.append(coverage(run.plan, seed=0))
        run.close()
    randoms = []
    for src, kw in random_programs(args.random):
        front = compile_source(src)
        run = Run(front, bindings=bindings_for(front), seed=kw["seed"], epochs=kw["epochs"])
        randoms.append(coverage(run.plan, seed=kw["seed"]))
        run.close()
    every = _tally(examples + randoms)
    reasons: Counter[str] = Counter(
        _kind(v.why) for c in examples + randoms for v in c.values if v.why is not None
    )
    out: dict[str, Any] = {
        "benchmark": "compile_coverage",
        **every,
        "ratio": round(every["compiled"] / max(every["total"], 1), 4),
        "examples": _tally(examples),
        "random": _tally(randoms),
        "eager_reasons": dict(reasons.most_common()),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
