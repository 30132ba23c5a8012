"""Partitioned workers: the in-process group of W = 2, 3, 4 workers commits exactly what one
worker commits (payload, clocks, provenance, scores, every epoch) on the examples, and only the
changed halo cells move between workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmpm.errors import UsageError
from lmpm.resolve.topology import partition
from lmpm.runtime.data.group import WorkerGroup
from lmpm.runtime.io import load_input
from lmpm.runtime.records import CHECKSUM_POLICIES
from lmpm.runtime.session import Run

EX = Path(__file__).resolve().parents[2] / "examples"
CASES: dict[str, tuple[Path, dict[str, Any], dict[str, Path], int]] = {
    "gpt": (EX / "gpt.lmpm", {"N": 12}, {}, 4),
    "text": (EX / "text.lmpm", {}, {"Txt": EX / "text" / "prompt.txt"}, 3),
    "sudoku": (EX / "sudoku.lmpm", {}, {"Grid": EX / "sudoku" / "puzzle.json"}, 4),
    "video": (
        EX / "video.lmpm",
        {"T": 2, "W": 16, "H": 16, "x1": 4, "x2": 11, "y1": 8, "y2": 13},
        {"Txt": EX / "video" / "caption.txt"},
        3,
    ),
    "latent": (EX / "latent.lmpm", {"W": 6, "H": 5, "D": 8}, {"Z": Path("z.npy")}, 4),
}


def _latent_input(tmp: Path) -> Path:
    z = np.random.default_rng(0).normal(size=(6, 5, 8)).astype(np.float32) * 0.3
    path = tmp / "z.npy"
    np.save(path, z)
    return path


def _run(
    name: str, workers: int, replicate_bytes: int = 0, tmp: Path | None = None
) -> tuple[list[Any], WorkerGroup | None]:
    path, params, inputs, epochs = CASES[name]
    run = Run.from_file(path, params=params, seed=3)
    group = None
    if workers > 1:
        topo = partition(run.plan, workers, replicate_bytes=replicate_bytes)
        group = WorkerGroup(
            run.plan, workers, topology=topo, seed=3, checksum_policies=CHECKSUM_POLICIES
        )
        run.engine.dataplane = run.dataplane = group
    for value, file in inputs.items():
        if name == "latent":
            assert tmp is not None
            file = _latent_input(tmp)
        payload, mask = load_input(str(file), run.plan.values[value])
        run.set_input(value, payload, mask)
    states = []
    for _ in range(epochs):
        run.engine.step()
        states.append(snapshot(run))
    return states, group


def snapshot(run: Run) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every value's (payload, committed, clock, rule, epoch, score) now."""
    return {
        v: (
            run.payload(v).clone(),
            st.committed.clone(),
            st.clock.clone(),
            st.rule.clone(),
            st.epoch.clone(),
            st.score.clone(),
        )
        for v, st in run.engine.state.items()
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_workers_commit_like_one_worker(name: str, tmp_path: Path) -> None:
    one, _ = _run(name, 1, tmp=tmp_path)
    for workers in (2, 3, 4):
        many, group = _run(name, workers, tmp=tmp_path)
        assert group is not None
        for e, (a, b) in enumerate(zip(one, many, strict=True)):
            for v in a:
                for what, x, y in zip(
                    ("payload", "committed", "clock", "rule", "epoch", "score"),
                    a[v],
                    b[v],
                    strict=True,
                ):
                    msg = f"{name} W={workers} epoch {e} {v}.{what}"
                    if what == "score":  # a batched float model: the last bits vary by batch
                        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), msg
                    else:
                        assert torch.equal(x, y), msg


def test_only_changed_halo_cells_move() -> None:
    _, group = _run("gpt", 3)
    assert group is not None
    topo = group.topology
    # gpt: each token reads every earlier token; every committed cell is read by later workers
    assert group.halo_bytes_total > 0
    assert group.halo_bytes_total <= 4 * topo.halo_bytes()  # at most every routed cell, 4 epochs
    assert group.halo_bytes <= topo.halo_bytes()
    # every worker's resident copy of what it reads equals the owner's payload
    for value in topo.owner:
        for r in range(3):
            halo = topo.halo_cells(value, r)
            ref, _ = group.read(value)
            mine = group.workers[r].payload[value]
            assert torch.equal(mine[halo], ref[halo])


def test_replicated_values_follow_worker_zero() -> None:
    one, _ = _run("sudoku", 1)
    many, group = _run("sudoku", 3, replicate_bytes=1 << 20)
    assert group is not None and all(group.topology.replicated.values())
    for a, b in zip(one, many, strict=True):
        for v in a:
            assert all(torch.equal(x, y) for x, y in zip(a[v][:5], b[v][:5], strict=True))
    for w in group.workers[1:]:
        assert torch.equal(w.payload["Cand"], group.workers[0].payload["Cand"])


def test_group_with_a_run_directory_resumes(tmp_path: Path) -> None:
    """The in-process group writes one payload store and one checkpoint shard per worker, and a
    run stopped after 5 epochs resumes to the uninterrupted run's log and outputs."""
    import sqlite3

    from lmpm.cli import main

    args = ["run", str(EX / "latent.lmpm"), "--input", f"Z={EX / 'latent' / 'z0.npy'}"]
    args += ["--seed", "2", "--quiet", "--checkpoint-every", "2", "--workers", "3"]
    args += ["--driver", "process"]  # the default partition splits Z and M in 3
    assert main([*args, "--epochs", "10", "--out", str(tmp_path / "ref")]) == 0
    assert main([*args, "--epochs", "5", "--out", str(tmp_path / "r")]) == 0
    assert sorted(p.name for p in (tmp_path / "r" / "payload").iterdir()) == [
        "w0.db",
        "w1.db",
        "w2.db",
    ]
    shards = [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()]
    assert "epoch-00000004.w2.safetensors" in shards  # control checkpoint + one shard per worker
    assert main(["run", "--resume", str(tmp_path / "r"), "--epochs", "10", "--quiet"]) == 0

    def log(d: Path) -> list[tuple[object, ...]]:
        conn = sqlite3.connect(d / "lmpm.db")
        try:
            return conn.execute("SELECT * FROM commits ORDER BY epoch, value, first").fetchall()
        finally:
            conn.close()

    assert log(tmp_path / "r") == log(tmp_path / "ref")
    for out in ("Z.npy", "M.npy"):
        assert (tmp_path / "r" / out).read_bytes() == (tmp_path / "ref" / out).read_bytes()


def test_epoch_record_counts_halo_bytes() -> None:
    path, params, _, _ = CASES["gpt"]
    run = Run.from_file(path, params=params, seed=3)
    group = WorkerGroup(run.plan, 2, topology=partition(run.plan, 2, replicate_bytes=0), seed=3)
    run.engine.dataplane = run.dataplane = group
    recs = [run.engine.step() for _ in range(3)]
    assert [r.halo_bytes for r in recs] != [0, 0, 0]
    assert sum(r.halo_bytes for r in recs) == group.halo_bytes_total
    single = Run.from_file(path, params=params, seed=3)
    assert single.engine.step().halo_bytes == 0


def test_group_workers_honour_the_ruleset() -> None:
    """A constraint disabled mid-run is switched off on every worker, and the group commits what
    one worker does."""
    outs = []
    seen: list[Any] = []
    for workers in (1, 2):
        path, params, inputs, _ = CASES["text"]
        run = Run.from_file(path, params=params, seed=3)
        if workers > 1:
            group = WorkerGroup(
                run.plan,
                workers,
                topology=partition(run.plan, workers, replicate_bytes=0),
                seed=3,
                checksum_policies=CHECKSUM_POLICIES,
            )
            for w in group.workers:
                propose = w.propose
                w.propose = lambda req, f=propose: (seen.append(req.active), f(req))[1]  # type: ignore[method-assign]
            run.engine.dataplane = run.dataplane = group
        payload, mask = load_input(str(inputs["Txt"]), run.plan.values["Txt"])
        run.set_input("Txt", payload, mask)
        for _ in range(2):
            run.engine.step()
        run.disable("Plain")
        for _ in range(4):
            run.engine.step()
        outs.append(run.payload("Txt").clone())
    assert torch.equal(outs[0], outs[1])
    plain = next(cp.id for cp in run.plan.constraints if cp.name == "Plain")
    assert seen[0] is None and seen[-1] is not None and plain not in seen[-1]


def test_a_group_on_cuda_is_refused_clearly() -> None:
    path, params, _, _ = CASES["gpt"]
    run = Run.from_file(path, params=params)
    with pytest.raises(UsageError) as e:
        WorkerGroup(run.plan, 2, backend="cuda")
    assert e.value.code == "U089"
