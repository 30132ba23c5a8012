"""Distributed runtime: scaling over worker processes, the control plane's cost per epoch, what
crosses between the planes and between the workers, and recovery from a killed worker.

One JSON line per case, baseline and LMPM side by side in this process:

- ``scaling``: the seed's video program (examples/video.lmpm) at 16×64×64 with its trained
  LocalGen proposer (the embedded model at full size), one in-process worker vs 2 Ray workers
  (one process each; ``--workers N`` for another count), each worker with one torch thread. The
  baseline is timed with 1 and with 2 torch threads and the faster counts (``ratio``; on an idle
  2-core machine torch's own threads already use both cores); ``ratio_vs_one_thread`` compares
  equal threads per worker. Median epoch time after a warm-up epoch; the commits are checked equal.
  Goal: ≥ 1.6× with 2 workers on 2 cores (≥ 5× with 8 on 16 cores, where such a machine exists).
- ``control``: the same program at 4×32×32 with a null model (random tokens), one in-process
  worker vs 4 Ray workers: the milliseconds each epoch costs above the one-worker epoch (goal
  ≤ 3 ms), and the control plane's own cost, the driver process's CPU time per epoch
  (``EpochRecord.driver_cpu_s``; goal ≤ 2 ms; 4 workers on 2 cores share them, so CPU time, not
  wall), next to the wall time per epoch.
- ``halo``: examples/latent.lmpm with ``Z`` and ``M`` as ``Tensor[256]`` values (1 KiB per cell),
  2 in-process partitioned workers, on a 32×32 and a 64×64 grid side by side: the bytes into and
  out of the control plane per epoch (``EpochRecord.control_bytes``: every message between the
  control plane and each worker, serialised as it would cross a process boundary) and the halo
  bytes (payload of the changed routed cells moved worker to worker). Goals: control bytes
  independent of the open cells, 64×64 at most 1.25× 32×32 (``growth``), and at most 1 % of the
  halo at 64×64 (``ratio``).
- ``recovery``: the video program at 8×64×64 with LocalGen on 2 Ray workers; a timer SIGKILLs
  worker w1's process in the middle of an epoch (from outside, as the OOM killer would); the time
  from the kill to the end of the redone epoch, minus one epoch. Goal ≤ 5 s. The commits are
  checked equal to an uninterrupted run's.

    python benchmarks/distributed.py [--quick] [--case scaling|control|halo|recovery]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import runtime as bench_runtime  # noqa: E402  (benchmarks/runtime.py: the null-model bindings)
from lmpm.resolve.topology import partition  # noqa: E402
from lmpm.runtime.data.group import WorkerGroup  # noqa: E402
from lmpm.runtime.io import load_input  # noqa: E402
from lmpm.runtime.records import CHECKSUM_POLICIES, EpochRecord  # noqa: E402
from lmpm.runtime.session import Run  # noqa: E402

NULL = bench_runtime.BINDINGS

VIDEO = ROOT / "examples" / "video.lmpm"
CAPTION = ROOT / "examples" / "video" / "caption.txt"


def _ray() -> Any:
    import ray

    # the null bindings live in a script the worker processes cannot import: send them by value
    ray.cloudpickle.register_pickle_by_value(bench_runtime)
    if not ray.is_initialized():
        ray.init(
            address="local",  # a new local instance, never a cluster started elsewhere
            num_cpus=max(os.cpu_count() or 1, 8),
            include_dashboard=False,
            logging_level=logging.ERROR,
            _node_ip_address="127.0.0.1",
        )
    return ray


def _video(params: dict[str, int], workers: int, bindings: dict[str, Any] | None = None) -> Run:
    return Run.from_file(
        VIDEO,
        params=params,
        bindings=bindings,
        seed=0,
        inputs={"Txt": CAPTION},
        workers=workers,
        driver="ray" if workers > 1 else None,
    )


def _run_epochs(run: Run, epochs: int) -> list[EpochRecord]:
    """Run ``epochs`` more epochs as `lmpm run` runs them (``Engine.run``, keeping no records:
    the per-cell records travel only where an observer, a run directory's log, writes them);
    their epoch records (counts)."""
    run.engine.keep_records = False
    records: list[EpochRecord] = []
    run.engine.run(epochs=run.engine.epoch + epochs, progress=records.append)
    return records


def _epochs(run: Run, epochs: int) -> tuple[list[float], list[torch.Tensor], list[EpochRecord]]:
    """Epoch wall times (after one warm-up epoch), the payload after the run and the records."""
    records = _run_epochs(run, epochs + 1)[1:]
    times = [r.seconds for r in records]
    return times, [run.payload(v) for v in sorted(run.plan.values)], records


def scaling(epochs: int, workers: int) -> dict[str, Any]:
    _ray()
    params = {"T": 16, "W": 64, "H": 64}
    torch.set_num_threads(2)
    with _video(params, 1) as run:
        two_threads, _, _ = _epochs(run, max(epochs // 2, 2))
    torch.set_num_threads(1)
    with _video(params, 1) as run:
        one, ref, _ = _epochs(run, epochs)
    with _video(params, workers) as run:
        many, got, _ = _epochs(run, epochs)
    same = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    single, mine = statistics.median(one), statistics.median(many)
    best = min(single, statistics.median(two_threads))  # the baseline at its fastest
    return {
        "case": "scaling",
        "program": "examples/video.lmpm T=16 W=64 H=64, LocalGen (trained, full size)",
        "workers": workers,
        "cores": os.cpu_count(),
        "epochs": epochs,
        "one_worker_s": best,
        "one_worker_by_threads_s": {"1": single, "2": statistics.median(two_threads)},
        "workers_s": mine,
        "ratio": best / mine,
        "ratio_vs_one_thread": single / mine,
        "identical": same,
        "goal": 1.6 if workers == 2 else 5.0 if workers == 8 else None,
    }


def control(epochs: int, workers: int = 4) -> dict[str, Any]:
    _ray()
    params = {"T": 4, "W": 32, "H": 32, "N": 77, "x1": 0, "x2": 7, "y1": 0, "y2": 7}
    torch.set_num_threads(1)
    with _video(params, 1, NULL) as run:
        one, ref, one_recs = _epochs(run, epochs)
    with _video(params, workers, NULL) as run:
        group = run.dataplane
        trips0 = group.round_trips
        many, got, recs = _epochs(run, epochs)
        trips = (group.round_trips - trips0) / (epochs + 1)
    base, mine = statistics.median(one), statistics.median(many)
    cpu = statistics.median(r.driver_cpu_s for r in recs)
    return {
        "case": "control",
        "program": "examples/video.lmpm T=4 W=32 H=32, null model",
        "workers": workers,
        "epochs": epochs,
        "one_worker_ms": 1e3 * base,
        "workers_ms": 1e3 * mine,
        "above_ms": 1e3 * (mine - base),
        # the driver process's CPU time per epoch (the one-worker run's holds the model's too)
        "driver_cpu_ms": 1e3 * cpu,
        "one_worker_cpu_ms": 1e3 * statistics.median(r.driver_cpu_s for r in one_recs),
        "control_bytes_per_epoch": statistics.mean(r.control_bytes for r in recs),
        "round_trips_per_epoch": trips,
        "identical": all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)),
        "goal": 3.0,
        "driver_cpu_goal": 2.0,
    }


def _latent(epochs: int, workers: int, side: int, dim: int) -> dict[str, Any]:
    """examples/latent.lmpm on a side×side grid of ``Tensor[dim]`` cells, ``workers`` in-process
    partitioned workers: per epoch, the bytes into and out of the control plane (serialised) and
    their tensor data, the halo bytes, the open cells."""
    params = {"W": side, "H": side, "D": dim}
    run = Run.from_file(ROOT / "examples" / "latent.lmpm", params=params, seed=0)
    topo = partition(run.plan, workers)
    group = WorkerGroup(
        run.plan, workers, topology=topo, seed=0, checksum_policies=CHECKSUM_POLICIES
    )
    run.engine.dataplane = run.dataplane = group
    with tempfile.TemporaryDirectory() as tmp:
        z = np.random.default_rng(0).normal(size=(side, side, dim)).astype(np.float32) * 0.3
        path = Path(tmp) / "z.npy"
        np.save(path, z)
        payload, mask = load_input(str(path), run.plan.values["Z"])
        run.set_input("Z", payload, mask)
    recs = _run_epochs(run, epochs)
    return {
        "layout": topo.layout,
        "open_cells_per_epoch": statistics.mean(r.open_cells for r in recs),
        "control_bytes_per_epoch": statistics.mean(r.control_bytes for r in recs),
        "message_bytes_per_epoch": statistics.mean(r.message_bytes for r in recs),
        "halo_bytes_per_epoch": statistics.mean(r.halo_bytes for r in recs),
    }


def halo(epochs: int, workers: int = 2, dim: int = 256) -> dict[str, Any]:
    small = _latent(epochs, workers, 32, dim)
    large = _latent(epochs, workers, 64, dim)
    control = large["control_bytes_per_epoch"]
    return {
        "case": "halo",
        "program": f"examples/latent.lmpm W=H=32 and 64, D={dim} (Tensor[{dim}])",
        "workers": workers,
        "epochs": epochs,
        "grid_32": small,
        "grid_64": large,
        # the goals: control bytes independent of the open cells, and a sliver of the halo
        "growth": control / max(small["control_bytes_per_epoch"], 1),
        "ratio": control / max(large["halo_bytes_per_epoch"], 1),
        "growth_goal": 1.25,
        "goal": 0.01,
    }


def recovery(epochs: int, kill_epoch: int = 3) -> dict[str, Any]:
    _ray()
    params = {"T": 8, "W": 64, "H": 64}
    torch.set_num_threads(1)
    with _video(params, 2) as run:
        normal, ref, _ = _epochs(run, epochs)
    with _video(params, 2) as run:
        group = run.dataplane
        run.engine.step()
        while run.engine.epoch < kill_epoch:
            run.engine.step()
        epoch_s = statistics.median(normal)
        pid = group.pids()[1]
        killed: list[float] = []

        def kill() -> None:
            killed.append(time.perf_counter())
            os.kill(pid, signal.SIGKILL)

        timer = threading.Timer(epoch_s / 2, kill)  # mid-epoch
        timer.start()
        rec = run.engine.step()
        done = time.perf_counter()
        timer.join()
        while run.engine.epoch < epochs + 1:
            run.engine.step()
        got = [run.payload(v) for v in sorted(run.plan.values)]
    lost = done - killed[0] - epoch_s
    return {
        "case": "recovery",
        "program": "examples/video.lmpm T=8 W=64 H=64, LocalGen, 2 Ray workers",
        "epoch_s": epoch_s,
        "kill_to_progress_s": lost,
        "faults": [f.to_json() for f in rec.faults],
        "identical": all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)),
        "goal": 5.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer epochs")
    ap.add_argument("--case", action="append", choices=["scaling", "control", "halo", "recovery"])
    ap.add_argument("--workers", type=int, default=2, help="workers of the scaling case")
    args = ap.parse_args()
    cases = args.case or ["scaling", "control", "halo", "recovery"]
    for case in cases:
        if case == "scaling":
            line = scaling(3 if args.quick else 6, args.workers)
        elif case == "control":
            line = control(10 if args.quick else 30)
        elif case == "halo":
            line = halo(3 if args.quick else 6)
        else:
            line = recovery(5 if args.quick else 8)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
