"""Control-plane throughput of the epoch loop, against the plain reference interpreter.

The seed's video program (examples/video.lmpm) with every constraint live and a null model
(RandomTokens: random proposals straight from the counter-based RNG), red-black schedule.

Prints one JSON line per case:
- ``throughput``: Vid 16×64×64 (+ Txt 77, Coarse 16×8×8): cell-commit attempts per second, for the
  whole epoch and for the control plane alone (epoch time minus model time). Goal ≥ 1,000,000/s.
- ``vs_reference``: the same program at a size the per-cell reference interpreter can run, both
  implementations side by side in this process, identical commits checked. Goal ≥ 100×.

    python benchmarks/runtime.py [--epochs 6]

``benchmarks/baseline.py --here runtime.py`` runs this script on the pre-redesign engine too, so
both engines are timed against the same reference interpreter (this tree's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = ROOT / "tests" / "runtime"  # where reference.py is found; --reference-dir

from lmpm.ir import compile_file  # noqa: E402
from lmpm.models.null import random_tokens, zero_score  # noqa: E402
from lmpm.runtime.session import Run  # noqa: E402


def sky(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    m = torch.zeros(shape, dtype=torch.bool)
    m[:, : max(shape[1] // 4, 1)] = True  # the top quarter of each frame
    return m


def palette(name: str) -> list[int]:
    return [0, 1, 2, 3]


BINDINGS: dict[str, Any] = {
    "Model": random_tokens,
    "CoarseGen": random_tokens,
    "ModelScore": zero_score,
    "region": sky,
    "Palette": palette,
}


def params(t: int, w: int, h: int) -> dict[str, int]:
    return {"T": t, "W": w, "H": h, "N": 77, "x1": 0, "x2": w // 4 - 1, "y1": 0, "y2": h // 4 - 1}


def caption(run: Run) -> None:
    text = b"a red square moves left under a blue sky"
    vp = run.plan.values["Txt"]
    payload = torch.zeros(vp.ncells, dtype=torch.int64)
    payload[: len(text)] = torch.tensor(list(text))
    mask = torch.zeros(vp.ncells, dtype=torch.bool)
    mask[: len(text)] = True
    # run.set_input / run.payload; the pre-redesign engine had them on run.engine (baseline.py --here)
    old: Any = run.engine
    (run.set_input if hasattr(run, "set_input") else old.set_input)("Txt", payload, mask)


def payload(run: Run, name: str) -> torch.Tensor:
    old: Any = run.engine
    return run.payload(name) if hasattr(run, "payload") else old.payload(name)


def throughput(epochs: int) -> dict[str, Any]:
    p = params(16, 64, 64)
    front = compile_file(ROOT / "examples" / "video.lmpm", overrides=p)
    t0 = time.perf_counter()
    run = Run(front, params=p, bindings=BINDINGS, seed=0)
    caption(run)
    setup = time.perf_counter() - t0
    run.engine.step()  # warm-up epoch (allocations), not timed
    res = run.run(epochs + 1)
    control = res.seconds - res.model_seconds
    return {
        "benchmark": "runtime",
        "case": "throughput",
        "cells": run.plan.total_cells,
        "epochs": res.epochs,
        "attempts": res.attempts,
        "attempts_per_s": round(res.attempts / res.seconds),
        "control_plane_attempts_per_s": round(res.attempts / control),
        "model_share": round(res.model_seconds / res.seconds, 3),
        "setup_s": round(setup, 2),
        "goal": 1_000_000,
    }


def vs_reference(epochs: int) -> dict[str, Any]:
    sys.path.insert(0, str(REFERENCE_DIR))
    from reference import Reference

    p = params(4, 32, 32)
    front = compile_file(ROOT / "examples" / "video.lmpm", overrides=p)
    run = Run(front, params=p, bindings=BINDINGS, seed=3)
    caption(run)
    ref = Reference(front.ir, p, BINDINGS, seed=3)
    vp = run.plan.values["Txt"]
    committed = run.engine.state["Txt"].committed
    ref.set_input(
        "Txt",
        [
            int(x) if bool(c) else None
            for x, c in zip(payload(run, "Txt").tolist(), committed.tolist())
        ],
    )
    assert vp.ncells == len(ref.payload["Txt"])
    t = time.perf_counter()
    res = run.run(epochs)
    fast = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(epochs):
        ref.step()
    slow = time.perf_counter() - t
    got = torch.where(run.engine.state["Vid"].committed, payload(run, "Vid"), -1).tolist()
    want = [x if c else -1 for x, c in zip(ref.payload["Vid"], ref.committed["Vid"])]
    assert got == want, "vectorized runtime and reference interpreter disagree"
    assert run.engine.state["Vid"].clock.tolist() == ref.clock["Vid"]
    return {
        "benchmark": "runtime",
        "case": "vs_reference",
        "cells": run.plan.total_cells,
        "epochs": epochs,
        "attempts": res.attempts,
        "reference_s": round(slow, 3),
        "lmpm_s": round(fast, 4),
        "ratio": round(slow / fast, 1),
        "identical": True,
        "goal": 100,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short run for the benchmark summary (python -m benchmarks)",
    )
    ap.add_argument(
        "--reference-dir",
        type=Path,
        help="load reference.py from this directory (default: tests/runtime of this tree)",
    )
    args = ap.parse_args()
    if args.quick:
        args.epochs = 3
    if args.reference_dir is not None:
        global REFERENCE_DIR
        REFERENCE_DIR = args.reference_dir.resolve()
    torch.set_num_threads(2)
    print(json.dumps(throughput(args.epochs)), flush=True)
    print(json.dumps(vs_reference(2)), flush=True)


if __name__ == "__main__":
    main()
