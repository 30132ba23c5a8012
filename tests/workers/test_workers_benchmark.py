"""benchmarks/backends.py at a tiny scale: both sides run and its own output check passes.

The script exits non-zero (SystemExit with the graph named) when LMPM's outputs differ from the
baseline's, so this keeps the Monty-style update and the small-model workload honest between
benchmark runs. Timings at this scale mean nothing and are not looked at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("--scale", "0.03", "--repeat", "1", "--threads", "1")


def test_backends_benchmark_outputs_agree_at_small_scale() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "backends.py"), *SMALL],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    workloads = {line["workload"]: line for line in lines}
    assert {"monty", "small_model", "cuda"} <= set(workloads)
    for name in ("monty", "small_model"):
        assert workloads[name]["baseline_s"] > 0 and workloads[name]["lmpm_s"] > 0
    assert workloads["monty"]["params"]["k"] == 3
