"""Compiled built-in models in the real run: model µs per epoch, eager vs compiled, under --compile.

Runs an example with ``Run(compile=True)`` (the epoch step compiled either way) ``--repeats`` times
with the built-in models eager and as many times compiled (their ``lmpm_compile`` factories,
lmpm.models.compile), alternating so both see the same machine load. Reports the median over runs
of each run's 10th percentile and median of ``EpochRecord.model_seconds`` (the worker's time in
the models and scores of an epoch, with their batching and checks), the compile time of the first
compiled run, and whether the compiled runs committed the same payload as the eager ones.

    python benchmarks/model_compile.py                    # examples/text.lmpm (ByteLM, TextScore)
    python benchmarks/model_compile.py --example video    # examples/video.lmpm, 16 epochs
    python benchmarks/model_compile.py --example video-small   # the same at 4 x 8 x 8
    python benchmarks/model_compile.py --threads 1        # torch.set_num_threads(1) first

Which built-ins opt in by default is decided from this script's numbers (docs/models.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmpm.bindings import COMPILE_ATTR
from lmpm.ir import compile_file
from lmpm.runtime.session import Run

EX = Path(__file__).resolve().parents[1] / "examples"


def examples() -> dict[str, dict[str, Any]]:
    from lmpm.models import text, video

    return {
        "text": {
            "program": EX / "text.lmpm",
            "inputs": {"Txt": EX / "text" / "prompt.txt"},
            "epochs": None,
            "models": [
                (text.byte_lm, text.compiled_byte_lm),
                (text.text_score, text.compiled_text_score),
            ],
        },
        "video-small": {  # 4 x 8 x 8 cells, no patch: 128 cells an epoch instead of 2,048
            "program": EX / "video.lmpm",
            "params": {"W": 8, "H": 8, "x1": 0, "x2": 1, "y1": 0, "y2": 1},
            "inputs": {"Txt": EX / "video" / "caption.txt"},
            "epochs": 16,
            "models": [
                (video.local_gen, video.compiled_local_gen),
                (video.model_score, video.compiled_model_score),
                (video.coarse_gen, video.compiled_coarse_gen),
            ],
        },
        "video": {
            "program": EX / "video.lmpm",
            "inputs": {"Txt": EX / "video" / "caption.txt", "Vid": EX / "video" / "patch.npy"},
            "epochs": 16,
            "models": [
                (video.local_gen, video.compiled_local_gen),
                (video.model_score, video.compiled_model_score),
                (video.coarse_gen, video.compiled_coarse_gen),
            ],
        },
    }


def opt_in(models: list[tuple[Any, Any]], on: bool) -> None:
    for fn, factory in models:
        if on:
            setattr(fn, COMPILE_ATTR, factory)
        elif hasattr(fn, COMPILE_ATTR):
            delattr(fn, COMPILE_ATTR)


def one_run(ex: dict[str, Any], compiled: bool) -> tuple[list[float], dict[str, Any]]:
    opt_in(ex["models"], compiled)
    params = ex.get("params", {})
    front = compile_file(ex["program"], overrides=params)
    run = Run(front, params=params, inputs=ex["inputs"], compile=True)
    try:
        res = run.run(ex["epochs"], until_stable=ex["epochs"] is None)
        return [r.model_seconds for r in res.records], run.outputs()
    finally:
        run.close()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--example", choices=("text", "video", "video-small"), default="text")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    ex = examples()[a.example]
    defaults = {id(fn): getattr(fn, COMPILE_ATTR, None) for fn, _ in ex["models"]}
    try:
        t0 = time.perf_counter()
        _, out_compiled = one_run(ex, True)  # compiles the models' graphs (or loads them)
        first = time.perf_counter() - t0
        _, out_eager = one_run(ex, False)
        same = all(np.array_equal(out_eager[k], out_compiled[k]) for k in out_eager)
        p10: dict[bool, list[float]] = {False: [], True: []}
        p50: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeats):
            for compiled in (False, True):
                ms, out = one_run(ex, compiled)
                same = same and all(np.array_equal(out_eager[k], out[k]) for k in out_eager)
                p10[compiled].append(pct(ms[1:], 0.1))
                p50[compiled].append(pct(ms[1:], 0.5))
    finally:
        for fn, _ in ex["models"]:
            flag = defaults[id(fn)]
            if flag is None:
                if hasattr(fn, COMPILE_ATTR):
                    delattr(fn, COMPILE_ATTR)
            else:
                setattr(fn, COMPILE_ATTR, flag)
    us = lambda xs: round(statistics.median(xs) * 1e6, 1)  # noqa: E731
    print(
        json.dumps(
            {
                "benchmark": "model_compile",
                "example": a.example,
                "threads": torch.get_num_threads(),
                "repeats": a.repeats,
                "model_us_p10": {"eager": us(p10[False]), "compiled": us(p10[True])},
                "model_us_median": {"eager": us(p50[False]), "compiled": us(p50[True])},
                "speedup_p10": round(
                    statistics.median(p10[False]) / statistics.median(p10[True]), 2
                ),
                "first_compiled_run_s": round(first, 2),
                "same_commits": same,
            }
        )
    )


if __name__ == "__main__":
    main()
