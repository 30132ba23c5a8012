"""Workers as Ray actors (real processes, the halo over gloo on loopback): they commit exactly what
one worker commits; a worker killed with SIGKILL (or hung) in any phase of an epoch is replaced,
the epoch is redone and the result is unchanged; the commit log of `lmpm run --workers N` is the
one-worker log; the fault is in the log and in `lmpm trace`."""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from lmpm.cli import main  # noqa: E402
from lmpm.errors import UsageError  # noqa: E402
from lmpm.resolve.topology import partition  # noqa: E402
from lmpm.runtime.data.group import WorkerGroup  # noqa: E402
from lmpm.runtime.data.raygroup import (  # noqa: E402
    RayGroup,
    RayOptions,
    Recipe,
    WorkerLost,
    parse_fault,
)
from lmpm.runtime.io import load_input  # noqa: E402
from lmpm.runtime.records import CHECKSUM_POLICIES  # noqa: E402
from lmpm.runtime.session import Run  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import test_runtime_differential  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_group import CASES, _latent_input, snapshot  # noqa: E402
from test_runtime_differential import BINDINGS, rich_programs, used  # noqa: E402
from test_runtime_resume import _cells_log, _log  # noqa: E402

# the random programs' bindings live in a test module the worker processes cannot import
ray.cloudpickle.register_pickle_by_value(test_runtime_differential)

EX = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module", autouse=True)
def _ray(local_ray: Any) -> None:
    """Every test here runs on the module's local Ray instance (tests/runtime/conftest.py)."""


def _run(
    name: str, workers: int, tmp: Path, faults: list[tuple[int, str, int, str]] = ()
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Per epoch, every value's (payload, committed, clock, rule, epoch, score); and the faults
    the epoch records name."""
    path, params, inputs, epochs = CASES[name]
    run = Run.from_file(path, params=params, seed=3)
    group = None
    if workers:
        group = RayGroup(
            run.plan,
            workers,
            topology=partition(run.plan, workers, replicate_bytes=0),
            seed=3,
            checksum_policies=CHECKSUM_POLICIES,
            options=RayOptions(recipe=Recipe(run.front.ir, run.params, (), {}, None), timeout=8.0),
        )
        run.engine.dataplane = run.dataplane = group
    try:
        for value, file in inputs.items():
            if name == "latent":
                file = _latent_input(tmp)
            payload, mask = load_input(str(file), run.plan.values[value])
            run.set_input(value, payload, mask)
        for f in faults:
            assert group is not None
            group.inject(*f)
        states, seen = [], []
        for _ in range(epochs):
            rec = run.engine.step()
            seen += list(rec.faults)
            states.append(snapshot(run))
        return states, seen
    finally:
        if group is not None:
            group.close()


def _same(one: list[dict[str, Any]], many: list[dict[str, Any]], what: str) -> None:
    for e, (a, b) in enumerate(zip(one, many, strict=True)):
        for v in a:
            for field, x, y in zip(
                ("payload", "committed", "clock", "rule", "epoch", "score"), a[v], b[v], strict=True
            ):
                msg = f"{what} epoch {e} {v}.{field}"
                if field == "score":  # a batched float model: the last bits vary by batch
                    assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), msg
                else:
                    assert torch.equal(x, y), msg


@pytest.mark.parametrize("name", ["latent", "sudoku", "text", "video"])
def test_ray_workers_commit_like_one_worker(name: str, tmp_path: Path) -> None:
    one, _ = _run(name, 0, tmp_path)
    for workers in (2, 3):
        many, faults = _run(name, workers, tmp_path)
        assert faults == []
        _same(one, many, f"{name} W={workers}")


def test_ray_workers_count_the_messages_that_cross(tmp_path: Path) -> None:
    """The Ray group counts what it sends to and receives from its workers: the array data the
    in-process group counts (what would cross), serialised at least as large (an apply reply also
    carries the halo's byte count, and every worker answers apply)."""
    path, params, _, epochs = CASES["latent"]
    counted: dict[str, list[tuple[int, int]]] = {}
    for driver in (WorkerGroup, RayGroup):
        run = Run.from_file(path, params=params, seed=3)
        topo = partition(run.plan, 2, replicate_bytes=0)
        extra: dict[str, Any] = {}
        if driver is RayGroup:
            recipe = Recipe(run.front.ir, run.params, (), {}, None)
            extra = {"options": RayOptions(recipe=recipe, timeout=8.0)}
        group = driver(run.plan, 2, topology=topo, seed=3, **extra)
        run.engine.dataplane = run.dataplane = group
        try:
            payload, mask = load_input(str(_latent_input(tmp_path)), run.plan.values["Z"])
            run.set_input("Z", payload, mask)
            recs = [run.engine.step() for _ in range(epochs)]
        finally:
            group.close()
        counted[driver.__name__] = [(r.message_bytes, r.control_bytes) for r in recs]
    for (m, c), (ray_m, ray_c) in zip(counted["WorkerGroup"], counted["RayGroup"], strict=True):
        assert 0 < m == ray_m < c <= ray_c


@pytest.mark.parametrize(
    ("phase", "how"),
    [("propose", "kill"), ("apply", "kill"), ("halo", "kill"), ("propose", "hang")],
)
def test_a_failed_worker_is_replaced_and_the_epoch_redone(
    phase: str, how: str, tmp_path: Path
) -> None:
    one, _ = _run("sudoku", 0, tmp_path)
    many, faults = _run("sudoku", 3, tmp_path, [(1, phase, 2, how)])
    _same(one, many, f"sudoku W=3, w1 {how} in {phase}")
    assert faults, "the fault is in the epoch's record"
    assert faults[0].epoch == 2
    w1 = next(f for f in faults if f.worker == "w1")
    assert w1.cause == ("died" if how == "kill" else "hung")
    assert w1.phase == "epoch"  # one call per worker per epoch: the fault is somewhere in it
    assert w1.pid > 0 and w1.seconds > 0


def test_two_faults_in_one_run(tmp_path: Path) -> None:
    one, _ = _run("text", 0, tmp_path)
    many, faults = _run("text", 2, tmp_path, [(0, "apply", 0, "kill"), (1, "apply", 2, "kill")])
    _same(one, many, "text W=2, two kills")
    assert {(f.worker, f.epoch) for f in faults if f.cause == "died"} == {("w0", 0), ("w1", 2)}


def test_losing_every_worker_at_once_says_the_metadata_went_with_them(tmp_path: Path) -> None:
    """The owners keep the cells' metadata in the workers: a fault that takes every worker in one
    epoch leaves none to hand it on, and the run stops with R063 (resume from the run
    directory), not with an internal error or wrong commits."""
    with pytest.raises(WorkerLost) as err:
        _run("text", 2, tmp_path, [(0, "propose", 1, "kill"), (1, "propose", 1, "kill")])
    assert err.value.code == "R063" and "--resume" in (err.value.hint or "")


def test_cli_workers_log_is_the_one_worker_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmpm run --workers 2` writes the commit log, trace and outputs `--workers 1` writes, also
    when worker w1 is killed in the middle of epoch 3; `lmpm trace` shows the fault."""
    args = [
        "run",
        str(EX / "latent.lmpm"),
        "--input",
        f"Z={EX / 'latent' / 'z0.npy'}",
        "--epochs",
        "6",
        "--seed",
        "2",
        "--checkpoint-every",
        "2",
        "--quiet",
    ]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    monkeypatch.setenv("LMPM_INJECT_FAULT", "w1:halo:3")
    assert main([*args, "--workers", "2", "--out", str(tmp_path / "two")]) == 0
    monkeypatch.delenv("LMPM_INJECT_FAULT")
    # the per-epoch rows are the same; the commits, which the owners wrote into their workers'
    # stores, are the same cell by cell (how cells group into rows depends on the worker)
    one, two = _log(tmp_path / "one" / "lmpm.db"), _log(tmp_path / "two" / "lmpm.db")
    assert one[1:] == two[1:] and not two[0]
    assert _cells_log(tmp_path / "two") == _cells_log(tmp_path / "one")
    for out in ("Z.npy", "M.npy"):
        assert (tmp_path / "two" / out).read_bytes() == (tmp_path / "one" / out).read_bytes()
    assert {"w0.db", "w1.db"} <= {p.name for p in (tmp_path / "two" / "payload").iterdir()}
    conn = sqlite3.connect(tmp_path / "two" / "lmpm.db")
    faults = conn.execute("SELECT epoch, worker, cause FROM worker_faults").fetchall()
    conn.close()
    assert (3, "w1", "died") in faults
    capsys.readouterr()
    assert main(["trace", str(tmp_path / "two")]) == 0
    out = capsys.readouterr().out
    assert "worker faults survived" in out and "epoch 3: worker w1 died (pid" in out


def test_resume_a_multi_worker_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run started on 2 Ray workers resumes from its shards (on the in-process driver here) and
    ends as the uninterrupted run ends; a different worker count is refused."""
    args = ["run", str(EX / "latent.lmpm"), "--input", f"Z={EX / 'latent' / 'z0.npy'}"]
    args += ["--seed", "1", "--checkpoint-every", "3", "--quiet"]
    assert main([*args, "--epochs", "9", "--workers", "2", "--out", str(tmp_path / "ref")]) == 0
    assert main([*args, "--epochs", "4", "--workers", "2", "--out", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", str(tmp_path / "r"), "--workers", "3", "--quiet"]) != 0
    assert "error[D011]" in capsys.readouterr().err
    resume = ["run", "--resume", str(tmp_path / "r"), "--epochs", "9", "--quiet"]
    assert main([*resume, "--driver", "process"]) == 0
    assert _log(tmp_path / "r" / "lmpm.db") == _log(tmp_path / "ref" / "lmpm.db")
    for out in ("Z.npy", "M.npy"):
        assert (tmp_path / "r" / out).read_bytes() == (tmp_path / "ref" / out).read_bytes()


def test_api_workers_and_errors(tmp_path: Path) -> None:
    with Run.from_file(EX / "gpt.lmpm", params={"N": 12}, seed=1, workers=2) as run:
        run.run(4)
        two = run.outputs()["Txt"]
    one = Run.from_file(EX / "gpt.lmpm", params={"N": 12}, seed=1)
    one.run(4)
    assert (one.outputs()["Txt"] == two).all()
    with pytest.raises(UsageError) as e:
        Run.from_file(EX / "gpt.lmpm", params={"N": 12}, workers=0)
    assert e.value.code == "U080"
    with pytest.raises(UsageError) as e:
        Run.from_file(EX / "gpt.lmpm", params={"N": 12}, workers=2, driver="single")
    assert e.value.code == "U084"
    with pytest.raises(UsageError) as e:
        Run.from_file(EX / "gpt.lmpm", params={"N": 12}, workers=2, worker_timeout=0)
    assert e.value.code == "U083"
    assert main(["run", str(EX / "gpt.lmpm"), "--workers", "0", "--out", str(tmp_path)]) == 2
    with pytest.raises(UsageError) as e:
        parse_fault("w9:apply:1", 2)
    assert e.value.code == "U085"


def test_user_bindings_reach_the_workers(tmp_path: Path) -> None:
    """A --bind module is loaded again in every worker process (from its absolute path)."""
    bind = tmp_path / "mine.py"
    bind.write_text(
        "import torch\nimport lmpm\n\n"
        '@lmpm.bind("Fours")\n'
        "def fours(inputs, **kw):\n"
        "    n = inputs['cells'].shape[0]\n"
        "    prop = torch.full((n, 1), 4, dtype=torch.int64)\n"
        "    return {'proposal': prop, 'score': torch.zeros(n, 1, dtype=torch.float64)}\n"
    )
    prog = tmp_path / "p.lmpm"
    prog.write_text(
        "param N = 16\nvalue X : Token[8] shape Seq(N)\n"
        "rule R:\n  on X[t]\n  emit proposal X[t] := Fours()\n"
    )
    out = tmp_path / "o"
    common = ["run", str(prog), "--bind", str(bind), "--epochs", "2", "--quiet"]
    assert main([*common, "--workers", "2", "--out", str(out)]) == 0
    assert (out / "X.json").read_text().count("4") == 16


def test_a_failing_model_on_a_worker_names_its_call_and_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a Ray worker as in-process: the program's call (file:line:col) and the module line that
    raised; the bind file imports its sibling module in the worker too. The run ends without
    waiting out the worker timeout: the failing worker leaves the process group, so its peer's
    exchange fails at once and the calls that close the run are not queued behind it."""
    (tmp_path / "helper.py").write_text("def key():\n    return 'nope'\n")
    bind = tmp_path / "mine.py"
    bind.write_text(
        "import lmpm\nfrom helper import key\n\n"
        '@lmpm.bind("Fours")\n'
        "def fours(inputs, **kw):\n"
        "    return inputs[key()]\n"
    )
    prog = tmp_path / "p.lmpm"
    prog.write_text(
        "param N = 16\nvalue X : Token[8] shape Seq(N)\n"
        "rule R:\n  on X[t]\n  emit proposal X[t] := Fours()\n"
    )
    capsys.readouterr()
    args = ["run", str(prog), "--bind", str(bind), "--epochs", "2", "--quiet", "--workers", "2"]
    args += ["--worker-timeout", "40"]
    t0 = time.monotonic()
    assert main([*args, "--out", str(tmp_path / "o")]) == 1
    assert time.monotonic() - t0 < 40  # before: one timeout per blocked call (2 x 60 s)
    err = capsys.readouterr().err
    assert f"{prog}:5:25: error[R050]" in err and f"(at {bind}:6, in fours)" in err, err


def _random_states(
    src: str, seed: int, epochs: int, workers: int, fault: tuple[int, str, int] | None = None
) -> list[dict[str, Any]]:
    from lmpm.ir import compile_source

    front = compile_source(src, raise_errors=False)
    assert not front.errors, src
    run = Run(front, bindings=used(front, BINDINGS), seed=seed, epochs=epochs)
    group = None
    if workers > 1:
        group = RayGroup(
            run.plan,
            workers,
            topology=partition(run.plan, workers, replicate_bytes=0),
            seed=seed,
            checksum_policies=CHECKSUM_POLICIES,
        )
        run.engine.dataplane = run.dataplane = group
        if fault is not None:
            group.inject(*fault)
    try:
        out = []
        for _ in range(epochs):
            run.engine.step()
            out.append(
                {
                    v: (run.payload(v), s.committed.clone(), s.clock.clone(), s.rule.clone())
                    for v, s in run.engine.state.items()
                }
            )
        return out
    finally:
        if group is not None:
            group.close()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rich_programs(), st.sampled_from([2, 3, 4]), st.data())
def test_random_programs_commit_alike_on_ray_workers(
    case: tuple[str, dict[str, Any]], workers: int, data: st.DataObject
) -> None:
    """The differential test's random programs: W Ray workers (the plan and the user bindings
    pickled to each process) commit what one worker commits, every epoch, also when one of them
    is killed in some phase of some epoch (a kill whose worker has no work then never fires)."""
    src, info = case
    fault = data.draw(
        st.none()
        | st.tuples(
            st.integers(0, workers - 1),
            st.sampled_from(["propose", "apply", "halo"]),
            st.integers(0, info["epochs"] - 1),
        )
    )
    one = _random_states(src, info["seed"], info["epochs"], 1)
    many = _random_states(src, info["seed"], info["epochs"], workers, fault)
    for e, (a, b) in enumerate(zip(one, many, strict=True)):
        for v in a:
            for x, y in zip(a[v], b[v], strict=True):
                assert torch.equal(x, y), (e, v, workers, fault, src)


def test_a_cluster_address_where_nothing_answers_fails_fast() -> None:
    import socket

    from lmpm.runtime.data.raygroup import probe_cluster

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UsageError) as e:
        probe_cluster(f"127.0.0.1:{port}", timeout=2.0)
    assert e.value.code == "U090" and "nothing answers" in e.value.message
    probe_cluster("auto")  # not host:port: left to Ray


def test_checkpoint_every_reaches_the_ray_group(tmp_path: Path) -> None:
    """The Ray workers checkpoint their payload (what a replaced worker restores from) every
    --checkpoint-every epochs, not every 20: without a log, and with one, where they write no
    shard the log does not name."""
    gpt = EX / "gpt.lmpm"
    with Run.from_file(gpt, params={"N": 12}, seed=1, workers=2, checkpoint_every=3) as run:
        run.run(7)
        assert isinstance(run.dataplane, RayGroup) and run.dataplane.checkpoint_every == 3
        assert run.dataplane.checkpointed is not None and run.dataplane.checkpointed[0] == 6
    out = tmp_path / "r"
    # (cells still open at epoch 20, where a group checkpointing every 20 epochs would write)
    args = ["run", str(gpt), "--set", "N=256", "--workers", "2", "--epochs", "25"]
    assert main([*args, "--checkpoint-every", "30", "--out", str(out), "--quiet"]) == 0
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "epoch-00000000.w1.safetensors" in names, names  # the log's first, and last
    assert not any(n.startswith("epoch-00000020.") for n in names), names


def test_ray_workers_without_a_run_dir_checkpoint_without_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a run dir the workers' checkpoints go to temporary stores that only a fault within
    this process's life reads back: none is fsynced. With one, the log's first and last are."""
    calls: list[tuple[int, bool]] = []
    real = RayGroup.checkpoint_shards

    def spy(self: RayGroup, label: int, sync: bool = True) -> Any:
        calls.append((label, sync))
        return real(self, label, sync)

    monkeypatch.setattr(RayGroup, "checkpoint_shards", spy)
    gpt = EX / "gpt.lmpm"
    with Run.from_file(gpt, params={"N": 12}, seed=1, workers=2, checkpoint_every=3) as run:
        run.run(7)
    assert calls == [(0, False), (3, False), (6, False)]
    calls.clear()
    out = tmp_path / "r"
    args = ["run", str(gpt), "--set", "N=12", "--workers", "2", "--epochs", "4", "--quiet"]
    assert main([*args, "--checkpoint-every", "30", "--out", str(out)]) == 0
    assert calls == [(0, True), (4, True)]
