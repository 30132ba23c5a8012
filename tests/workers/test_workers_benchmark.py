"""benchmarks/backends.py: the Monty model's two nearest-node searches and the benchmark's own check.

The script exits non-zero (SystemExit with the graph named) when LMPM's outputs differ from the
baseline's, so running it at a tiny scale keeps the Monty-style update, the small-model workload and
the GPU path's dry run (``--only cuda --device cpu``) honest between benchmark runs. The model's
torch search (the GPU path) is compared here with scipy's KD-tree and with Monty's per-object
numpy loop, on the CPU and, where there is one, on a GPU. Timings are never looked at.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from lmpm.workers import get_backend

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("--scale", "0.03", "--repeat", "1", "--threads", "1")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),  # conftest skips it without a CUDA device
]


def _load_backends() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_backends", ROOT / "benchmarks/backends.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load_backends()


def _run(*args: str) -> dict[str, dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "backends.py"), *SMALL, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    return {str(line["workload"]): line for line in lines}


def test_backends_benchmark_outputs_agree_at_small_scale() -> None:
    workloads = _run()
    assert {"monty", "small_model", "cuda"} <= set(workloads)
    for name in ("monty", "small_model"):
        line = workloads[name]
        assert isinstance(line["baseline_s"], float) and isinstance(line["lmpm_s"], float)
        assert line["baseline_s"] > 0 and line["lmpm_s"] > 0
    params = workloads["monty"]["params"]
    assert isinstance(params, dict) and params["k"] == 3


def test_cuda_workload_dry_run_on_the_cpu_prints_the_gpu_line() -> None:
    """``--only cuda --device cpu`` runs the GPU code path on the CPU backend: same JSON fields as
    on a GPU, outputs checked against Monty's loop before printing (else the script exits 1)."""
    line = _run("--only", "cuda", "--device", "cpu")["cuda"]
    assert line["backend"] == "cpu" and line["dry_run"] is True
    assert str(line["device"]).startswith("cpu")
    for field in ("baseline_s", "lmpm_s", "ratio", "lmpm_to_host_s", "dispatch_s"):
        assert isinstance(line[field], float), field
    assert line["goal"] == 20.0
    # The cpu backend computes inside dispatch: the work is done when dispatch returns.
    assert line["ready_right_after_dispatch"] is True and line["dispatch_returns_first"] is False
    assert line["syncs_in_dispatch"] is None


@pytest.mark.parametrize("select", ["topk", "rounds"])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_monty_model_equals_monty_loop_and_kdtree(device: str, select: str) -> None:
    """The torch search (several chunks; either candidate selection) and the KD-tree give the same
    K nodes in the same order, and the whole update on ``device`` equals Monty's per-object numpy
    loop."""
    data = bench.make_monty(2, 3, 40, nodes=(20, 60), seed=3)
    trees = [bench.cKDTree(g.nodes) for g in data.graphs]
    with ThreadPoolExecutor(2) as pool:
        base = bench.monty_baseline(data, trees, pool)
    torch_model = bench.MontyUpdate(
        data.graphs, device=device, knn="torch", chunk=40 * 60 * 2, select=select
    )
    tree_model = bench.MontyUpdate(data.graphs, knn="tree")
    backend = get_backend(device)
    bench.put_monty(data, backend)
    ours = bench.monty_resident(data, torch_model, backend)
    assert ours[0][0].device.type == "cpu"  # collect hands results to the host
    bench.check_monty(base, ours)  # SystemExit naming the graph when they differ
    cells = bench.monty_cells(data)
    search = torch.stack([loc for _, _, loc in ours])
    graph = cells["graph"]
    by_tree = tree_model.nearest(graph, search)
    by_torch = torch_model.nearest(graph.to(device), search.to(device)).cpu()
    assert torch.equal(by_torch, by_tree)
    if device == "cuda":  # the GPU path never waits for the device inside dispatch
        timing = bench.time_dispatch(backend, bench.monty_item(data, torch_model))
        assert timing["syncs_in_dispatch"] == 0, timing["sync_sites"]


@pytest.mark.parametrize("select", ["topk", "rounds"])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_search_breaks_ties_by_node_index(device: str, select: str) -> None:
    """Four nodes at exactly distance 1 from the hypothesis: the three lowest indices win, nearest
    (then lowest index) first; a graph smaller than the padding never yields a pad row."""
    unit = np.array([[0, 0, 2], [1, 0, 0], [-1, 0, 0], [0, 0, 3], [0, 1, 0], [0, -1, 0]], float)
    n = unit.shape[0]
    small = unit[:4]  # 4 nodes: distances 2, 1, 1, 3

    def graph(nodes: np.ndarray) -> Any:
        k = nodes.shape[0]
        return bench.Graph(nodes, np.zeros((k, 9)), np.ones(k, bool), np.zeros((k, 5)))

    model = bench.MontyUpdate(
        [graph(unit), graph(small)], device=device, knn="torch", select=select
    )
    search = torch.zeros(2, 1, 3, dtype=torch.float64, device=device)
    got = model.nearest(torch.tensor([0, 1], device=device), search).cpu()
    assert got[0, 0].tolist() == [1, 2, 4]  # distances 1, 1, 1 (node 5 ties too, and loses)
    assert got[1, 0].tolist() == [1, 2, 0]  # distances 1, 1, 2; pads (rows 4, 5) never picked
    assert model.nmax == n


def test_selection_by_rounds_is_the_k_smallest() -> None:
    """Against a stable sort: the k smallest of random rows with many ties (the lower index wins),
    and a row of k pads (the largest finite key) among keys already picked (+inf)."""
    gen = torch.Generator().manual_seed(5)
    key = torch.randint(0, 40, (64, 30), generator=gen).float()
    key[0, :] = torch.inf
    key[0, 20:25] = torch.finfo(torch.float32).max
    got = bench.smallest_by_rounds(key.clone(), 5).sort(-1).values
    assert torch.equal(got, key.sort(dim=-1, stable=True).indices[:, :5].sort(-1).values)
    assert got[0].tolist() == [20, 21, 22, 23, 24]


def test_the_gpu_path_runs_on_the_simulated_device_without_waiting_for_it() -> None:
    """The Monty update on ``cuda`` (the simulated device: the CUDA backend, its default candidate
    selection): every tensor on the device, no device mixing, nothing in the model that makes the
    host wait for the GPU, and the outputs of Monty's loop."""
    from lmpm.workers.simcuda import SimCudaBackend, simulated_cuda

    data = bench.make_monty(2, 3, 40, nodes=(20, 60), seed=4)
    trees = [bench.cKDTree(g.nodes) for g in data.graphs]
    with ThreadPoolExecutor(2) as pool:
        base = bench.monty_baseline(data, trees, pool)
    with simulated_cuda() as sim:
        model = bench.MontyUpdate(data.graphs, device="cuda", knn="torch", chunk=40 * 60 * 2)
        backend = SimCudaBackend(results_to_host=False)
        bench.put_monty(data, backend)
        item = bench.monty_item(data, model)
        before = len(sim.warnings)  # the model's and the hypotheses' one-time copies are before
        handle = backend.dispatch(item)
        waits = sim.warnings[before:]
        ours = backend.collect(handle).groups[0]
        assert model.select == "rounds" and ours.proposal.device.type == "cuda"
        outs = list(zip(ours.proposal, ours.aux["nearest"], ours.aux["location"]))
        outs = [tuple(t.cpu() for t in o) for o in outs]
    assert not sim.errors and not waits, [*sim.errors, *waits]
    bench.check_monty(base, outs)
