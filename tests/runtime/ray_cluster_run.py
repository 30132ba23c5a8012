"""A run across a 2-node Ray cluster on this machine (ray.cluster_utils.Cluster), run by
test_ray_cluster.py as a real subprocess (Ray allows one cluster per driver process).

    python ray_cluster_run.py OUT_JSON

Runs examples/latent.lmpm on 2 workers spread over the 2 nodes, removes the second node (with its
worker) after 3 epochs, and writes what the run committed and where the workers ran.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
from ray.cluster_utils import Cluster

from lmpm.runtime.session import Run

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    out = Path(sys.argv[1])
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    args = {
        "params": {},
        "seed": 4,
        "inputs": {"Z": ROOT / "examples" / "latent" / "z0.npy"},
    }
    one = Run.from_file(ROOT / "examples" / "latent.lmpm", **args)
    one.run(6)
    ref = one.outputs()
    import ray

    ray.init(address=cluster.address, logging_level=logging.ERROR)
    run = Run.from_file(
        ROOT / "examples" / "latent.lmpm", workers=2, cluster=cluster.address, **args
    )
    group = run.dataplane
    nodes = group.nodes()
    run.run(3)
    cluster.remove_node(node)  # the second node goes away, with its worker, between epochs
    res = run.run(6)  # epochs 3..5
    got = run.outputs()
    faults = [f.to_json() for f in group.faults]
    after = group.nodes()
    run.close()
    ray.shutdown()
    cluster.shutdown()
    out.write_text(
        json.dumps(
            {
                "nodes": nodes,
                "removed": node.node_id,
                "nodes_after": after,
                "faults": faults,
                "epochs": res.epochs,
                "same": {k: bool(np.array_equal(ref[k], got[k], equal_nan=True)) for k in ref},
            }
        )
    )


if __name__ == "__main__":
    main()
