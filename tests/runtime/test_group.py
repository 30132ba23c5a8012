"""Partitioned workers: the in-process group of W = 2, 3, 4 workers commits exactly what one
worker commits (payload, clocks, provenance, scores, every epoch) on the examples, and only the
changed halo cells move between workers."""

from __future__ import annotations

import sqlite3
from contextlib import closing
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

    commits = "SELECT * FROM commits ORDER BY epoch, value, first"
    assert _rows(tmp_path / "r" / "lmpm.db", commits) == _rows(
        tmp_path / "ref" / "lmpm.db", commits
    )
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


def _rows(db: Path, query: str) -> list[tuple[Any, ...]]:
    """The rows ``query`` returns from the SQLite database ``db`` (a run's log or a store)."""
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute(query).fetchall()


# ---- the owners beside the workers (lmpm.runtime.data.shard) --------------------------------------
MASKGIT = """
param N = 24
value A : Token[8] shape Seq(N)
value MaskPlan : Event shape Set()
visible A[t] <- A[*]
rule R:
  on A[t]
  read {ctx = A[*]}
  emit proposal A[t] := RandomTokens(ctx)
commit A[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="confidence", steps=6)
"""


def _maskgit(workers: int) -> tuple[list[Any], list[Any]]:
    run = Run.from_source(MASKGIT, epochs=6, seed=5)
    if workers > 1:
        topo = partition(run.plan, workers, replicate_bytes=0)
        group = WorkerGroup(run.plan, workers, topology=topo, seed=5)
        run.engine.dataplane = run.dataplane = group
    recs = [run.engine.step() for _ in range(6)]
    return [snapshot(run), run.engine.why], recs


@pytest.mark.parametrize("workers", [2, 3])
def test_a_quota_over_the_whole_value_keeps_what_one_owner_keeps(workers: int) -> None:
    """Confidence: each owner sees only its cells' candidates; the quota's most confident
    commits are chosen over the whole value (a quota exchange), as one owner chooses them."""
    (one, why1), recs1 = _maskgit(1)
    (many, why2), recs2 = _maskgit(workers)
    assert [r.commits for r in recs1] == [r.commits for r in recs2]
    assert recs1[0].commits < recs1[0].attempts  # the quota held most proposals back
    for v in one:
        for x, y in zip(one[v], many[v], strict=True):
            assert torch.equal(x, y), v
    assert torch.equal(why1["A"], why2["A"])  # held back by the quota: the same cells


@pytest.mark.parametrize("name", ["sudoku", "text", "video", "latent"])
def test_the_owners_records_merge_into_what_one_owner_records(name: str, tmp_path: Path) -> None:
    """Asked for the per-cell records (a run directory's log), the owners' records merge into
    one owner's: the same commit-log rows every epoch, and the same candidate columns."""
    from lmpm.runtime.rundir import commit_rows

    def records(workers: int) -> list[Any]:
        path, params, inputs, epochs = CASES[name]
        run = Run.from_file(path, params=params, seed=3)
        if workers > 1:
            topo = partition(run.plan, workers, replicate_bytes=0)
            group = WorkerGroup(
                run.plan, workers, topology=topo, seed=3, checksum_policies=CHECKSUM_POLICIES
            )
            run.engine.dataplane = run.dataplane = group
        run.engine.checksums = True
        for value, file in inputs.items():
            file = _latent_input(tmp_path) if name == "latent" else file
            payload, mask = load_input(str(file), run.plan.values[value])
            run.set_input(value, payload, mask)
        return [run.engine.step() for _ in range(epochs)]

    one, many = records(1), records(3)
    for a, b in zip(one, many, strict=True):
        assert commit_rows(a) == commit_rows(b)
        for x, y in zip(a.values, b.values, strict=True):
            assert x.value == y.value
            for f in ("cells", "valid", "col_rule", "violated", "winner", "changed", "new_clock"):
                assert torch.equal(getattr(x, f), getattr(y, f)), (name, a.epoch, x.value, f)


def test_the_control_plane_gets_no_cell_data_from_a_group(tmp_path: Path) -> None:
    """Without an observer that writes per-cell records, what crosses between the control plane
    and the workers has no array data and a size that does not grow with the cells."""
    sizes = []
    for side in (6, 12):
        run = Run.from_file(CASES["latent"][0], params={"W": side, "H": side, "D": 8}, seed=3)
        group = WorkerGroup(run.plan, 2, seed=3)
        run.engine.dataplane = run.dataplane = group
        run.engine.keep_records = False
        z = np.random.default_rng(0).normal(size=(side, side, 8)).astype(np.float32)
        np.save(tmp_path / "z.npy", z)
        payload, mask = load_input(str(tmp_path / "z.npy"), run.plan.values["Z"])
        run.set_input("Z", payload, mask)
        recs: list[Any] = []
        run.engine.run(epochs=3, progress=recs.append)
        assert all(r.values == [] and r.message_bytes == 0 for r in recs)
        assert all(r.commits > 0 for r in recs)
        sizes.append(max(r.control_bytes for r in recs))
    assert sizes[1] <= sizes[0] + 16  # a few bytes more for larger counts, never per cell


def test_an_owner_undoes_the_epoch_it_was_in_and_only_that() -> None:
    """A worker fault in epoch e: every surviving owner goes back to the start of e (the group
    redoes it); one that had finished e before the fault keeps it."""
    from lmpm.runtime.data.shard import copy_state
    from lmpm.runtime.protocol import EpochRequest

    _, group = _run("sudoku", 3)  # four epochs
    assert group is not None
    before = [{n: copy_state(s) for n, s in o.state.items()} for o in group.owners]
    unset = [o.unset() for o in group.owners]
    group.epoch(EpochRequest(4, 0, 4))
    changed = group.owners[0].state["Cand"].clock
    assert not torch.equal(changed, before[0]["Cand"].clock)
    for o in group.owners:
        o.rollback(5)  # a fault after epoch 4 finished: nothing to undo
    assert not torch.equal(group.owners[0].state["Cand"].clock, before[0]["Cand"].clock)
    for o in group.owners:
        o.rollback(4)
    for o, was, left in zip(group.owners, before, unset, strict=True):
        assert o.unset() == left
        for name, st in o.state.items():
            for f in ("committed", "clock", "rule", "epoch", "score"):
                assert torch.equal(getattr(st, f), getattr(was[name], f)), (o.rank, name, f)


def test_the_owners_write_the_per_cell_log_rows_into_their_stores(tmp_path: Path) -> None:
    """With a run directory, each owner writes the commit rows (and trace rows) of its cells
    into its worker's store; the control plane's log keeps the per-epoch rows, the same as a
    one-worker run's, and nothing per cell."""
    from lmpm.cli import main

    args = [
        "run",
        str(EX / "latent.lmpm"),
        "--input",
        f"Z={EX / 'latent' / 'z0.npy'}",
        "--epochs",
        "4",
        "--seed",
        "2",
        "--quiet",
    ]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    two = tmp_path / "two"
    assert main([*args, "--workers", "2", "--driver", "process", "--out", str(two)]) == 0

    epochs = (
        "SELECT epoch, open_cells, attempts, candidates, commits, violations, decided, checksum "
        "FROM epochs"
    )
    summary = "SELECT * FROM trace_summary ORDER BY epoch, constraint_id, rule"
    for q in (epochs, summary):
        assert _rows(two / "lmpm.db", q) == _rows(tmp_path / "one" / "lmpm.db", q)
    assert _rows(two / "lmpm.db", "SELECT count(*) FROM commits") == [(0,)]
    # the checksum of what the owners committed, summed over the workers: one worker's
    assert all(c is not None for (c,) in _rows(two / "lmpm.db", "SELECT checksum FROM epochs"))
    total = "SELECT coalesce(sum(count), 0) FROM commits"
    per_worker = [_rows(two / "payload" / f"w{i}.db", total)[0][0] for i in range(2)]
    assert all(n > 0 for n in per_worker)
    assert sum(per_worker) == _rows(tmp_path / "one" / "lmpm.db", total)[0][0]
