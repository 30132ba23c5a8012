"""`lmpm top` (the dashboard frame, the live follow, errors) and `lmpm render` of a training run.

Run directories are written with the real training-log writer (:class:`lmpm.train.log.TrainLog`).
The golden frame: ``LMPM_UPDATE_GOLDEN=1 pytest tests/train/test_dashboard.py`` rewrites it.
"""

from __future__ import annotations

import io
import math
import os
import pty
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from rich.console import Console

from lmpm.cli import main
from lmpm.train.dashboard import frame, loss_plot, policy_text
from lmpm.train.log import ConstraintRow, EpochRow, TrainLog, WorkerRow, read

GOLDEN = Path(__file__).with_name("golden")
H = 8  # inner steps per epoch
META = {
    "program": "examples/bytelm.lmpm",
    "module": "ByteLM",
    "workers": 2,
    "driver": "local",
    "policy": {"kind": "diloco", "outer_lr": 0.7, "momentum": 0.9, "nesterov": True},
    "steps": H,
    "batch": 4,
    "epochs": 4,
}


def step_loss(s: int) -> float:
    return 5.5 * math.exp(-s / 15) + 1.2 + 0.15 * math.sin(s)


def log_epoch(log: TrainLog, e: int) -> None:
    """Epoch ``e`` (1-based) of two workers, with two constraint events."""
    steps = [step_loss((e - 1) * H + i) for i in range(H)]
    mean = sum(steps) / H
    log.epoch(
        EpochRow(e, loss=mean, eval_loss=steps[-1] + 0.1, tokens=8192, seconds=2.0 + 0.1 * e,
                 inner_seconds=1.8, bytes=3 * 2**20, changed=12, frozen=2, projected=int(e == 4),
                 rejected=0, clock=e, checksum=f"c{e}", at=1000.0 + e),
        workers=[
            WorkerRow(e, "w0", H, mean, steps[-1], 4096, 1.8, None),
            WorkerRow(e, "w1", H, mean + 0.01, steps[-1] + 0.02, 4096, 1.8, None),
        ],
        steps=steps,
        constraints=[
            ConstraintRow(e, "FreezeEmbed", "freeze", 24, 0, "frozen"),
            ConstraintRow(e, "Norm", "norm", 24, int(e == 4), "projected" if e == 4 else "none"),
        ],
    )  # fmt: skip


def start_run(run_dir: Path) -> TrainLog:
    log = TrainLog.create(run_dir, META)
    log.worker("w0", backend="cuda", host="gpu-a", pid=4101, state="ready", restarts=0)
    log.worker("w1", backend="cpu", host="gpu-b", pid=4202, state="ready", restarts=1)
    return log


@pytest.fixture
def finished_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    log = start_run(run_dir)
    for e in range(1, 5):
        log_epoch(log, e)
        if e == 2:
            log.fault(2, "w1", "inner", "process exited (SIGKILL)", 1.3, 4200)
    log.mark("finished")
    log.set_meta({"created": 1000.0, "finished": 1042.5})  # a fixed elapsed time for the golden
    log.close()
    return run_dir


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def rendered(run_dir: Path, width: int = 100) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(frame(read(run_dir), width=width, now=2000.0))
    return console.export_text()


def test_frame_matches_golden(finished_run: Path) -> None:
    text = rendered(finished_run)
    golden = GOLDEN / "dashboard.txt"
    if os.environ.get("LMPM_UPDATE_GOLDEN") or not golden.exists():
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")


def test_frame_parts(finished_run: Path) -> None:
    text = rendered(finished_run)
    for part in (
        "examples/bytelm.lmpm (ByteLM)",
        "finished",
        "4 / 4",
        "42.5 s",
        "policy   diloco",
        "outer_lr=0.7 momentum=0.9 nesterov",
        "2 (local driver)",
        "8 inner steps, batch 4",
        "gpu-b",
        "4202",
        "16,384",
        "last 3.0 MiB · total 12.0 MiB",
        "step 1",
        "32",
        "eval loss per epoch",
        "process exited",
        "projected",
        "1 / 24",
    ):
        assert part in text, part


def test_top_once_through_the_cli(finished_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    rc, out, err = cli("top", str(finished_run), "--once")
    assert rc == 0, err
    assert [line.rstrip() for line in out.splitlines()] == [
        line.rstrip() for line in rendered(finished_run).splitlines()
    ]
    # stdout not a terminal: one frame even without --once
    assert cli("top", str(finished_run)) == (0, out, "")


def test_top_once_real_process(finished_run: Path) -> None:
    env = {**os.environ, "COLUMNS": "100"}
    env.pop("FORCE_COLOR", None)
    res = subprocess.run(
        [sys.executable, "-m", "lmpm", "top", str(finished_run), "--once"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "outer_lr=0.7 momentum=0.9 nesterov" in res.stdout
    assert "Traceback" not in res.stderr


def test_loss_plot_shape() -> None:
    """A decreasing loss draws high on the left and low on the right; eval marks are drawn."""
    xs = list(range(1, 41))
    ys = [step_loss(x) for x in xs]
    lines = [t.plain for t in loss_plot(xs, ys, [(40.0, ys[-1])], width=60, height=8)]
    plot = [line.split("┤", 1)[-1].split("│", 1)[-1] for line in lines[:8]]
    width = {len(p) for p in plot}
    assert len(width) == 1

    def rows_with_ink(col: int) -> list[int]:
        return [r for r, p in enumerate(plot) if p[col] != " "]

    assert rows_with_ink(0) == [0]  # the first point is the highest loss
    assert max(rows_with_ink(len(plot[0]) - 1)) == 7  # the last is at the bottom
    assert "●" in plot[7]
    assert lines[0].lstrip().startswith(f"{max(ys):.4g}")
    assert lines[7].lstrip().startswith(f"{min(ys):.4g}")


def test_flat_and_empty_history(tmp_path: Path) -> None:
    log = start_run(tmp_path / "run")
    log.close()
    assert "waiting for the first epoch" in rendered(tmp_path / "run")
    lines = loss_plot([1.0, 2.0], [3.0, 3.0], width=30, height=4)  # a flat loss: no zero range
    assert any("⠉" in t.plain or "⣀" in t.plain or "⠤" in t.plain for t in lines)


def test_failed_run_shows_error(tmp_path: Path) -> None:
    log = start_run(tmp_path / "run")
    log_epoch(log, 1)
    log.mark("failed", error="worker w1 lost: no heartbeat for 30 s")
    log.close()
    text = rendered(tmp_path / "run")
    assert "failed" in text
    assert "worker w1 lost" in text


def test_top_follows_a_live_run_until_it_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    start_run(run_dir).close()
    done = threading.Event()

    def train() -> None:
        log = TrainLog.open(run_dir)  # this thread's own connection
        for e in range(1, 4):
            time.sleep(0.15)
            log_epoch(log, e)
        log.mark("finished")
        log.close()
        done.set()

    result: list[tuple[int, str, str]] = []
    writer = threading.Thread(target=train)
    reader = threading.Thread(
        target=lambda: result.append(cli("top", str(run_dir), "--interval", "0.05", "--follow"))
    )
    writer.start()
    reader.start()
    reader.join(timeout=30)
    writer.join(timeout=30)
    assert not reader.is_alive(), "lmpm top did not exit after the run finished"
    assert done.is_set()
    rc, out, err = result[0]
    assert rc == 0, err
    assert "finished" in out  # the final frame
    assert "3 / 4" in out


def test_top_live_in_a_terminal_exits_on_ctrl_c(tmp_path: Path) -> None:
    """The rich Live path in a real pseudo-terminal: it redraws, and Ctrl-C ends it with 0."""
    run_dir = tmp_path / "run"
    log = start_run(run_dir)
    log_epoch(log, 1)
    log.close()  # status stays "running"
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "100", "LINES": "60", "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmpm", "top", str(run_dir), "--interval", "0.05"],
        stdin=slave,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # a full pty buffer would block the child
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    deadline = time.time() + 30
    while b"throughput" not in b"".join(chunks) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a few refreshes
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        os.close(master)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err
    screen = b"".join(chunks).decode("utf-8", "replace")
    assert "running" in screen
    assert "1 / 4" in screen


def test_top_bad_run_dirs(tmp_path: Path) -> None:
    rc, out, err = cli("top", str(tmp_path / "missing"))
    assert (rc, out) == (1, "")
    assert "D001" in err and "no train.db" in err and "Traceback" not in err
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "lmpm.db").write_bytes(b"")
    rc, _, err = cli("top", str(tmp_path / "cells"))
    assert rc == 1 and "D001" in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    con = sqlite3.connect(foreign / "train.db")
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    con.execute("INSERT INTO meta VALUES ('kind', '\"cells\"')")
    con.commit()
    con.close()
    rc, _, err = cli("top", str(foreign))
    assert rc == 1 and "D002" in err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "train.db").write_bytes(b"not a database" * 100)
    rc, _, err = cli("top", str(tmp_path / "junk"))
    assert rc == 1 and "Traceback" not in err and "internal error" not in err
    rc, _, err = cli("top", str(tmp_path / "missing"), "--interval", "-1")
    assert rc == 2 and "U050" not in err and "--interval" in err


def test_render_training_run(finished_run: Path, tmp_path: Path) -> None:
    rc, _, err = cli("render", str(finished_run))
    assert rc == 0, err
    png = finished_run / "loss.png"
    assert f"wrote {png}" in err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert not (finished_run / "render").exists()  # the cell-run pictures are not attempted
    rc, _, err = cli("render", str(finished_run), "--out", str(tmp_path / "pics"))
    assert rc == 0, err
    assert (tmp_path / "pics" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_render_training_run_without_epochs(tmp_path: Path) -> None:
    start_run(tmp_path / "run").close()
    rc, _, err = cli("render", str(tmp_path / "run"))
    assert rc == 0, err
    assert (tmp_path / "run" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_many_workers_are_capped_not_ready_first(tmp_path: Path) -> None:
    log = TrainLog.create(tmp_path / "run", {**META, "workers": 40})
    for i in range(40):
        state = "restarting" if i == 37 else "training"
        log.worker(f"w{i:02d}", backend="cpu", host="h", pid=i, state=state, restarts=0)
    log.close()
    text = rendered(tmp_path / "run")
    assert "w37" in text and "restarting" in text  # shown although it sorts last
    assert "w00" in text and "w39" not in text
    assert "24 more workers" in text


def test_policy_as_a_kind_with_top_level_parameters() -> None:
    meta = {"policy": "diloco", "momentum": 0.0, "outer_lr": 0.5, "nesterov": False, "batch": 3}
    assert policy_text(meta) == "diloco(outer_lr=0.5, momentum=0.0)"
    meta = {"policy": {"kind": "diloco", "nesterov": True, "momentum": 0.9, "outer_lr": 0.7}}
    assert policy_text(meta) == "diloco(outer_lr=0.7, momentum=0.9, nesterov)"
    assert policy_text({}) == "?"


def test_top_and_trace_show_the_same_loss_in_one_unit(finished_run: Path) -> None:
    """`lmpm top` and `lmpm trace` read the same nats from the log and print the same bits."""
    last = read(finished_run).epochs[-1]
    want = f"{last['loss'] / math.log(2):.4f}"
    eval_want = f"{last['eval_loss'] / math.log(2):.4f}"
    top = rendered(finished_run)
    assert f"last {want} · eval {eval_want} bits" in top and "bits/token" in top
    rc, out, _ = cli("trace", str(finished_run))
    assert rc == 0
    assert "loss in bits/token" in out and want in out and eval_want in out
    assert f"{last['loss']:.4f}" not in top  # nats nowhere
