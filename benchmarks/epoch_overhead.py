"""The epoch's fixed cost outside the model: µs per epoch of the text example (one open cell).

Runs the program ``--repeats`` times from scratch and reports, over every epoch after the first,
the 10th percentile and the median of the time spent outside the model (the control plane, the
data plane's gathering, checking and applying) and of the whole epoch, and the outside-model share.
Percentiles of many one-cell epochs are steadier than run means on a busy machine.

Written against the API the pre-redesign engine shares (``Run``, ``keep_records``), so
``benchmarks/baseline.py --here epoch_overhead.py --program P`` runs this very script on both trees
with the same program ``P``:

    python benchmarks/epoch_overhead.py
    python benchmarks/baseline.py --here --rounds 6 epoch_overhead.py --program /tmp/text.lmpm
    python benchmarks/epoch_overhead.py --program examples/video.lmpm --epochs 12 \
        --input Txt=examples/video/caption.txt --input Vid=examples/video/patch.npy

``--ops`` adds two counts that do not depend on the machine's load: the tensor operations (aten
ops, counted by a ``TorchDispatchMode``) and the Python calls (cProfile) per epoch outside the model,
over one more run with every epoch but the first counted.

``--compile`` runs the program with its epoch steps compiled (``lmpm run --compile``), after one
run that compiles them, so that the timed and counted runs compile nothing:

    python benchmarks/epoch_overhead.py --quick --ops --compile

The outside-model *share* also depends on the model's speed. ``--bind NAME=FILE:FUNC`` binds a
model loaded from a file, so both trees can run one model (e.g. the pre-redesign tree's ByteLM):

    B=$PWD/.bench/baseline-3287e81
    python benchmarks/baseline.py --here epoch_overhead.py --program $B/examples/text.lmpm \
        --bind ByteLM=$B/src/lmpm/models/text.py:byte_lm \
        --bind TextScore=$B/src/lmpm/models/text.py:text_score
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import pstats
import statistics
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from lmpm.ir import compile_file
from lmpm.runtime.session import Run

EX = Path(__file__).resolve().parents[1] / "examples"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))]


def load(spec: str, modules: dict[str, Any]) -> tuple[str, Any]:
    """``NAME=FILE:FUNC`` -> (NAME, FUNC of FILE loaded as a module of its own, once per file)."""
    name, _, where = spec.partition("=")
    file, _, func = where.rpartition(":")
    if not name or not file or not func:
        raise SystemExit(f"--bind {spec!r}: expected NAME=FILE:FUNC")
    mod = modules.get(file)
    if mod is None:
        found = importlib.util.spec_from_file_location(f"bound_{len(modules)}", file)
        if found is None or found.loader is None:
            raise SystemExit(f"--bind {spec!r}: cannot load {file}")
        mod = modules[file] = importlib.util.module_from_spec(found)
        found.loader.exec_module(mod)
    return name, getattr(mod, func)


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while ``counting`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += self.counting
        return func(*args, **(kwargs or {}))


def count(run: Run, epochs: int | None, kind: str) -> float:
    """``kind`` (aten_ops, py_calls) per epoch of ``run`` after its first, outside the model (the
    backend's dispatch, which runs the models, is not counted)."""
    run.run(1)
    backend = run.engine.dataplane.calls.backend
    dispatch = backend.dispatch
    mode, prof = OpCount(), cProfile.Profile()
    profiled = kind == "py_calls"

    def pause(items: Any) -> Any:
        mode.counting = False
        if profiled:
            prof.disable()
        try:
            return dispatch(items)
        finally:
            mode.counting = True
            if profiled:
                prof.enable()

    backend.dispatch = pause
    rest = None if epochs is None else epochs - 1
    if not profiled:
        with mode:
            res = run.run(rest)
        return mode.ops / max(res.epochs, 1)
    prof.enable()
    res = run.run(rest)
    prof.disable()
    stats: Any = pstats.Stats(prof).stats  # (file, line, name) -> (cc, calls, ...)
    # not counted: the profiler's own switch and the wrapper above
    n = sum(v[1] for k, v in stats.items() if "_lsprof" not in k[2] and k[2] != "pause")
    return n / max(res.epochs, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--program", default=str(EX / "text.lmpm"))
    ap.add_argument(
        "--input",
        action="append",
        metavar="NAME=PATH",
        help="an input (default: the text example's prompt as Txt)",
    )
    ap.add_argument("--epochs", type=int, help="run this many epochs (default: until stable)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument(
        "--bind",
        action="append",
        default=[],
        metavar="NAME=FILE:FUNC",
        help="bind NAME to FUNC of the Python file FILE (loaded once, shared by every run)",
    )
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="compile the epoch steps (lmpm run --compile); one untimed run compiles them first",
    )
    ap.add_argument(
        "--ops",
        action="store_true",
        help="also count the aten ops and Python calls per epoch outside the model",
    )
    a = ap.parse_args()
    if a.quick:
        a.repeats = 3
    inputs = dict(x.split("=", 1) for x in a.input or [f"Txt={EX / 'text' / 'prompt.txt'}"])
    front = compile_file(a.program)
    modules: dict[str, Any] = {}
    bindings = dict(load(spec, modules) for spec in a.bind)
    opts: dict[str, Any] = {"compile": True} if a.compile else {}  # (the old API has no compile)
    if a.compile:
        Run(front, inputs=inputs, seed=0, bindings=bindings, **opts).run(a.epochs)
    outside: list[float] = []
    whole: list[float] = []
    epochs = 0
    for _ in range(a.repeats):
        run = Run(front, inputs=inputs, seed=0, bindings=bindings, **opts)
        run.engine.keep_records = True
        res = run.run(a.epochs)
        epochs = res.epochs
        for rec in res.records[1:]:  # the first epoch warms caches
            outside.append((rec.seconds - rec.model_seconds) * 1e6)
            whole.append(rec.seconds * 1e6)
    out = {
        "benchmark": "epoch_overhead",
        "case": Path(a.program).stem + ("_compiled" if a.compile else ""),
        "epochs": epochs,
        "repeats": a.repeats,
        "outside_us_p10": round(pct(outside, 0.1), 1),
        "outside_us_median": round(statistics.median(outside), 1),
        "epoch_us_p10": round(pct(whole, 0.1), 1),
        "epoch_us_median": round(statistics.median(whole), 1),
        "outside_share_p10": round(pct(outside, 0.1) / pct(whole, 0.1), 4),
    }
    if a.ops:
        for kind in ("aten_ops", "py_calls"):
            run = Run(front, inputs=inputs, seed=0, bindings=bindings, **opts)
            out[f"{kind}_per_epoch"] = round(count(run, a.epochs, kind), 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
