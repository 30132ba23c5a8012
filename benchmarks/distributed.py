"""Distributed runtime: what crosses between the planes and between the workers.

Case ``halo``: examples/latent.lmpm with ``Z`` and ``M`` as ``Tensor[256]`` values (1 KiB per cell)
on a 16×16 grid, run by 4 in-process partitioned workers (:class:`lmpm.runtime.group.WorkerGroup`;
the topology of :func:`lmpm.resolve.topology.partition`). Per epoch it counts the control-plane
bytes (every message between the control plane and each worker, ``protocol.nbytes``: metadata
only) and the halo bytes (payload of the changed routed cells moved worker to worker). Prints one
JSON line with their ratio (goal: control ≤ 1 % of halo).

    python benchmarks/distributed.py [--epochs 6] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmpm.resolve.topology import partition  # noqa: E402
from lmpm.runtime.engine import CHECKSUM_POLICIES  # noqa: E402
from lmpm.runtime.group import WorkerGroup  # noqa: E402
from lmpm.runtime.io import load_input  # noqa: E402
from lmpm.runtime.session import Run  # noqa: E402


def halo(epochs: int, workers: int = 4, side: int = 16, dim: int = 256) -> dict[str, object]:
    params = {"W": side, "H": side, "D": dim}
    run = Run.from_file(ROOT / "examples" / "latent.lmpm", params=params, seed=0)
    topo = partition(run.plan, workers)
    group = WorkerGroup(
        run.plan, workers, topology=topo, seed=0, checksum_policies=CHECKSUM_POLICIES
    )
    group.count_messages = True
    run.engine.dataplane = run.dataplane = group
    with tempfile.TemporaryDirectory() as tmp:
        z = np.random.default_rng(0).normal(size=(side, side, dim)).astype(np.float32) * 0.3
        path = Path(tmp) / "z.npy"
        np.save(path, z)
        payload, mask = load_input(str(path), run.plan.values["Z"])
        run.set_input("Z", payload, mask)
    control = halo_bytes = 0
    for _ in range(epochs):
        run.engine.step()
        control += group.message_bytes
        halo_bytes += group.halo_bytes
    return {
        "case": "halo",
        "program": f"examples/latent.lmpm W={side} H={side} D={dim} (Tensor[{dim}])",
        "workers": workers,
        "layout": topo.layout,
        "epochs": epochs,
        "control_bytes_per_epoch": control / epochs,
        "halo_bytes_per_epoch": halo_bytes / epochs,
        "ratio": control / max(halo_bytes, 1),
        "goal": "ratio <= 0.01",
        "met": control <= 0.01 * halo_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="3 epochs")
    args = ap.parse_args()
    print(json.dumps(halo(3 if args.quick else args.epochs)))


if __name__ == "__main__":
    main()
