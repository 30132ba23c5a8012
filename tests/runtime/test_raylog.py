"""Ray's dead-worker alarm stays off the terminal when LMPM survives the death (issue 35, item 8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmpm.runtime.data import raylog

ROOT = Path(__file__).resolve().parents[2]
ALARM = (
    "A worker died or was killed while executing a task by an unexpected system error. To "
    "troubleshoot the problem, check the logs for the dead worker. ... (1) the process was killed "
    "by the OOM killer due to high memory usage"
)


def test_only_the_dead_worker_alarm_is_dropped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ray_worker = pytest.importorskip("ray._private.worker")
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)
    raylog.quiet_worker_deaths()
    raylog.quiet_worker_deaths()  # idempotent: one wrapper
    assert getattr(ray_worker.print_to_stdstream, "lmpm_quiet", False)
    ray_worker.print_to_stdstream(
        {"lines": [ALARM], "pid": "raylet", "is_err": False}, ignore_prefix=False
    )
    ray_worker.print_to_stdstream(
        {"lines": ["some other raylet news"], "pid": "raylet", "is_err": False},
        ignore_prefix=False,
    )
    out = capsys.readouterr().out
    assert "A worker died" not in out and "some other raylet news" in out
    assert raylog.DROPPED[-1] == ALARM  # kept for whoever needs Ray's words


@pytest.mark.slow
def test_a_survived_kill_prints_lmpm_s_line_only(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    res = subprocess.run(
        [sys.executable, "-m", "lmpm", "run", "examples/latent.lmpm", "--input",
         "Z=examples/latent/z0.npy", "--epochs", "6", "--workers", "2", "--out",
         str(tmp_path / "f")],
        cwd=ROOT,
        env={**os.environ, "LMPM_INJECT_FAULT": "w1:apply:3"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    both = res.stdout + res.stderr
    assert "worker fault(s) survived" in both
    assert "A worker died" not in both and "OOM" not in both
