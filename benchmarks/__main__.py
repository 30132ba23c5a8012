"""`python -m benchmarks`: every benchmark's quick mode, then one table of claim, goal, measured.

Each script runs in its own process with ``--quick`` (a few epochs / repeats / a smaller scale: a
quick number is indicative, the script's full run is the measurement of record) and prints JSON
lines; this module reads them and checks each claim against its goal. A goal that regresses shows
as FAIL here before the change lands. Exit status 1 when any claim fails or any script breaks.

    python -m benchmarks                 # all quick runs (a few minutes on 2 cores)
    python -m benchmarks --only trace    # one script
    scripts/bench.sh                     # the same, from the repository root

``masks.py`` has no quick mode: each of its measurements is a fresh process at sizes where the
baseline runs out of memory or time, minutes in all; run it alone (``python benchmarks/masks.py``).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = (
    "frontend",
    "runtime",
    "trace",
    "trace_k",
    "examples",
    "sudoku",
    "backends",
    "planes",
    "vm",
    "epoch_overhead",
    "distributed",
    "training",
    "compile",
    "hf",
)
TIMEOUT_S = 300  # per script
LONGER = {"training": 600}  # scripts whose quick mode needs more (the issue allows 10 minutes)


@dataclass(frozen=True)
class Claim:
    script: str
    claim: str
    match: dict[str, Any]  # the JSON line's fields that select it
    field: str  # the measured number
    op: str  # ">=", "<=" or "=="
    goal: float | None  # None: the line's own "goal" field
    fmt: Callable[[float], str] = lambda x: f"{x:,.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


CLAIMS = (
    Claim("frontend", "parse + check speed (lines/s)", {}, "lines_per_s", ">=", 20_000),
    Claim("frontend", "`lmpm check examples/video.lmpm` wall (s)", {}, "check_video_wall_s", "<=",
          0.5),
    Claim("runtime", "control plane attempts/s (video 16×64×64)", {"case": "throughput"},
          "control_plane_attempts_per_s", ">=", 1_000_000),
    Claim("runtime", "speed-up vs the reference interpreter", {"case": "vs_reference"}, "ratio",
          ">=", 100),
    Claim("trace", "`--trace summary` overhead vs off", {"case": "trace_overhead"}, "overhead",
          "<=", 0.10, _pct),
    Claim("trace_k", "default trace per epoch, k=50257 / k=8 candidates", {"case": "trace_k"},
          "ratio", "<=", 3.0, lambda x: f"{x:.2f}×"),
    Claim("examples", "video.lmpm: time outside the model", {"case": "video_run"},
          "outside_model_share", "<=", 0.10, _share),
    Claim("examples", "video.lmpm: HardLock cells unchanged", {"case": "video_run"},
          "hardlock_unchanged", ">=", 1.0, _share),
    Claim("examples", "text.lmpm: time outside the model", {"case": "text_run"},
          "outside_model_share", "<=", 0.10, _share),
    Claim("sudoku", "sudoku solve rate (quick: 10 puzzles)", {}, "solve_rate", ">=", 0.95, _share),
    Claim("backends", "Monty evidence update: one dispatch vs loop", {"workload": "monty"},
          "ratio", ">=", None),
    Claim("backends", "small MLP per object: one dispatch vs loop", {"workload": "small_model"},
          "ratio", ">=", None),
    Claim("planes", "control-plane bytes/epoch, Tensor[256] vs Token[16]",
          {"case": "control_plane_bytes"}, "ratio", "==", 1.0),
    Claim("vm", "VM share of a workflow step (ByteLM streams, compiled)", {"case": "model_share"},
          "vm_share", "<=", 0.05, _share),
    Claim("vm", "VM step (compiled) vs per-stream Python loop, 1,024 streams",
          {"case": "vm_step", "streams": 1024}, "ratio", ">=", 100),
    Claim("distributed", "video 16×64×64 LocalGen: 2 Ray workers vs 1", {"case": "scaling"},
          "ratio", ">=", 1.6, lambda x: f"{x:.2f}×"),
    Claim("distributed", "control plane per epoch, 4 workers above 1 (ms)", {"case": "control"},
          "above_ms", "<=", 3.0, lambda x: f"{x:.1f} ms"),
    Claim("distributed", "driver CPU per epoch, 4 Ray workers (ms)", {"case": "control"},
          "driver_cpu_ms", "<=", 2.0, lambda x: f"{x:.1f} ms"),
    Claim("distributed", "control bytes/epoch, 64×64 / 32×32 grid (2 workers, Tensor[256])",
          {"case": "halo"}, "growth", "<=", 1.25, lambda x: f"{x:.2f}×"),
    Claim("distributed", "control bytes / halo bytes, 64×64 (2 workers, Tensor[256])",
          {"case": "halo"}, "ratio", "<=", 0.01, _share),
    Claim("distributed", "SIGKILL of a worker to progress again (s)", {"case": "recovery"},
          "kill_to_progress_s", "<=", 5.0, lambda x: f"{x:.2f} s"),
    Claim("distributed", "commits identical with a killed worker", {"case": "recovery"},
          "identical", "==", 1.0, lambda x: "yes" if x else "NO"),
    Claim("training", "DiLoCo H=50: bytes / synchronous (H=1) baseline's", {"case": "diloco"},
          "bytes_ratio", "<=", 1 / 40, lambda x: f"1/{1 / x:.0f}"),
    Claim("training", "DiLoCo H=50: held-out loss / baseline's", {"case": "diloco"},
          "loss_ratio", "<=", 1.03, lambda x: f"{x:.3f}"),
    Claim("training", "worker SIGKILLed mid inner loop: loss / fault-free", {"case": "fault"},
          "loss_ratio", "<=", 1.03, lambda x: f"{x:.3f}"),
    Claim("compile", "text.lmpm --compile: time outside the model", {"case": "text"},
          "compiled_outside_share", "<=", 0.05, _share),
    Claim("compile", "video.lmpm --compile: time outside the model", {"case": "video"},
          "compiled_outside_share", "<=", 0.05, _share),
    Claim("compile", "--compile control-plane attempts/s vs eager (16×64×64)",
          {"case": "throughput"}, "ratio", ">=", 2.0, lambda x: f"{x:.2f}×"),
    Claim("hf", "GPT-2 via lmpm.models.hf / HF generate, per token (N=128)",
          {"case": "single", "N": 128}, "ratio", "<=", 1.10, lambda x: f"{x:.2f}×"),
    Claim("hf", "GPT-2, 16 rows at different lengths / HF batched generate",
          {"case": "batch"}, "ratio", "<=", 1.10, lambda x: f"{x:.2f}×"),
    Claim("hf", "GPT-2 at V=50257: LMPM's time per token beside the forward, log included (ms)",
          {"case": "outside"}, "outside_forward_ms_per_token", "<=", 0.3),
)  # fmt: skip
INFO = (  # measured and shown, no goal
    ("trace", "`--durable` (synchronous=FULL) cost vs default", {"case": "durable"}, "overhead",
     _pct),
    ("trace", "`--trace cells` (32×32 region) overhead", {"case": "trace_cells"}, "overhead", _pct),
    ("training", "training tokens/s, 4 Ray workers vs 1 in-process", {"case": "scaling"}, "ratio",
     lambda x: f"{x:.2f}×"),
    ("vm", "VM step eager vs per-stream Python loop, 1,024 streams",
     {"case": "vm_step", "streams": 1024}, "ratio_eager", lambda x: f"{x:.2f}×"),
    ("vm", "VM share of a workflow step, eager", {"case": "model_share"}, "vm_share_eager",
     _share),
    *(("vm", f"VM, {k} steps per replay vs 1, 1,024 streams, no tool (per step)",
       {"case": "vm_steps_per_replay_tool_free", "streams": 1024, "k": k}, "ratio_vs_k1",
       lambda x: f"{x:.2f}×") for k in (4, 16)),
    *(("vm", f"VM host time per step, {k} steps per replay, 1,024 streams, no tool",
       {"case": "vm_steps_per_replay_tool_free", "streams": 1024, "k": k}, "host_s",
       lambda x: f"{x * 1e6:.0f} µs") for k in (1, 16)),
    ("distributed", "epoch wall, 4 Ray workers (ms)", {"case": "control"}, "workers_ms",
     lambda x: f"{x:.1f} ms"),
    ("hf", "GPT-2: a bare greedy loop's own time per token beside the forward (ms)",
     {"case": "outside"}, "bare_loop_outside_ms_per_token", lambda x: f"{x:.3f}"),
    ("hf", "GPT-2: LMPM's time beside the forward (log included) / the bare loop's",
     {"case": "outside"}, "ratio_to_bare_loop", lambda x: f"{x:.2f}×"),
    ("examples", "text.lmpm decoded by a bare hand-written loop: time outside the model",
     {"case": "text_run"}, "bare_loop_outside_share", _share),
    ("epoch_overhead", "text epoch: µs outside the model (p10)", {"case": "text"},
     "outside_us_p10", lambda x: f"{x:.0f} µs"),
    ("compile", "text --compile: the decision's graph calls alone, share of the epoch",
     {"case": "text"}, "compiled_step_calls_share", _share),
    ("compile", "text epoch outside the model: eager / --compile", {"case": "text"},
     "outside_ratio", lambda x: f"{x:.2f}×"),
    ("compile", "--compile cold: text + video steps (s)", {"case": "compile_time"},
     "text_cold_s", lambda x: f"{x:.1f} s text"),
    ("compile", "--compile warm cache: text step (s)", {"case": "compile_time"},
     "text_warm_s", lambda x: f"{x:.1f} s"),
)  # fmt: skip


def run_script(name: str) -> tuple[list[dict[str, Any]], str, float]:
    """Run one script's quick mode; (its JSON lines, an error or '', seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get(
        "PYTHONPATH", "")]))  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE / f"{name}.py"), "--quick"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=LONGER.get(name, TIMEOUT_S),
            check=False,
        )
    except subprocess.TimeoutExpired:
        limit = LONGER.get(name, TIMEOUT_S)
        return [], f"timed out after {limit} s", time.perf_counter() - t0
    lines = []
    for text in proc.stdout.splitlines():
        if text.startswith("{"):
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                pass
    err = ""
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        err = f"exit {proc.returncode}: {tail[0][:120]}"
    return lines, err, time.perf_counter() - t0


def _find(lines: list[dict[str, Any]], match: dict[str, str]) -> dict[str, Any] | None:
    for line in lines:
        if all(line.get(k) == v for k, v in match.items()):
            return line
    return None


def table(results: dict[str, tuple[list[dict[str, Any]], str, float]]) -> tuple[str, bool]:
    rows: list[tuple[str, str, str, str]] = []
    ok = True
    cmp = {">=": operator.ge, "<=": operator.le, "==": operator.eq}
    for c in CLAIMS:
        if c.script not in results:
            continue
        lines, err, _ = results[c.script]
        line = _find(lines, c.match)
        goal = c.goal if c.goal is not None else (line or {}).get("goal")
        goal_text = "?" if goal is None else f"{c.op} {c.fmt(float(goal))}"
        if line is None or c.field not in line or line[c.field] is None or goal is None:
            rows.append((c.claim, goal_text, "-", f"ERROR ({err or 'no result'})"))
            ok = False
            continue
        value = float(line[c.field])
        passed = cmp[c.op](value, float(goal))
        ok &= passed
        rows.append((c.claim, goal_text, c.fmt(value), "pass" if passed else "FAIL"))
    for script, claim, match, field, fmt in INFO:
        if script in results:
            line = _find(results[script][0], match)
            if line is not None and field in line:
                rows.append((claim, "(info)", fmt(float(line[field])), "-"))
    head = ("claim", "goal", "measured", "result")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(4)]
    out = [" | ".join(h.ljust(w) for h, w in zip(head, widths))]
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out), ok


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=SCRIPTS, help="run only these scripts")
    args = ap.parse_args()
    results = {}
    for name in args.only or SCRIPTS:
        sys.stderr.write(f"benchmarks/{name}.py --quick ...")
        sys.stderr.flush()
        results[name] = run_script(name)
        _, err, secs = results[name]
        sys.stderr.write(f" {secs:.0f} s{' ' + err if err else ''}\n")
    text, ok = table(results)
    print(text)
    total = sum(r[2] for r in results.values())
    print(f"\n{len(results)} scripts in {total:.0f} s; quick runs are indicative — the full runs "
          "(each script without --quick) are the measurements of record.")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
