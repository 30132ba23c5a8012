"""The compiled epoch step (``--compile``) against the eager epoch, side by side in one process.

Each case runs the same program eagerly and compiled (lmpm.runtime.data.compiled), alternating, after
one compiled warm-up run (its graphs are then reused by every later run in the process, so the
timed runs compile nothing), and checks that both commit the same outputs.

- ``text``: examples/text.lmpm with the bundled prompt (one open cell per epoch): per epoch, the
  10th percentile of the time outside the model and of the whole epoch; the outside-model share
  (goal ≤ 5% compiled). Then, in separate compiled runs, the wall time of the compiled decision
  step's calls per epoch (``CompiledEpoch.step``: one graph call per value with what it hands in
  and out), p10, and its share of the compiled epoch: the floor under the compiled share.
- ``video``: examples/video.lmpm with the bundled caption and locked patch (the README demo): the
  median outside-model share over runs (goal ≤ 5% compiled).
- ``throughput``: the control-plane workload of benchmarks/runtime.py (Vid 16×64×64 with every
  constraint live and a null model, red-black): cell-commit attempts per second of control-plane
  time, eager and compiled (goal ≥ 2× eager).
- ``compile_time``: a fresh process compiling the text and the video steps with an empty inductor
  cache (cold), then another with the cache the first filled (warm): per program the seconds its
  steps took to trace and compile and the graphs built or found in the cache, and the whole
  process's wall time (both runs, with the compiled built-in text models).
- ``cli_wall``: `lmpm run examples/text.lmpm` as a user types it, eager, then ``--compile`` cold
  (an empty cache) and warm (the cache the cold run filled): each command's wall time, and the
  ratios to eager (a short run like this one is quicker eager; `lmpm run --compile` says so).

    python benchmarks/compile.py [--quick] [--device cpu|cuda]
    python benchmarks/compile.py --device cuda --epochs-per-replay 1,2,4,8,16

``--epochs-per-replay K,...``: K epochs per CUDA-graph replay (lmpm.runtime.data.kepochs) of a
capturable workload (two values on a 32×32 grid, red-black, a pure torch model): per K the time
per epoch and its ratio to K = 1, and that every K commits what K = 1 commits.

``--device cuda`` runs the text and video examples with their payload on the GPU instead, eager
and compiled (each value's step captured as a CUDA graph): the host time outside the model per
epoch (goal ≤ 50 µs for text, ≤ 5% of the epoch for video), and the graphs compiled over 10,000
text epochs after the first run (goal 0). ``--device simcuda`` runs the same on the simulated
device, a dry run of the path on a CPU (its times are the simulation's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"
sys.path.insert(0, str(ROOT / "benchmarks"))

from lmpm.bindings import COMPILE_ATTR  # noqa: E402
from lmpm.ir import compile_file  # noqa: E402
from lmpm.models import text as text_models  # noqa: E402
from lmpm.runtime.records import RunResult  # noqa: E402
from lmpm.runtime.session import Run  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))]


def _outputs(run: Run) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in run.outputs().items()}


def alternate(
    make: Callable[[bool], Run], epochs: int | None, repeats: int
) -> dict[bool, list[tuple[Run, RunResult]]]:
    """Warm up compiled, then ``repeats`` runs of each mode, alternating; outputs checked equal."""
    make(True).run(epochs)  # compiles every step this program needs (reused from now on)
    out: dict[bool, list[tuple[Run, RunResult]]] = {False: [], True: []}
    for _ in range(repeats):
        for compiled in (False, True):
            run = make(compiled)
            out[compiled].append((run, run.run(epochs)))
    want = _outputs(out[False][0][0])
    for compiled in (False, True):
        for run, _ in out[compiled]:
            got = _outputs(run)
            for k, v in want.items():
                if not np.array_equal(got[k], v, equal_nan=True):
                    raise AssertionError(f"{k}: compiled={compiled} differs from eager")
        assert out[True][-1][0].engine.compiled is not None
        if compiled:
            assert out[True][-1][0].engine.compiled.stats.compiles == 0, "recompiled"
    return out


def outside_model(runs: dict[bool, list[tuple[Run, RunResult]]], row: dict[str, Any]) -> None:
    """Per mode, the 10th percentile over every epoch but the first of the time outside the model
    (µs), of the whole epoch (µs), and the share of the first in the second, into ``row``."""
    for compiled, label in ((False, "eager"), (True, "compiled")):
        outside, whole = [], []
        for _, res in runs[compiled]:
            for rec in res.records[1:]:
                outside.append((rec.seconds - rec.model_seconds) * 1e6)
                whole.append(rec.seconds * 1e6)
        row[f"{label}_outside_us_p10"] = round(pct(outside, 0.1), 1)
        row[f"{label}_epoch_us_p10"] = round(pct(whole, 0.1), 1)
        row[f"{label}_outside_share"] = round(pct(outside, 0.1) / pct(whole, 0.1), 4)


@contextlib.contextmanager
def _step_calls() -> Iterator[list[list[float]]]:
    """Per epoch (one list each, opened by the engine's epoch), the wall seconds of every compiled
    step call in it (:meth:`CompiledEpoch.step`: the decision of one value as one graph call,
    with its inputs and outputs handled around it)."""
    from lmpm.runtime.control.engine import Engine
    from lmpm.runtime.data.compiled import CompiledEpoch

    epochs: list[list[float]] = []
    step, epoch = CompiledEpoch.step, Engine._epoch

    def timed_step(self: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return step(self, *a, **k)
        finally:
            epochs[-1].append(time.perf_counter() - t0)

    def timed_epoch(self: Any, *a: Any, **k: Any) -> Any:
        epochs.append([])
        return epoch(self, *a, **k)

    CompiledEpoch.step, Engine._epoch = timed_step, timed_epoch  # type: ignore[method-assign]
    try:
        yield epochs
    finally:
        CompiledEpoch.step, Engine._epoch = step, epoch  # type: ignore[method-assign]


def text(repeats: int) -> dict[str, Any]:
    front = compile_file(EX / "text.lmpm")
    prompt = {"Txt": str(EX / "text" / "prompt.txt")}
    runs = alternate(lambda c: Run(front, inputs=prompt, seed=0, compile=c), None, repeats)
    row: dict[str, Any] = {"benchmark": "compile", "case": "text"}
    outside_model(runs, row)
    # The floor under the compiled share: the decision's own graph calls, per epoch (separate
    # runs: the timing wrappers stay out of the runs measured above)
    with _step_calls() as calls:
        for _ in range(repeats):
            Run(front, inputs=prompt, seed=0, compile=True).run(None)
    per_epoch = [sum(c) * 1e6 for c in calls if c]
    row["compiled_step_calls_us_p10"] = round(pct(per_epoch, 0.1), 1)
    row["compiled_step_calls_share"] = round(pct(per_epoch, 0.1) / row["compiled_epoch_us_p10"], 4)
    row["outside_ratio"] = round(row["eager_outside_us_p10"] / row["compiled_outside_us_p10"], 2)
    row["epochs"] = runs[True][0][1].epochs
    row["repeats"] = repeats
    row["goal_share"] = 0.05
    return row


def video(epochs: int, repeats: int) -> dict[str, Any]:
    front = compile_file(EX / "video.lmpm")
    inputs = {"Txt": str(EX / "video" / "caption.txt"), "Vid": str(EX / "video" / "patch.npy")}
    runs = alternate(lambda c: Run(front, inputs=inputs, seed=0, compile=c), epochs, repeats)
    row: dict[str, Any] = {"benchmark": "compile", "case": "video"}
    for compiled, label in ((False, "eager"), (True, "compiled")):
        shares = [1 - r.model_seconds / r.seconds for _, r in runs[compiled]]
        per_epoch = [r.seconds / r.epochs * 1e3 for _, r in runs[compiled]]
        row[f"{label}_outside_share"] = round(statistics.median(shares), 4)
        row[f"{label}_ms_per_epoch"] = round(statistics.median(per_epoch), 2)
    row["epochs"] = epochs
    row["repeats"] = repeats
    row["goal_share"] = 0.05
    return row


def throughput(epochs: int, repeats: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from runtime import BINDINGS, caption, params

    p = params(16, 64, 64)
    front = compile_file(EX / "video.lmpm", overrides=p)
    rates: dict[bool, list[float]] = {False: [], True: []}
    finals: dict[bool, Any] = {}
    for i in range(repeats + 1):
        for compiled in (False, True):
            run = Run(front, params=p, bindings=BINDINGS, seed=0, compile=compiled)
            caption(run)
            run.engine.step()  # allocations (and, the first time, compiling): not timed
            res = run.run(epochs + 1)
            if i:
                rates[compiled].append(res.attempts / (res.seconds - res.model_seconds))
            finals[compiled] = run
    for name in finals[False].plan.values:
        assert torch.equal(finals[False].payload(name), finals[True].payload(name)), name
    eager, compiled = statistics.median(rates[False]), statistics.median(rates[True])
    return {
        "benchmark": "compile",
        "case": "throughput",
        "cells": finals[True].plan.total_cells,
        "epochs": epochs,
        "eager_attempts_per_s": round(eager),
        "compiled_attempts_per_s": round(compiled),
        "ratio": round(compiled / eager, 2),
        "goal": 2.0,
    }


_CHILD = """
import json, sys, time
from pathlib import Path
from lmpm.ir import compile_file
from lmpm.runtime.session import Run
ex = Path(sys.argv[1])
out = {}
t0 = time.perf_counter()
run = Run(compile_file(ex / "text.lmpm"), inputs={"Txt": str(ex / "text" / "prompt.txt")},
          compile=True)
run.run()
out["text"] = run.engine.compiled.stats.to_json()
inputs = {"Txt": str(ex / "video" / "caption.txt"), "Vid": str(ex / "video" / "patch.npy")}
run = Run(compile_file(ex / "video.lmpm"), inputs=inputs, compile=True)
run.run(2)
out["video"] = run.engine.compiled.stats.to_json()
out["wall_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def compile_time() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        got = []
        for _ in ("cold", "warm"):
            proc = subprocess.run(
                [sys.executable, "-c", _CHILD, str(EX)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            )
            got.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    row: dict[str, Any] = {"benchmark": "compile", "case": "compile_time"}
    for label, g in zip(("cold", "warm"), got):
        row[f"process_{label}_s"] = round(g["wall_s"], 2)  # both runs, models compiled too
        for case in ("text", "video"):
            row[f"{case}_{label}_s"] = g[case]["compile_seconds"]
            row[f"{case}_{label}_graphs"] = g[case]["compiles"]
            row[f"{case}_{label}_cache_hits"] = g[case]["cache_hits"]
    return row


def cli_wall() -> dict[str, Any]:
    """What a user waits for: `lmpm run examples/text.lmpm` as a command, eager, then `--compile`
    with an empty inductor cache (cold) and again with the cache it filled (warm); the same
    commits each time."""
    walls: dict[str, float] = {}
    outs: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "cache"))
        for label in ("eager", "cold", "warm"):
            out = Path(tmp) / label
            cmd = [sys.executable, "-m", "lmpm", "run", str(EX / "text.lmpm"), "--input",
                   f"Txt={EX / 'text' / 'prompt.txt'}", "--out", str(out), "--quiet"]  # fmt: skip
            t0 = time.perf_counter()
            subprocess.run(
                cmd + ([] if label == "eager" else ["--compile"]),
                env=env,
                capture_output=True,
                check=True,
                timeout=600,
            )
            walls[label] = time.perf_counter() - t0
            outs[label] = (out / "Txt.npy").read_bytes()
    assert outs["cold"] == outs["eager"] == outs["warm"], "compiled commits differ from eager"
    return {
        "benchmark": "compile",
        "case": "cli_wall",
        "program": "examples/text.lmpm",
        "eager_s": round(walls["eager"], 2),
        "compiled_cold_s": round(walls["cold"], 2),
        "compiled_warm_s": round(walls["warm"], 2),
        "warm_over_eager": round(walls["warm"] / walls["eager"], 2),
        "cold_over_eager": round(walls["cold"] / walls["eager"], 2),
    }


def on_device(device: str, epochs: int, repeats: int, long_epochs: int) -> list[dict[str, Any]]:
    """``--device cuda``: the text and video examples with their payload on the GPU, eager and
    compiled (each step a CUDA graph, lmpm.runtime.data.captured), alternating in one process: the
    host time outside the model per epoch (p10, µs) and its share of the epoch; the same outputs
    both ways; then ``long_epochs`` compiled text epochs (runs of the example back to back) and
    the graphs compiled over them after the warm-up (goal 0). ``--device simcuda``: the same on
    the simulated device (lmpm.workers.simcuda), a dry run of this path on a CPU (its times
    measure the simulation, not a GPU)."""
    from lmpm.workers.simcuda import simulated_cuda

    if device == "cuda" and not torch.cuda.is_available():
        return [{"benchmark": "compile", "case": "device", "skipped": "no CUDA device"}]
    sim = simulated_cuda() if device == "simcuda" else contextlib.nullcontext()
    cases = (
        ("text", {"Txt": str(EX / "text" / "prompt.txt")}, None),
        (
            "video",
            {"Txt": str(EX / "video" / "caption.txt"), "Vid": str(EX / "video" / "patch.npy")},
            epochs,
        ),
    )
    rows = []
    with sim, _models_eager():
        for name, inputs, n in cases:
            front = compile_file(EX / f"{name}.lmpm")

            def make(c: bool, front: Any = front, inputs: Any = inputs) -> Run:
                return Run(front, inputs=inputs, seed=0, backend=device, compile=c)

            runs = alternate(make, n, repeats)
            row: dict[str, Any] = {"benchmark": "compile", "case": f"{name}_{device}"}
            outside_model(runs, row)
            stats = runs[True][-1][0].engine.compiled.stats  # type: ignore[union-attr]
            row["captures_per_run"] = stats.captures
            row["outside_ratio"] = round(
                row["eager_outside_us_p10"] / row["compiled_outside_us_p10"], 2
            )
            if name == "text":
                row["goal_outside_us"] = 50
            else:
                row["goal_share"] = 0.05
            row["device"] = device
            rows.append(row)
        rows.append(_long_run(device, long_epochs))
    return rows


@contextlib.contextmanager
def _models_eager() -> Iterator[None]:
    """The built-in text models run eagerly on both sides: what ``--device`` measures is the host
    time outside the model, and compiling ByteLM's forward for the GPU would add minutes of
    inductor time to the check (its own gain: benchmarks/model_compile.py)."""
    fns = (text_models.byte_lm, text_models.text_score)
    saved = [getattr(fn, COMPILE_ATTR) for fn in fns]
    for fn in fns:
        setattr(fn, COMPILE_ATTR, False)
    try:
        yield
    finally:
        for fn, flag in zip(fns, saved):
            setattr(fn, COMPILE_ATTR, flag)


def _long_run(device: str, epochs: int) -> dict[str, Any]:
    """Compiled text epochs back to back (whole runs of the example) until ``epochs``: how many
    graphs were compiled after the first run (goal 0: one graph per bucket, reused)."""
    front = compile_file(EX / "text.lmpm")
    prompt = {"Txt": str(EX / "text" / "prompt.txt")}
    done = runs = compiles = 0
    t0 = time.perf_counter()
    while done < epochs:
        run = Run(front, inputs=prompt, seed=0, backend=device, compile=True)
        done += run.run().epochs
        if runs:  # the first run compiles (or finds in the process) its graphs
            compiles += run.engine.compiled.stats.compiles  # type: ignore[union-attr]
        runs += 1
    return {
        "benchmark": "compile",
        "case": f"recompiles_{device}",
        "epochs": done,
        "runs": runs,
        "compiles_after_first_run": compiles,
        "goal": 0,
        "seconds": round(time.perf_counter() - t0, 2),
    }


# A capturable workload for K epochs per replay (lmpm.runtime.data.kepochs): the bundled examples'
# models read on the host, so none replays more than one epoch. Two values on a W×W grid, red-black,
# a pure torch model of the neighbours and the epoch (tests/runtime/test_kepochs.py imports it).
K_PROG = """param W = {w}
value A : Token[16] shape Grid2D(W, W) clock Lamport
value B : Token[16] shape Grid2D(W, W) clock Lamport
value MaskPlan : Event shape Set() clock Lamport
visible A[x,y] <- A[x+dx,y+dy] when (dx,dy) in N4
visible B[x,y] <- A[x,y]
visible B[x,y] <- B[x+dx,y+dy] when (dx,dy) in N4
rule GenA:
  on A[x,y]
  read {{nb in N4}}
  emit proposal A[x,y] := Mix(nb, k=3)
rule GenB:
  on B[x,y]
  read {{a = A[x,y], nb in N4}}
  emit proposal B[x,y] := Mix(a, nb, k=2)
constraint Odd:
  forbid A[x,y] in Set(1, 3, 5, 7, 9, 11) priority 10
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""


def mix(inputs: dict[str, torch.Tensor], *, k: int = 1, epoch: Any = 0, **_: Any) -> Any:
    """A capturable model: proposals and scores from the neighbours, the cell and the epoch."""
    cells = inputs["cells"]
    total = cells * 5 + 3
    for name, t in inputs.items():
        if name.endswith("_mask"):
            total = total + torch.where(t, inputs[name.removesuffix("_mask")] + 1, 0).sum(dim=1) * 3
    raw = total[:, None] + torch.arange(int(k), device=cells.device)[None, :] * 7 + epoch * 11
    return raw % 16, -((raw * 13) % 7).to(torch.float64)


mix.lmpm_capture = True  # type: ignore[attr-defined]


def per_replay(
    device: str, ks: list[int], epochs: int, repeats: int, w: int
) -> list[dict[str, Any]]:
    """``--epochs-per-replay``: K = each of ``ks`` epochs per CUDA-graph replay of the capturable
    workload above, ``epochs`` epochs per run, the Ks alternating per repeat in one process: per
    K the wall time per epoch (best run; the host settles every epoch's records, so on a GPU this
    is host time), the host's time in the replays per windowed epoch, the ratio to K = 1, and
    whether the run committed what K = 1 committed. One JSON line per K."""
    from lmpm.ir import compile_source
    from lmpm.workers.simcuda import simulated_cuda

    if device == "cuda" and not torch.cuda.is_available():
        return [{"benchmark": "compile", "case": "epochs_per_replay", "skipped": "no CUDA device"}]
    sim = simulated_cuda() if device == "simcuda" else contextlib.nullcontext()
    front = compile_source(K_PROG.format(w=w), raise_errors=False)
    best: dict[int, float] = {}
    host: dict[int, float] = {}
    same: dict[int, bool] = {}
    with sim:
        for rep in range(repeats + 1):  # the first round warms the graphs up, untimed
            want = None
            for k in ks:
                run = Run(
                    front,
                    bindings={"Mix": mix},
                    backend=device,
                    compile=True,
                    epochs_per_replay=k,
                    keep_records=False,
                )
                t0 = time.perf_counter()
                run.run(epochs)
                dt = (time.perf_counter() - t0) / epochs
                got = [run.payload(n).cpu() for n in ("A", "B")]
                if want is None:
                    want = got
                same[k] = same.get(k, True) and all(torch.equal(a, b) for a, b in zip(want, got))
                if rep:
                    best[k] = min(best.get(k, dt), dt)
                    ws = run.engine.windows
                    if ws is not None and ws.stats.epochs:
                        host[k] = ws.stats.host_seconds / ws.stats.epochs
    rows = []
    for k in ks:
        rows.append(
            {
                "benchmark": "compile",
                "case": f"epochs_per_replay_{device}",
                "k": k,
                "cells": 2 * w * w,
                "epochs": epochs,
                "epoch_us": round(best[k] * 1e6, 1),
                "replay_host_us_per_epoch": round(host[k] * 1e6, 1) if k in host else None,
                "ratio_vs_k1": round(best[ks[0]] / best[k], 2),
                "same_commits_as_k1": same[k],
                "device": device,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=12, help="video epochs per run")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and epochs")
    ap.add_argument("--no-compile-time", action="store_true", help="skip the cold/warm processes")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda", "simcuda"],
        default="cpu",
        help="cuda: the examples' epochs with the payload on the GPU, eager and compiled (each "
        "step a CUDA graph); simcuda: the same on the simulated device (a dry run)",
    )
    ap.add_argument(
        "--long-epochs",
        type=int,
        default=None,
        help="--device: compiled text epochs run back to back, counting recompilations "
        "(default 10,000; 1,000 with --quick)",
    )
    ap.add_argument(
        "--epochs-per-replay",
        default="",
        metavar="K,...",
        help="only K epochs per CUDA-graph replay (e.g. 1,2,4,8,16) of a capturable workload on "
        "--device cuda or simcuda: per K the time per epoch and its ratio to the first K",
    )
    ap.add_argument("--k-width", type=int, default=32, help="--epochs-per-replay: the grid's side")
    a = ap.parse_args()
    if a.epochs_per_replay:
        ks = [int(k) for k in a.epochs_per_replay.split(",")]
        # the first cycle single, then whole windows (a run captures its windows' graphs once)
        epochs = 2 + (2 if a.quick else 16) * max(ks)
        for row in per_replay(a.device, ks, epochs, 1 if a.quick else 4, a.k_width):
            print(json.dumps(row), flush=True)
        return
    if a.quick:
        a.repeats, a.epochs = 3, 6
    if a.long_epochs is None:
        a.long_epochs = 1_000 if a.quick else 10_000
    if a.device != "cpu":
        for row in on_device(a.device, a.epochs, a.repeats, a.long_epochs):
            print(json.dumps(row), flush=True)
        return
    torch.set_num_threads(2)
    t = time.perf_counter()
    for row in (
        text(a.repeats),
        video(a.epochs, a.repeats),
        throughput(3 if a.quick else 6, 2 if a.quick else 3),
    ):
        print(json.dumps(row), flush=True)
    if not a.no_compile_time:
        print(json.dumps(compile_time()), flush=True)
        print(json.dumps(cli_wall()), flush=True)
    print(f"# {time.perf_counter() - t:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
