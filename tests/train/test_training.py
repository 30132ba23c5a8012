"""The training runtime: minimize lowered to autograd, constraints on parameters, the commit
policies, the drivers, the supervisor, the log. Small sizes (a few inner steps of the byte model)."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lmpm.errors import InputError
from lmpm.models.training import text_corpus
from lmpm.train import log as tlog
from lmpm.train.modules import MODULES, cells
from lmpm.train.run import Trainer, load_rows, parameters
from lmpm.train.spec import (
    DataSpec,
    MinimizeSpec,
    ParamConstraint,
    ParamsSpec,
    PolicySpec,
    TrainSpec,
)
from lmpm.train.worker import batch_generator, shard_rows

ROWS, HELD = 96, 32
DATA = DataSpec("Corpus", "data", 64, ROWS, 256)
HELD_DATA = DataSpec("Held", "held", 64, HELD, 256)


@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    return {"Corpus": text_corpus(ROWS, 1), "Held": text_corpus(HELD, 2)}


def make_spec(
    policy: PolicySpec | None = None,
    constraints: tuple[ParamConstraint, ...] = (),
    **rule: Any,
) -> TrainSpec:
    opts: dict[str, Any] = {"steps": 2, "batch": 4, "lr": 3e-3, "clip": 1.0}
    opts.update(rule)
    return TrainSpec(
        ParamsSpec("Theta", "ByteLM", "tensors"),
        MinimizeSpec(
            "Fit",
            "NextByteLoss",
            (DATA,),
            eval_loss="NextByteLoss",
            eval_data=(HELD_DATA,),
            **opts,
        ),
        policy or PolicySpec("diloco", 0.7, 0.9),
        constraints,
    )


def train(spec: TrainSpec, data: Any, epochs: int = 2, **kw: Any) -> tuple[Any, Trainer]:
    kw.setdefault("driver", "single")  # the Ray tests below ask for Ray
    t = Trainer(spec, data, epochs=epochs, **kw)
    return t.run(), t


def final(t: Trainer) -> dict[str, torch.Tensor]:
    """The committed parameters at the end (the output file when the workers were processes)."""
    if t.run_dir is not None:
        return parameters(t.run_dir / "Theta.safetensors")
    w = t.driver.workers[0]  # type: ignore[union-attr]
    names = [n for n, _ in w.module.named_parameters()]
    return {n: c.clone() for n, c in zip(names, w.committed, strict=True)}


def test_diloco_one_worker_h1_lr1_m0_is_plain_training(data: Any) -> None:
    """DiLoCo with W = 1, H = 1, outer lr 1, momentum 0 equals a plain AdamW loop step for step."""
    spec = make_spec(PolicySpec("diloco", 1.0, 0.0), steps=1, weight_decay=0.01)
    res, t = train(spec, data, epochs=4)
    torch.manual_seed(0)
    model = MODULES["ByteLM"]()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    shard = data["Corpus"][slice(*shard_rows(ROWS, 0, 1))]
    losses = []
    for epoch in range(1, 5):
        g = batch_generator(0, 0, epoch)
        x = shard[torch.randint(0, shard.shape[0], (4,), generator=g)]
        loss = F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    got = final(t)
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p.detach()), n
    assert [round(e.loss, 6) for e in res.epochs] == [round(x, 6) for x in losses]


def test_same_seed_same_parameters_and_another_seed_differs(data: Any) -> None:
    spec = make_spec()
    a, _ = train(spec, data, workers=2)
    b, _ = train(spec, data, workers=2)
    c, _ = train(
        dataclasses.replace(spec, rule=dataclasses.replace(spec.rule, seed=1)), data, workers=2
    )
    assert [e.checksum for e in a.epochs] == [e.checksum for e in b.epochs]
    assert a.epochs[-1].checksum != c.epochs[-1].checksum


def test_freeze_is_exact_and_logged(data: Any, tmp_path: Path) -> None:
    freeze = ParamConstraint("Frozen", "freeze", ("pos.*", "blocks.0.*"), 1000)
    spec = make_spec(constraints=(freeze,))
    res, t = train(spec, data, workers=2, run_dir=tmp_path / "r")
    torch.manual_seed(0)
    init = dict(MODULES["ByteLM"]().named_parameters())
    got = final(t)
    frozen = [n for n in got if n.startswith(("pos.", "blocks.0."))]
    assert frozen
    for n in got:
        same = torch.equal(got[n], init[n].detach())
        assert same == (n in frozen), n
    assert res.epochs[-1].frozen == len(frozen)
    h = tlog.read(tmp_path / "r")
    assert {(c["name"], c["action"], c["violations"]) for c in h.constraints} == {
        ("Frozen", "frozen", 0)
    }
    assert h.epochs[-1]["frozen"] == len(frozen)


def test_norm_bound_is_enforced_by_the_commit(data: Any) -> None:
    bound = ParamConstraint("Bounded", "norm", ("head.weight", "tok.*"), 10, bound=3.0)
    res, t = train(make_spec(constraints=(bound,)), data)
    got = final(t)
    for n in ("head.weight", "tok.weight"):
        assert float(got[n].double().norm()) <= 3.0 + 1e-4
    assert res.epochs[0].projected == 2


def test_average_policy_commits_the_mean_of_the_candidates(data: Any) -> None:
    spec = make_spec(PolicySpec("average"))
    t = Trainer(spec, data, epochs=1, workers=2, driver="single")
    props = t.driver.propose(1)
    cands = [[c.clone() for c in w.proposed] for w in t.driver.workers]  # type: ignore[union-attr]
    from lmpm.train.policy import decide

    dec = decide(spec, t.names, 1, props)
    t.driver.commit(1, dec.weights, dec.keep)
    for i, c in enumerate(t.driver.workers[0].committed):  # type: ignore[union-attr]
        assert torch.allclose(c, (cands[0][i] + cands[1][i]) * 0.5, atol=1e-7)


def test_best_policy_takes_the_lowest_held_out_loss(data: Any) -> None:
    spec = make_spec(PolicySpec("best"))
    t = Trainer(spec, data, epochs=1, workers=3, driver="single")
    props = t.driver.propose(1)
    from lmpm.train.policy import decide

    dec = decide(spec, t.names, 1, props)
    best = min((p for p in props if p is not None), key=lambda p: p.eval_loss or 0.0)
    cand = [c.clone() for c in t.driver.workers[best.worker].proposed]  # type: ignore[union-attr]
    t.driver.commit(1, dec.weights, dec.keep)
    assert all(w[0] == (1.0 if i == best.worker else 0.0) for i, w in enumerate(dec.weights))
    for c, want in zip(t.driver.workers[0].committed, cand, strict=True):  # type: ignore[union-attr]
        assert torch.equal(c, want)


def test_log_checkpoints_and_output(data: Any, tmp_path: Path) -> None:
    d = tmp_path / "run"
    res, t = train(make_spec(), data, epochs=3, workers=2, run_dir=d)
    h = tlog.read(d)
    assert h.meta["status"] == "finished" and h.meta["workers"] == 2
    assert [e["epoch"] for e in h.epochs] == [1, 2, 3]
    assert len(h.steps) == 3 * 2  # H = 2 inner steps per epoch
    assert len(h.worker_epochs) == 3 * 2
    assert all(e["bytes"] == 2 * (2 - 1) * t.driver.numel() * 4 for e in h.epochs)
    assert h.epochs[-1]["checksum"] == res.epochs[-1].checksum
    assert {c["epoch"] for c in h.checkpoints} == {0, 1, 2, 3}
    kept = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert kept == [  # the newest two epochs and epoch 0: θ and each worker's inner state
        *(f"inner-w{w}-{e:06d}.pt" for w in (0, 1) for e in (0, 2, 3)),
        "params-000000.safetensors",
        "params-000002.safetensors",
        "params-000003.safetensors",
    ]
    out = parameters(d / "Theta.safetensors")
    got = final(t)
    assert all(torch.equal(out[n], got[n]) for n in got)
    # the eval loss is the held-out loss of the committed parameters
    m = MODULES["ByteLM"]()
    m.load_state_dict(out)
    m.eval()
    with torch.no_grad():
        x = data["Held"]
        want = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1)).item()
    assert h.epochs[-1]["eval_loss"] == pytest.approx(want, rel=1e-5)


def test_blocks_granularity_names_cells_by_block() -> None:
    m = MODULES["ByteLM"]()
    names = [n for n, _ in cells(m, "blocks")]
    assert names == ["tok", "pos", "blocks.0", "blocks.1", "norm", "head"]
    assert sum(len(i) for _, i in cells(m, "blocks")) == len(list(m.parameters()))


def test_load_rows_errors(tmp_path: Path) -> None:
    import numpy as np

    d = DataSpec("Corpus", "data", 4, 2, 256)
    p = tmp_path / "c.npy"
    np.save(p, np.zeros((2, 4), dtype=np.int64))  # rows × length: the wrong way round
    with pytest.raises(InputError, match=r"shape \[4, 2\]"):
        load_rows(p, d)
    np.save(p, np.full((4, 2), 300, dtype=np.int64))
    with pytest.raises(InputError, match=r"outside 0\.\.255"):
        load_rows(p, d)
    with pytest.raises(InputError, match="needs 8 tokens"):
        load_rows(b"abc", d)
    with pytest.raises(InputError, match="not found"):
        load_rows(tmp_path / "nope.npy", d)
    arr = np.arange(8).reshape(2, 4).T  # [L, R]: column r is row r
    np.save(p, arr)
    assert load_rows(p, d).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ---- Ray: worker processes, gloo all-reduce, the supervisor ----------------------------------------
def test_ray_commits_what_the_in_process_driver_commits(local_ray: Any, data: Any) -> None:
    spec = make_spec()
    threads = torch.get_num_threads()
    try:
        a, _ = train(spec, data, epochs=2, workers=2, driver="single", threads=1)
    finally:
        torch.set_num_threads(threads)
    b, _ = train(spec, data, epochs=2, workers=2, driver="ray", threads=1)
    assert [e.checksum for e in a.epochs] == [e.checksum for e in b.epochs]
    assert b.epochs[0].bytes > 0


@pytest.mark.parametrize("phase", ["propose", "commit"])
def test_a_worker_killed_is_respawned_and_the_run_goes_on(
    local_ray: Any, data: Any, tmp_path: Path, phase: str
) -> None:
    d = tmp_path / "run"
    t = Trainer(make_spec(), data, epochs=3, workers=2, driver="ray", run_dir=d)
    t.driver.inject(1, phase, 2)
    res = t.run()
    assert len(res.epochs) == 3
    h = tlog.read(d)
    assert h.meta["status"] == "finished"
    died = [f for f in h.faults if f["cause"] == "died"]
    assert [(f["worker"], f["epoch"], f["phase"]) for f in died] == [("w1", 2, phase)]
    w1 = next(w for w in h.workers if w["worker"] == "w1")
    assert w1["restarts"] == 1
    if phase == "propose":  # epoch 2 committed w0's candidate only; w1 rejoined at epoch 3
        assert [r["worker"] for r in h.worker_epochs if r["epoch"] == 2] == ["w0"]
        assert [r["worker"] for r in h.worker_epochs if r["epoch"] == 3] == ["w0", "w1"]
    # every worker holds the same committed parameters after the fault
    assert len({e["checksum"] for e in h.epochs}) == 3
    if phase == "commit":  # the epoch is redone from the checkpoint: as if nothing happened
        clean, _ = train(make_spec(), data, epochs=3, workers=2, driver="ray")
        assert [e.checksum for e in clean.epochs] == [e["checksum"] for e in h.epochs]


@pytest.mark.slow  # ~45 s: the timeout, then a new worker process
def test_a_hung_worker_is_replaced_by_the_shared_supervision_policy(
    local_ray: Any, data: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that hangs in its inner loop is declared hung at the timeout and replaced, by the
    policy the engine's worker group uses (lmpm.runtime.data.raygroup.gather; the trainer's own copy
    force-cancelled the hung actor call, which Ray refuses with a ValueError)."""
    from lmpm.runtime.data import raygroup

    seen: list[bool] = []
    real = raygroup.gather

    def spy(refs: list[Any], timeout: float, *, grace: bool = True) -> Any:
        seen.append(grace)
        return real(refs, timeout, grace=grace)

    monkeypatch.setattr("lmpm.train.driver.gather", spy)
    d = tmp_path / "run"
    t = Trainer(make_spec(), data, epochs=3, workers=2, driver="ray", run_dir=d, worker_timeout=8)
    t.driver.inject(1, "propose", 2, "hang")
    res = t.run()
    assert len(res.epochs) == 3 and seen
    h = tlog.read(d)
    assert h.meta["status"] == "finished"
    assert [(f["worker"], f["epoch"], f["cause"]) for f in h.faults] == [("w1", 2, "hung")]


def test_log_is_marked_failed_with_the_error(data: Any, tmp_path: Path) -> None:
    spec = make_spec(lr=1e9, clip=None, optimizer="sgd")
    with pytest.raises(Exception, match=r"R070|loss"):
        train(spec, data, epochs=3, run_dir=tmp_path / "r")
    h = tlog.read(tmp_path / "r")
    assert h.meta["status"] == "failed" and "NextByteLoss" in h.meta["error"]
    conn = sqlite3.connect(tlog.db_path(tmp_path / "r"))
    assert conn.execute("SELECT COUNT(*) FROM train_epochs").fetchone()[0] >= 0
