"""`lmpm run` and the Python API start and end a run by one path: the same program run both ways
(durable, into a directory whose earlier run failed before its first epoch) leaves the same log,
byte for byte outside its wall-clock columns, and the same files. The settings are one
RunConfig, stored in the log and read back by resume (runs of earlier versions too)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

import lmpm
from lmpm.cli import main
from lmpm.errors import RunDirError, UsageError
from lmpm.runtime.config import DEFAULT_CHECKPOINT_EVERY, ResumeRequest, RunConfig
from lmpm.runtime.rundir import connect, read_meta
from test_api import PROG

# a module whose `Uniform` fails at epoch 0: the run fails before its first epoch
BROKEN = """def broken(inputs, **kw):
    raise RuntimeError("the model is broken")

LMPM_BINDINGS = {"Uniform": broken}
"""

# columns holding wall-clock times or this process's own measures: they differ run to run
WALL = {"seconds", "model_seconds", "log_seconds", "driver_cpu_s", "at", "created"}
# meta keys that say when and how (which argv) the run was started
WHEN = {"created_at", "finished_at", "argv"}


def _dump(db: Path) -> dict[str, list[tuple[object, ...]]]:
    """Every table of a log, rows in order, wall-clock columns blanked."""
    conn = sqlite3.connect(db)
    try:
        tables = [
            r[0]
            for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY 1")
        ]
        out: dict[str, list[tuple[object, ...]]] = {}
        for t in tables:
            cur = conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2")
            names = [d[0] for d in cur.description]
            rows = [
                tuple(None if n in WALL else v for n, v in zip(names, row, strict=True))
                for row in cur.fetchall()
            ]
            if t == "meta":
                rows = [r for r in rows if r[0] not in WHEN]
            out[t] = rows
        return out
    finally:
        conn.close()


def _files(run_dir: Path) -> dict[str, bytes]:
    """The run directory's files but its SQLite databases (compared by :func:`_dump`)."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and ".db" not in p.name and p.name != "lmpm.lock"
    }


def test_the_cli_and_the_api_write_the_same_log(tmp_path: Path) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROG)
    broken = tmp_path / "broken.py"
    broken.write_text(BROKEN)
    cli_dir, api_dir = tmp_path / "cli", tmp_path / "api"
    # a first run of each fails in epoch 0, and says so in its log
    start = ["run", str(prog), "--seed", "3", "--epochs", "4", "--quiet"]
    assert main([*start, "--out", str(cli_dir), "--bind", str(broken)]) == 1
    failing = lmpm.compile(prog, bind=[str(broken)]).runner(run_dir=api_dir, seed=3, epochs=4)
    with pytest.raises(lmpm.ModelError), failing:
        failing.run(4)
    for d in (cli_dir, api_dir):
        conn = connect(d)
        try:
            meta = read_meta(conn)
        finally:
            conn.close()
        assert meta["status"] == "failed" and "the model is broken" in meta["error"], meta
    # the same run both ways, replacing them
    settings = ["--trace", "cells", "--checkpoint-every", "2", "--durable"]
    assert main([*start, "--out", str(cli_dir), *settings]) == 0
    run = lmpm.compile(prog).runner(
        run_dir=api_dir, seed=3, epochs=4, trace="cells", checkpoint_every=2, durable=True
    )
    with run:
        run.run(run.epochs)
        assert run.log is not None and run.log.conn is not None
        assert run.log.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        run.finish()
    cli, api = _dump(cli_dir / "lmpm.db"), _dump(api_dir / "lmpm.db")
    assert cli == api
    meta = dict(cli["meta"])
    assert (
        json.loads(str(meta["durable"])) is True and json.loads(str(meta["status"])) == "finished"
    )
    assert len(cli["epochs"]) == 4 and cli["trace_cells"]
    assert _files(cli_dir) == _files(api_dir) and any("checkpoints" in f for f in _files(cli_dir))


def test_a_run_ends_the_same_way_from_the_api(tmp_path: Path) -> None:
    """An error inside ``with run`` is marked in the log as `lmpm run` marks it (the hint says
    where the run goes on from); an OS error writing the directory becomes its coded error."""
    broken = tmp_path / "broken.py"
    broken.write_text(BROKEN)
    run = lmpm.compile(text=PROG, bind=[str(broken)]).runner(run_dir=tmp_path / "r", epochs=2)
    with pytest.raises(lmpm.ModelError) as e, run:
        run.run(2)
    assert "run the same command again" in (e.value.hint or "")
    assert run.log is not None and run.log.conn is None  # closed
    conn = connect(tmp_path / "r")
    try:
        meta = read_meta(conn)
    finally:
        conn.close()
    assert meta["status"] == "failed" and e.value.render() == meta["error"]


def test_the_config_is_stored_and_read_back(tmp_path: Path) -> None:
    run = lmpm.compile(text=PROG).runner(
        run_dir=tmp_path / "r", seed=5, epochs=3, checkpoint_every=2, trace="off", durable=True
    )
    run.run(3)
    run.finish()
    conn = connect(tmp_path / "r")
    try:
        meta = read_meta(conn)
    finally:
        conn.close()
    back = RunConfig.from_meta(meta)
    assert back == RunConfig(
        seed=5, epochs=3, checkpoint_every=2, trace="off", durable=True, params={}
    )
    assert back.stored() == {k: meta[k] for k in back.stored()}  # (bind: none here)
    again = lmpm.resume(tmp_path / "r", epochs=5)
    assert again.config.checkpoint_every == 2 and again.config.seed == 5
    again.run(again.epochs)
    again.finish()


def test_an_old_logs_settings_read_back() -> None:
    """A log from before --workers, --durable, --input and trace regions were stored resumes with
    their defaults; a damaged setting is D006."""
    old = {
        "params": {"N": 4},
        "bind": [],
        "seed": 1,
        "backend": "cpu",
        "epochs": None,
        "until": "stable",
        "trace": "summary",
        "checkpoint_every": 20,
    }
    cfg = RunConfig.from_meta(old)
    assert (cfg.workers, cfg.durable, dict(cfg.inputs), cfg.trace_region) == (1, False, {}, None)
    assert cfg.until == "stable" and dict(cfg.params) == {"N": 4}
    for key, bad in (
        ("seed", "x"),
        ("seed", True),  # JSON true is no seed
        ("params", {"N": "4"}),
        ("workers", 0),
        ("durable", "yes"),
        ("trace", "everything"),
    ):
        with pytest.raises(RunDirError) as e:
            RunConfig.from_meta({**old, key: bad})
        assert e.value.code == "D006"
    missing = {k: v for k, v in old.items() if k != "trace"}
    with pytest.raises(RunDirError, match="lacks the run's `trace`") as e:
        RunConfig.from_meta(missing, "run/lmpm.db")
    assert e.value.code == "D006" and e.value.message.startswith("run/lmpm.db")


@pytest.mark.parametrize(
    ("options", "code"),
    [
        ({"trace": "all"}, "U025"),
        ({"trace_region": "Txt[0]"}, "U025"),
        ({"checkpoint_every": 0}, "U024"),
        ({"epochs": 0}, "U022"),
        ({"workers": 0}, "U080"),
        ({"worker_timeout": 0}, "U083"),
        ({"driver": "threads"}, "U084"),
        ({"guard": True, "workers": 2}, "U080"),
        ({"checkpoints": 3}, "U107"),
    ],
)
def test_a_bad_setting_is_one_coded_error(options: dict[str, object], code: str) -> None:
    with pytest.raises(UsageError) as e:
        RunConfig().replace(**options)
    assert e.value.code == code
    with pytest.raises(UsageError) as e:  # the API's keyword options are the same record
        lmpm.compile(text=PROG).runner(**options)
    assert e.value.code == code


def test_the_single_driver_runs_one_epoch_worker() -> None:
    """`single` with W > 1 is refused by an epoch run (U084), not by the record: a training
    run's single driver holds its W replicas in one process (tests/train/test_train_cli.py)."""
    cfg = RunConfig().replace(workers=2, driver="single")
    with pytest.raises(UsageError) as e:
        cfg.epoch_driver()
    assert e.value.code == "U084"
    with pytest.raises(UsageError) as e:
        lmpm.compile(text=PROG).runner(workers=2, driver="single")
    assert e.value.code == "U084"


def test_one_default_checkpoint_cadence() -> None:
    from lmpm.commands.run import config
    from lmpm.runtime.data.raygroup import RayOptions

    assert RunConfig().checkpoint_every == RayOptions().checkpoint_every == DEFAULT_CHECKPOINT_EVERY
    assert RayOptions.of(RunConfig(checkpoint_every=7)).checkpoint_every == 7
    from lmpm.cli import build_parser

    args = build_parser().parse_args(["run", "p.lmpm", "--checkpoint-every", "7"])
    assert config(args, None).checkpoint_every == 7


def test_resume_requests_are_typed() -> None:
    req = ResumeRequest.of(bind=["m.py"], seed=3, cli=True)
    assert req.bind == ("m.py",) and req.kept() == {"seed": 3} and req.flag("seed") == "--seed"
    assert ResumeRequest.of(seed=3).flag("seed") == "seed="
    stored = RunConfig(seed=3, epochs=4, durable=True)
    cfg = ResumeRequest.of(epochs=9, compile=True).config(stored)
    assert (cfg.epochs, cfg.durable, cfg.compile, cfg.seed) == (9, True, True, 3)
    with pytest.raises(UsageError) as e:
        ResumeRequest.of(epoch=3)
    assert e.value.code == "U107"
