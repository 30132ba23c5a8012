"""A run across a 2-node Ray cluster (Ray's own multi-node test cluster, on this machine): the
workers are spread over the nodes, a node lost between epochs takes its worker with it, the
worker is replaced on the node left, and the run commits what one worker commits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent


def test_a_run_across_two_nodes_survives_losing_one(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "ray_cluster_run.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert len(set(got["nodes"])) == 2  # one worker per node
    assert len(set(got["nodes_after"])) == 1  # both on the node left
    assert got["same"] == {"Z": True, "M": True}
    assert got["epochs"] == 3
    lost = f"w{got['nodes'].index(got['removed'])}"  # the worker that ran on the removed node
    # the survivor's exchange with the lost worker broke too: it is kept ("blocked"), not replaced
    seen = {(f["worker"], f["epoch"], f["cause"]) for f in got["faults"]}
    assert (lost, 3, "died") in seen
    assert all(c == "blocked" for w, _, c in seen if w != lost)
