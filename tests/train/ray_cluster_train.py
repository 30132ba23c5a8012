"""A training run across a 2-node Ray cluster on this machine (ray.cluster_utils.Cluster), run by
test_train_cluster.py as a real subprocess (Ray allows one cluster per driver process).

    python ray_cluster_train.py OUT_JSON

Trains the byte model of examples/train_bytelm.lmpm (H = 3) on 2 workers spread over the 2 nodes;
after epoch 2 the second node goes away with its worker; the supervisor replaces the worker on the
node left and the run finishes. Writes where the workers ran and what the log holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

from ray.cluster_utils import Cluster

from lmpm.ir import compile_file
from lmpm.train import log as tlog
from lmpm.train.frontend import train_spec
from lmpm.train.run import Trainer, load_rows

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    out = Path(sys.argv[1])
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    import ray

    ray.init(address=cluster.address, logging_level=logging.ERROR)
    spec = train_spec(compile_file(ROOT / "examples" / "train_bytelm.lmpm").ir, {"H": 3, "B": 2})
    assert spec is not None
    data = {
        d.name: load_rows(ROOT / "examples" / "train" / f"{d.name.lower()}.npy", d)
        for d in (*spec.rule.data, *spec.rule.eval_data)
    }
    run_dir = out.parent / "run"
    removed: dict[str, str] = {}
    t: Trainer | None = None

    def progress(r: object) -> None:
        if getattr(r, "epoch", 0) == 2 and not removed:
            removed["node"] = node.node_id
            cluster.remove_node(node)  # between epochs: the worker there goes with it

    t = Trainer(
        dataclasses.replace(spec),
        data,
        epochs=4,
        workers=2,
        driver="ray",
        run_dir=run_dir,
        cluster=cluster.address,
        progress=progress,
    )
    nodes = t.driver.nodes()  # type: ignore[union-attr]
    t.driver.close = lambda: None  # type: ignore[method-assign]  # look at the workers after
    res = t.run()
    after = t.driver.nodes()  # type: ignore[union-attr]
    h = tlog.read(run_dir)
    out.write_text(
        json.dumps(
            {
                "nodes": nodes,
                "nodes_after": after,
                "removed": removed["node"],
                "epochs": len(res.epochs),
                "status": h.meta["status"],
                "faults": h.faults,
                "checksums": len({e["checksum"] for e in h.epochs}),
            }
        )
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
