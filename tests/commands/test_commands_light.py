"""`lmpm check` and `lmpm trace` never import torch (they start in a fraction of a second)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lmpm

ROOT = Path(__file__).resolve().parents[2]
PROG = """param N = 6
value Txt : Token[Byte] shape Seq(N)
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Gen:
  on Txt[t]
  read {ctx = Txt[0..t-1]}
  emit proposal Txt[t] := Uniform(ctx, k=2)
constraint Lower: require Txt[t] in Set(97..122) priority 10
"""

PROBE = """
import sys
from lmpm.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "matplotlib") if m in sys.modules)
print("HEAVY", heavy, "EXIT", code)
"""


def _modules(*argv: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT, check=False
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("HEAVY"))
    return line


def test_check_imports_no_torch() -> None:
    assert _modules("check", str(ROOT / "examples" / "video.lmpm")) == "HEAVY [] EXIT 0"
    # also on the error path (a located check error) and with --strict
    assert _modules("check", "--strict", str(ROOT / "examples" / "text.lmpm")) == "HEAVY [] EXIT 0"


def test_trace_imports_no_torch(tmp_path: Path) -> None:
    run = lmpm.compile(text=PROG).runner(run_dir=tmp_path / "r", seed=1)
    run.run(4)
    run.finish()
    assert _modules("trace", str(tmp_path / "r")) == "HEAVY [] EXIT 0"
    assert _modules("trace", str(tmp_path / "r"), "--cell", "Txt[2]") == "HEAVY [] EXIT 0"
    assert _modules("trace", str(tmp_path / "r"), "--json") == "HEAVY [] EXIT 0"
