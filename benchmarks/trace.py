"""Cost of the commit log and the constraint trace on the seed's video program.

examples/video.lmpm at Vid 16×64×64 (+ Txt 77, Coarse 16×8×8) with the null bindings of
benchmarks/runtime.py (random proposals, zero scores), red-black schedule, every constraint live.
Each configuration runs the same epochs from the same seed in a fresh engine, ``--repeat`` times,
interleaved; the minimum wall time of the epoch loop (observers included) is kept.

Prints JSON lines:
- ``trace_overhead``: ``--trace summary`` against ``--trace off`` (both with the commit log).
  Goal ≤ 10 %. ``trace_ms_per_epoch_measured`` is the tracer's own time per epoch (turning the
  epoch's metadata into rows; SQLite not included), steadier than the ratio on a busy machine.
- ``trace_cells``: ``--trace cells`` on a 32×32 region (``Vid[0, 0..31, 0..31]``) against off.
- ``commit_log``: the log's cost per epoch (ms; with the log against no log at all, and as
  measured inside the observer) and the database size per million committed cells.
- ``commit_floor``: SQLite's own cost of a one-cell epoch (a decode's), the log's and the payload
  store's schemas in a temporary directory, µs per epoch: an empty transaction (the floor of any
  epoch that is its own transaction), the log's epoch (its commit row, two summary rows, its
  epoch row) and the store's row; with ``synchronous=NORMAL`` (the default) and ``FULL``
  (``--durable``), and the log's epochs grouped ``GROUP`` to a transaction (what a group commit
  would save; LMPM does not group: each epoch is durable before the next starts, docs/trace.md);
  the close of both after those epochs (ms); in the run's pages (``page_size``) and, as the
  baseline, SQLite's default 4 KiB (``*_4k``, NORMAL).

    python benchmarks/trace.py [--epochs 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lmpm.ir import compile_file  # noqa: E402
from lmpm.models.null import random_tokens  # noqa: E402
from lmpm.resolve.plan import Plan  # noqa: E402
from lmpm.runtime.control.commitlog import CommitLog, RunInfo, program_hash  # noqa: E402
from lmpm.runtime.control.engine import Engine  # noqa: E402
from lmpm.runtime.control.trace import Tracer, parse_region  # noqa: E402
from lmpm.runtime.rundir import DB_NAME  # noqa: E402
from lmpm.runtime.session import Run  # noqa: E402
from runtime import BINDINGS, params  # noqa: E402

PROGRAM = ROOT / "examples" / "video.lmpm"
REGION = "Vid[0, 0..31, 0..31]"
# Any further model the example binds (e.g. a coarse proposer) is a null model too.
NULL_BINDINGS: dict[str, Any] = {**BINDINGS, "CoarseGen": random_tokens}


def setup() -> tuple[Any, Plan, dict[str, int]]:
    """The plan is built once (gather tables for 66k cells take seconds); each run gets a fresh
    engine on it."""
    p = params(16, 64, 64)
    front = compile_file(PROGRAM, overrides=p)
    run = Run(front, params=p, bindings=NULL_BINDINGS, seed=0)
    return front, run.plan, p


def one(
    config: str, epochs: int, run_dir: Path, front: Any, plan: Plan, p: dict[str, int]
) -> dict[str, float]:
    engine = Engine(plan, seed=0)
    text = b"a red square moves left under a blue sky"
    n = plan.values["Txt"].ncells
    payload = torch.zeros(n, dtype=torch.int64)
    payload[: len(text)] = torch.tensor(list(text))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[: len(text)] = True
    engine.dataplane.set_input("Txt", payload, mask)  # its owner marks the cells committed
    log = None
    tracer = None
    if config != "none":
        level = {"off": "off", "durable": "summary"}.get(config, config)
        region = None
        if level == "cells":
            region = parse_region(REGION, {n: vp.dims for n, vp in plan.values.items()})
        tracer = None if level == "off" else Tracer(plan, level, region)
        info = RunInfo(
            program_hash(front.ir),
            str(PROGRAM),
            PROGRAM.read_text(),
            p,
            (),
            0,
            "cpu",
            epochs,
            None,
            level,
            None if region is None else str(region),
            10_000,
            durable=config == "durable",
        )
        log = CommitLog(run_dir, info, tracer=tracer)
        engine.observers.append(log)
    res = engine.run(epochs)
    out = {"seconds": res.seconds, "commits": float(res.commits)}
    if log is not None:
        out["log_seconds"] = log.log_seconds
        out["trace_seconds"] = 0.0 if tracer is None else tracer.seconds
        log.close()
        files = [*run_dir.glob(f"{DB_NAME}*"), *run_dir.glob("payload/*.db*")]  # log + store
        out["db_bytes"] = float(sum(f.stat().st_size for f in files))
    return out


GROUP = 8  # epochs per transaction in commit_floor's group-commit row
FLOOR_EPOCHS = 400  # epochs per timed batch in commit_floor (a multiple of 10 * GROUP)


def _floor_rows(e: int) -> tuple[tuple[Any, ...], list[tuple[Any, ...]], tuple[Any, ...]]:
    """A one-cell epoch's log rows: its commit row, two summary rows, its epoch row."""
    commit = (e, "Txt", e, e, 1, 1, 0, e, e, 0.5, 0.5, 7, b"q" + bytes(8), None, None)
    summary = [(e, 0, -1, 1, 0, 0, 0, None), (e, 0, 0, 1, 0, 0, 0, None)]
    epoch = (e, 1, 1, 2, 1, 0, 0, 0.01, 0.009, 1e-4, "[1]", time.time(), 0, 0, 0.01, 7)
    return commit, summary, epoch


def _log_epochs(conn: sqlite3.Connection, first: int, count: int) -> None:
    """``count`` one-cell epochs from ``first`` in one transaction (0: an empty transaction)."""
    from lmpm.runtime.rundir import INSERT_COMMIT, INSERT_EPOCH

    conn.execute("BEGIN IMMEDIATE")
    for e in range(first, first + count):
        commit, summary, epoch = _floor_rows(e)
        conn.execute(INSERT_COMMIT, commit)
        conn.executemany("INSERT INTO trace_summary VALUES (?,?,?,?,?,?,?,?)", summary)
        conn.execute(INSERT_EPOCH, epoch)
    conn.execute("COMMIT")


def _store_row(conn: sqlite3.Connection, first: int, count: int) -> None:
    """The store's row of a one-cell epoch: one INSERT, its own transaction."""
    conn.execute("INSERT INTO rows VALUES (?,?,?,?,?,?,?)", (first, "Txt", first, 1, 1, 7, b"q0"))


def _us_per_epoch(
    step: Any, conn: sqlite3.Connection, epochs: int, group: int, repeat: int, first: int
) -> float:
    """Min over ``repeat`` batches of ``epochs`` epochs (``group`` a call) of µs per epoch; the
    batches number their epochs from ``first`` on, never twice."""
    best = float("inf")
    for r in range(repeat):
        e0 = first + r * epochs
        t0 = time.perf_counter()
        for e in range(e0, e0 + epochs, group):
            step(conn, e, group)
        best = min(best, (time.perf_counter() - t0) / epochs)
    return round(best * 1e6, 1)


def _floor(tmp: str, sync: str, page: int, reps: int) -> dict[str, float]:
    """The one-cell epoch's costs (µs) in a new log and payload store made as a run makes them
    (``page``-byte pages, WAL, ``sync``), and (``close_ms``) the close of both after them: SQLite
    folds each WAL into its database and fsyncs it, as a run's close does."""
    from lmpm.runtime.rundir import SCHEMA, STORE_SCHEMA

    conns = []
    for name, ddl in (("log", SCHEMA), ("store", STORE_SCHEMA)):
        conn = sqlite3.connect(str(Path(tmp) / f"{name}-{sync}-{page}.db"), isolation_level=None)
        conn.execute(f"PRAGMA page_size={page}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={sync}")
        conn.executescript(f"BEGIN;{ddl}COMMIT;")
        conns.append(conn)
    log, store = conns
    n = FLOOR_EPOCHS if sync == "NORMAL" else FLOOR_EPOCHS // 10  # (FULL: fsyncs)
    out = {
        "empty_txn_us": _us_per_epoch(lambda c, e, g: _log_epochs(c, e, 0), log, n, 1, reps, 0),
        "log_epoch_us": _us_per_epoch(_log_epochs, log, n, 1, reps, 0),
        "store_row_us": _us_per_epoch(_store_row, store, n, 1, reps, 0),
        "log_epoch_grouped_us": _us_per_epoch(_log_epochs, log, n, GROUP, reps, reps * n),
    }
    t0 = time.perf_counter()
    for conn in conns:
        conn.close()
    out["close_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    return out


def commit_floor(repeat: int) -> dict[str, Any]:
    """SQLite's cost per one-cell epoch (the ``commit_floor`` line; see the module doc)."""
    from lmpm.runtime.rundir import PAGE_SIZE

    out: dict[str, Any] = {"benchmark": "trace", "case": "commit_floor", "group": GROUP}
    out["page_size"] = PAGE_SIZE
    reps = repeat + 2
    with tempfile.TemporaryDirectory() as tmp:
        # the baseline of the page size's ratio: SQLite's default 4 KiB pages (the runs of the
        # versions before PAGE_SIZE), NORMAL, measured first
        base = _floor(tmp, "NORMAL", 4096, reps)
        for sync in ("NORMAL", "FULL"):
            for k, v in _floor(tmp, sync, PAGE_SIZE, reps).items():
                out[f"{k}_{sync.lower()}"] = v
    for k in ("log_epoch_us", "store_row_us", "close_ms"):
        out[f"{k}_normal_4k"] = base[k]
    # the ratios: the log's epoch against the bare transaction it cannot go below, and against
    # the same epoch in 4 KiB pages
    out["log_epoch_over_empty_txn"] = round(
        out["log_epoch_us_normal"] / out["empty_txn_us_normal"], 2
    )
    out["log_epoch_over_4k_pages"] = round(out["log_epoch_us_normal"] / base["log_epoch_us"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a short run for the benchmark summary (python -m benchmarks)",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    args = ap.parse_args()
    if args.quick:
        args.epochs, args.repeat = 4, 1
    torch.set_num_threads(args.threads)
    print(json.dumps(commit_floor(args.repeat)), flush=True)
    front, plan, p = setup()
    configs = ["none", "off", "summary", "cells", "durable"]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for c in configs:
                d = Path(tmp) / f"{c}{rep}"
                t0 = time.perf_counter()
                runs[c].append(one(c, args.epochs, d, front, plan, p))
                sys.stderr.write(
                    f"{c} #{rep}: {runs[c][-1]['seconds']:.3f}s "
                    f"(with setup {time.perf_counter() - t0:.1f}s)\n"
                )
    best = {c: min(r["seconds"] for r in rs) for c, rs in runs.items()}
    med = {c: statistics.median(r["seconds"] for r in rs) for c, rs in runs.items()}
    e = args.epochs
    commits = runs["off"][0]["commits"]
    print(
        json.dumps(
            {
                "benchmark": "trace",
                "case": "trace_overhead",
                "cells": 16 * 64 * 64,
                "epochs": e,
                "off_s": round(best["off"], 4),
                "summary_s": round(best["summary"], 4),
                "overhead": round(best["summary"] / best["off"] - 1, 4),
                "overhead_median": round(med["summary"] / med["off"] - 1, 4),
                "trace_ms_per_epoch_measured": round(
                    min(r["trace_seconds"] for r in runs["summary"]) / e * 1000, 3
                ),
                "goal": 0.10,
            }
        ),
        flush=True,
    )
    print(
        json.dumps(
            {
                "benchmark": "trace",
                "case": "trace_cells",
                "region": REGION,
                "epochs": e,
                "cells_s": round(best["cells"], 4),
                "overhead": round(best["cells"] / best["off"] - 1, 4),
                "overhead_median": round(med["cells"] / med["off"] - 1, 4),
                "db_mb": round(runs["cells"][0]["db_bytes"] / 2**20, 2),
            }
        ),
        flush=True,
    )
    print(
        json.dumps(
            {
                "benchmark": "trace",
                "case": "durable",
                "epochs": e,
                "summary_s": round(best["summary"], 4),
                "durable_s": round(best["durable"], 4),
                "overhead": round(best["durable"] / best["summary"] - 1, 4),
                "fsync_ms_per_epoch": round((best["durable"] - best["summary"]) / e * 1000, 2),
            }
        ),
        flush=True,
    )
    log_ms = min(r["log_seconds"] for r in runs["off"]) / e * 1000
    print(
        json.dumps(
            {
                "benchmark": "trace",
                "case": "commit_log",
                "epochs": e,
                "commits": int(commits),
                "epoch_ms_without_log": round(best["none"] / e * 1000, 2),
                "epoch_ms_with_log": round(best["off"] / e * 1000, 2),
                "log_ms_per_epoch": round((best["off"] - best["none"]) / e * 1000, 2),
                "log_ms_per_epoch_measured": round(log_ms, 2),
                "db_mb_per_million_cells": round(runs["off"][0]["db_bytes"] / commits, 2),
                "db_mb_per_million_cells_summary": round(
                    runs["summary"][0]["db_bytes"] / commits, 2
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
