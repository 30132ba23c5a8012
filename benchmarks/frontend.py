"""Front-end speed: parse + check of a generated 5,000-line program, and `lmpm check` wall time.

Prints one JSON line. Goals (issue 2): >= 20,000 lines/s; `lmpm check examples/video.lmpm` < 0.5 s
for the whole process. `lines_per_s` reuses the checker's per-structure caches across runs (as one
process checking many programs does); `lines_per_s_cold_caches` clears them before every run;
`lines_per_cpu_s` counts CPU time, which other load on the machine disturbs less than wall time. The baseline of the second number is the bare interpreter start-up
(`python -c pass`), measured in the same run, so the ratio shows LMPM's own share.

    python benchmarks/frontend.py [--lines 5000] [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_BLOCK = """\
// block {k}: a video value with a caption, a coarse grid and a causal caption model
param W{k} = 32
param H{k} = 32
value A{k} : Token[16] shape Grid3D(4, W{k}, H{k}) clock Lamport
value C{k} : Token[Byte] shape Grid3D(4, W{k}/8, H{k}/8) clock Lamport
value S{k} : Token[Byte] shape Seq(64) clock Lamport
visible A{k}[t,x,y] <- A{k}[t,x+dx,y+dy] when (dx,dy) in N8
visible A{k}[t,x,y] <- A{k}[t-1,x,y] when t > 0
visible A{k}[t,x,y] <- S{k}[*]
visible A{k}[t,x,y] <- C{k}[t, x/8, y/8]
visible S{k}[i] <- S{k}[0..i-1] when i > 0
rule Gen{k}:
  on A{k}[t,x,y]
  read {{neighbors in N8, prev_frame, txt = S{k}[*], C{k}?}}
  emit proposal A{k}[t,x,y] := Model(neighbors, prev_frame, txt, c{k})
  score ModelScore(...)
rule Lm{k}:
  on S{k}[i] when i > 0
  read {{context = S{k}[0..i-1]}}
  emit proposal S{k}[i] := ByteLM(context, temperature=1)
constraint Lock{k}:
  forbid change(A{k}[t, 0..3, 0..3]) priority 100
constraint Causal{k}:
  forbid read_future(A{k}[t,x,y]) priority 1000
commit A{k}[*] using satisfy(max_constraints_then_score)
commit S{k}[*] using satisfy(max_constraints_then_score)

"""


def generate(lines: int) -> str:
    """A valid program of about ``lines`` lines (a realistic mix of every statement kind)."""
    out: list[str] = []
    n = 0
    k = 0
    while n < lines:
        block = _BLOCK.format(k=k)
        out.append(block)
        n += block.count("\n")
        k += 1
    return "".join(out)


def bench_frontend(lines: int, runs: int, *, cold: bool) -> tuple[int, float, float]:
    """Median seconds to parse + check. ``cold``: forget the checker's per-structure caches (compiled
    clauses, probed facts) before every run, so nothing learnt from an earlier run is reused."""
    import importlib

    from lmpm.ir import compile_source

    check_mod = importlib.import_module("lmpm.ir.check")
    text = generate(lines)
    n = text.count("\n")
    compile_source(text, "<bench>")  # warm-up: imports; also proves the program is valid
    times, cpu = [], []
    for _ in range(runs):
        if cold:
            check_mod.clear_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        compile_source(text, "<bench>")
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return n, statistics.median(times), statistics.median(cpu)


def bench_process(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lines", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short run for the benchmark summary (python -m benchmarks)",
    )
    args = ap.parse_args()
    if args.quick:
        args.lines, args.runs = 2000, 3
    n, secs, cpu = bench_frontend(args.lines, args.runs, cold=False)
    _, cold, _ = bench_frontend(args.lines, args.runs, cold=True)
    check = [sys.executable, "-m", "lmpm.cli", "check", "examples/video.lmpm"]
    wall = bench_process(check, args.runs)
    bare = bench_process([sys.executable, "-c", "pass"], args.runs)
    print(
        json.dumps(
            {
                "benchmark": "frontend",
                "lines": n,
                "parse_check_s": round(secs, 4),
                "lines_per_s": round(n / secs),
                "lines_per_s_cold_caches": round(n / cold),
                "lines_per_cpu_s": round(n / cpu),  # less sensitive to other load on the machine
                "lines_per_s_goal": 20000,
                "check_video_wall_s": round(wall, 4),
                "check_video_wall_goal_s": 0.5,
                "python_startup_s": round(bare, 4),
                "check_vs_startup_ratio": round(wall / bare, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
