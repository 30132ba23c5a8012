"""`lmpm run` as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROG = """
param N = 6
value Txt : Token[Byte] shape Seq(N)
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Gen:
  on Txt[t]
  read {ctx = Txt[0..t-1]}
  emit proposal Txt[t] := RandomTokens(ctx, k=4)
constraint Lower: require Txt[t] in Set("abcdefghijklmnopqrstuvwxyz") priority 10
commit Txt[*] using satisfy(max_constraints_then_score)
"""


def lmpm(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmpm.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_run_writes_outputs_and_same_seed_is_identical(tmp_path: Path) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROG)
    outs = []
    for i in range(2):
        res = lmpm(
            "run",
            str(prog),
            "--epochs",
            "8",
            "--seed",
            "5",
            "--trace",
            "off",
            "--out",
            str(tmp_path / f"r{i}"),
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stderr
        assert "Traceback" not in res.stderr
        outs.append((tmp_path / f"r{i}" / "Txt.npy").read_bytes())
        text = json.loads((tmp_path / f"r{i}" / "Txt.json").read_text())
        assert len(text) == 6 and all(x is None or 97 <= x <= 122 for x in text)
    assert outs[0] == outs[1]


def test_run_input_text_and_usage_errors(tmp_path: Path) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROG)
    (tmp_path / "seed.txt").write_text("ab")
    res = lmpm(
        "run", str(prog), "--input", "Txt=seed.txt", "--epochs", "3", "--out", "r", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "r" / "Txt.json").read_text())[:2] == [97, 98]
    bad = lmpm("run", str(prog), "--set", "Q=1", cwd=tmp_path)
    assert bad.returncode == 2 and "N" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "long.txt").write_text("abcdefghij")
    res = lmpm("run", str(prog), "--input", "Txt=long.txt", "--out", "r2", cwd=tmp_path)
    assert res.returncode == 1 and "10 bytes" in res.stderr and "Traceback" not in res.stderr
    res = lmpm("run", str(prog), "--input", "Nope=seed.txt", "--out", "r3", cwd=tmp_path)
    assert res.returncode == 2 and "Txt" in res.stderr
