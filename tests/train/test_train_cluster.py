"""A training run across a 2-node Ray cluster (Ray's own multi-node test cluster, on this machine):
the workers are spread over the nodes; a node lost between epochs takes its worker with it; the
supervisor replaces it on the node left, and the run finishes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent


def test_training_across_two_nodes_survives_losing_one(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "ray_cluster_train.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert len(set(got["nodes"])) == 2  # one worker per node
    assert len(set(got["nodes_after"])) == 1  # both on the node left
    assert got["epochs"] == 4 and got["status"] == "finished" and got["checksums"] == 4
    lost = f"w{got['nodes'].index(got['removed'])}"
    assert [(f["worker"], f["epoch"], f["cause"]) for f in got["faults"]] == [(lost, 3, "died")]
