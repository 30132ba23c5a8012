"""`lmpm run` of a training program, end to end in real subprocesses (small sizes), and its
usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmpm.cli import main
from lmpm.train import log as tlog
from lmpm.train.run import parameters

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "examples" / "train_bytelm.lmpm"
INPUTS = [
    "--input",
    f"Corpus={ROOT / 'examples' / 'train' / 'corpus.npy'}",
    "--input",
    f"Held={ROOT / 'examples' / 'train' / 'held.npy'}",
]
SMALL = ["--set", "H=2", "--set", "B=2"]


def lmpm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmpm", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_run_top_render(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = lmpm("run", str(PROGRAM), *INPUTS, *SMALL, "--epochs", "3", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "trained 3 epochs × 2 steps on 1 worker(s)" in p.stderr
    h = tlog.read(out)
    assert h.meta["status"] == "finished" and h.meta["source"] == PROGRAM.read_text()
    assert len(h.epochs) == 3 and len(h.steps) == 6
    theta = parameters(out / "Theta.safetensors")
    assert "head.weight" in theta
    top = lmpm("top", str(out), "--once")
    assert top.returncode == 0, top.stderr
    assert "finished" in top.stdout and "diloco" in top.stdout
    png = lmpm("render", str(out))
    assert png.returncode == 0, png.stderr
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same directory again: refused; --force starts over
    again = lmpm("run", str(PROGRAM), *INPUTS, *SMALL, "--epochs", "1", "--out", str(out))
    assert again.returncode == 1 and "already holds a run" in again.stderr
    forced = lmpm(
        "run", str(PROGRAM), *INPUTS, *SMALL, "--epochs", "1", "--out", str(out), "--force"
    )
    assert forced.returncode == 0, forced.stderr
    assert len(tlog.read(out).epochs) == 1


def test_injected_kill_is_survived_and_recorded(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "run"
    p = lmpm(
        "run",
        str(PROGRAM),
        *INPUTS,
        *SMALL,
        "--epochs",
        "3",
        "--workers",
        "2",
        "--out",
        str(out),
        env={"LMPM_INJECT_FAULT": "w1:propose:2"},
    )
    assert p.returncode == 0, p.stderr
    assert "1 worker fault(s) survived" in p.stderr
    h = tlog.read(out)
    assert [(f["worker"], f["epoch"], f["cause"]) for f in h.faults] == [("w1", 2, "died")]
    top = lmpm("top", str(out), "--once")
    assert "w1" in top.stdout and "died" in top.stdout
    trace = lmpm("trace", str(out))
    assert trace.returncode == 0, trace.stderr
    assert "epoch 2: w1 died in propose" in trace.stdout and "restarts: w1 1" in trace.stdout
    js = json.loads(lmpm("trace", str(out), "--json").stdout)
    assert js["kind"] == "train" and [e["epoch"] for e in js["epochs"]] == [1, 2, 3]
    assert js["restarts"] == {"w1": 1}
    cell = lmpm("trace", str(out), "--cell", "Theta[0]")
    assert cell.returncode == 2 and "apply to cell runs" in cell.stderr


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "needs --epochs N"),
        (["--epochs", "1", "--trace", "cells"], "--trace applies to cell programs"),
        (["--epochs", "1", "--driver", "process"], "--driver process: a training run"),
        (["--epochs", "1", "--compile"], "--compile compiles the epoch step of cell programs"),
        (["--epochs", "1", "--input", "Nope=x.npy"], "no data value `Nope`"),
    ],
)
def test_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    rc = main(["run", str(PROGRAM), *INPUTS, *SMALL, "--out", str(tmp_path / "r"), *extra])
    assert rc == 2
    assert says in capsys.readouterr().err


def test_missing_data_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", str(PROGRAM), "--epochs", "1", "--out", str(tmp_path / "r")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "needs every data value" in err and "Corpus=FILE" in err and "Held=FILE" in err


def test_bad_data_file_is_an_input_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "c.npy"
    import numpy as np

    np.save(bad, np.zeros((3, 3), dtype=np.int64))
    rc = main(
        [
            "run",
            str(PROGRAM),
            "--input",
            f"Corpus={bad}",
            *INPUTS[2:],
            *SMALL,
            "--epochs",
            "1",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "[64, 8192]" in err and "Traceback" not in err


def test_kill_9_then_resume_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """SIGKILL of a training run after two logged epochs; --resume finishes it with the same
    parameters, epoch for epoch, as a run that was never interrupted (θ, outer momentum, inner
    optimizer states and schedule steps come back from the checkpoints)."""
    import signal
    import sqlite3
    import time

    # epochs of ~0.5 s: the kill lands in the middle of the third or a later one
    args = [str(PROGRAM), *INPUTS, "--set", "H=40", "--set", "B=8", "--epochs", "6"]
    whole = tmp_path / "whole"
    assert lmpm("run", *args, "--out", str(whole)).returncode == 0
    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmpm", "run", *args, "--out", str(cut)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    done = 0
    while done < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
        try:
            conn = sqlite3.connect(f"file:{tlog.db_path(cut)}?mode=ro", uri=True)
            done = conn.execute("SELECT COUNT(*) FROM train_epochs").fetchone()[0]
            conn.close()
        except sqlite3.Error:
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    logged = len(tlog.read(cut).epochs)
    assert 2 <= logged < 6
    assert tlog.read(cut).meta["status"] == "running"  # killed: nobody marked it
    top = lmpm("top", str(cut), "--once")  # ... but its process is gone, and top says so
    assert "stopped" in top.stdout and "--resume" in top.stdout
    r = lmpm("run", "--resume", str(cut))
    assert r.returncode == 0, r.stderr
    assert f"resumed at epoch {logged + 1}" in r.stderr
    a, b = tlog.read(whole), tlog.read(cut)
    assert [e["checksum"] for e in a.epochs] == [e["checksum"] for e in b.epochs]
    assert b.meta["status"] == "finished" and len(b.meta["resumes"]) == 1
    again = lmpm("run", "--resume", str(cut))
    assert again.returncode == 0 and "nothing to do" in again.stderr
    bad = lmpm("run", "--resume", str(cut), "--epochs", "7", "--workers", "3")
    assert bad.returncode != 0 and "trained on 1 workers" in bad.stderr


CONSTRAINED = """\
param H = 3
value Corpus : Token[Byte] shape Grid2D(64, 8192) clock Lamport
value Held : Token[Byte] shape Grid2D(64, 512) clock Lamport
value Theta : Params[ByteLM] shape Blocks() clock Lamport

rule Fit:
  on Theta[*]
  read {data = Corpus[*], held = Held[*]}
  emit proposal Theta[*] := minimize(NextByteLoss(Theta, data), steps=H, batch=4, lr=1e-2)
  score NextByteLoss(Theta, held)

constraint Frozen:
  forbid change(Theta["blocks.0"]) priority 1000

constraint Bounded:
  require NormAtMost(Theta["head"], 4.5) priority 10

commit Theta[*] using satisfy(max_constraints_then_score)
"""


def test_constraints_of_a_program_hold_and_are_traced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A program's freeze (Blocks() cells) keeps blocks.0 bit-identical; its norm bound is enforced
    on the committed head; both are in the trace; `satisfy` commits one replica's parameters."""
    import torch

    from lmpm.train.modules import MODULES

    prog = tmp_path / "constrained.lmpm"
    prog.write_text(CONSTRAINED)
    out = tmp_path / "run"
    rc = main(["run", str(prog), *INPUTS, "--epochs", "3", "--workers", "2", "--driver",
               "single", "--out", str(out), "--quiet"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    theta = parameters(out / "Theta.safetensors")
    torch.manual_seed(0)
    init = dict(MODULES["ByteLM"]().named_parameters())
    for name, t in theta.items():
        assert torch.equal(t, init[name].detach()) == name.startswith("blocks.0."), name
    head = torch.sqrt(sum((theta[n].double() ** 2).sum() for n in theta if n.startswith("head.")))
    assert float(head) <= 4.5 + 1e-4
    rep = tlog.read(out)
    acts = {(c["name"], c["action"]) for c in rep.constraints}
    assert ("Frozen", "frozen") in acts and ("Bounded", "projected") in acts
    assert all(e["frozen"] == 1 for e in rep.epochs)
    assert main(["trace", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Frozen (freeze)" in text and "Bounded (norm)" in text


def test_initial_parameters_must_be_the_modules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = ROOT / "src" / "lmpm" / "models" / "weights" / "localgen.safetensors"
    rc = main(["run", str(PROGRAM), *INPUTS, *SMALL, "--input", f"Theta={other}", "--epochs",
               "1", "--out", str(tmp_path / "r")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and "does not hold the parameters of ByteLM" in err and "Traceback" not in err
    shipped = ROOT / "src" / "lmpm" / "models" / "weights" / "bytelm.safetensors"
    rc = main(["run", str(PROGRAM), *INPUTS, *SMALL, "--input", f"Theta={shipped}", "--epochs",
               "1", "--out", str(tmp_path / "ok"), "--quiet"])  # fmt: skip
    assert rc == 0
    # started from the shipped model: already good on the held-out rows (~0.3 bits/byte)
    assert tlog.read(tmp_path / "ok").epochs[0]["eval_loss"] < 0.25
