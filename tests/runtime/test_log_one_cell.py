"""A decode's epoch (one open cell) is logged from its numbers read once (``OneCell``) and its
payload checksummed in Python integers: the same rows, totals and checksums as the general paths,
and a whole run's log and payload store hold the same rows either way."""

from __future__ import annotations

import dataclasses
import sqlite3
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmpm.cli import main
from lmpm.runtime import protocol
from lmpm.runtime.control import commitlog
from lmpm.runtime.control.commitlog import CommitLog, RunInfo
from lmpm.runtime.control.trace import Tracer
from lmpm.runtime.records import EpochRecord, OneCell, ValueEpoch
from lmpm.runtime.rundir import DB_NAME, PAGE_SIZE, STORE_DIR

sys.path.insert(0, str(Path(__file__).parent))
from test_runtime_trace_summary import _GRID, value_epochs

EX = Path(__file__).resolve().parents[2] / "examples"


def _torch_checksum(payload: torch.Tensor) -> list[int]:
    """:func:`protocol.checksum` of scalar cells through torch's kernels (its general path)."""
    x = payload
    if x.is_floating_point():
        x = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    elif x.dtype != torch.int64:
        x = x.to(torch.int64)
    return protocol._mix(x + protocol._GOLDEN).tolist()


FLOATS = [0.0, -0.0, 0.1, -2.25, 1e-40, 3.4e38, 3.5e38, 1e300, float("inf"), float("-inf")]
INTS = [0, -1, 50256, 2**31, 2**63 - 1, -(2**63)]
CASES = [
    (dt, v)
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    for v in [*FLOATS, float("nan")]
]
CASES += [(dt, v) for dt in (torch.int64, torch.int32, torch.uint8, torch.bool) for v in INTS]


@pytest.mark.parametrize(("dtype", "value"), CASES)
def test_one_cells_checksum_is_torchs(dtype: torch.dtype, value: float) -> None:
    """A one-number payload's checksum (a decode's commit) is torch's: the float32 bits of a
    float, NaN, overflow to inf and -0.0 included; the wrap of int64 arithmetic for an integer."""
    x = torch.tensor([value], dtype=torch.float64 if dtype.is_floating_point else torch.int64)
    x = x.to(dtype)
    assert protocol.checksum(x, 0).tolist() == _torch_checksum(x)
    assert protocol.checksum(x.reshape(()), 0).shape == ()


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(width=32), st.booleans()),
    st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float32, torch.bool]),
)
def test_one_cells_checksum_is_torchs_on_random_numbers(v: Any, dtype: torch.dtype) -> None:
    x = torch.tensor([v]).to(dtype)
    assert protocol.checksum(x, 0).tolist() == _torch_checksum(x)


def _log(trace: str) -> CommitLog:
    info = RunInfo("", "", "", {}, (), 0, "cpu", None, None, trace, None, 10)
    return CommitLog("unused", info, tracer=None if trace == "off" else Tracer(_GRID.plan, trace))


@st.composite
def _one_cell_records(draw: st.DrawFn) -> EpochRecord:
    values: list[ValueEpoch] = draw(st.lists(value_epochs(max_cells=1), min_size=0, max_size=2))
    out = []
    for ve in values:
        sums = draw(st.none() | st.integers(-(2**63), 2**63 - 1))
        out.append(dataclasses.replace(ve, checksum=None if sums is None else torch.tensor([sums])))
    return EpochRecord(draw(st.integers(0, 99)), out, 0, 0, 0, 0, 0.0, 0.0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_one_cell_records(), st.sampled_from(["off", "summary"]))
def test_one_cell_epochs_log_rows_are_the_general_paths(record: EpochRecord, trace: str) -> None:
    """An epoch of one open cell per value: its commit rows, trace rows, candidate count and
    committed checksum are the general path's, NaN scores and no checksums included."""
    log = _log(trace)
    fast = log._epoch_rows(_GRID.engine, record)
    with pytest.MonkeyPatch.context() as mp:  # every epoch through the general path
        mp.setattr(commitlog.OneCell, "of", staticmethod(lambda ve: None))
        general = log._epoch_rows(_GRID.engine, record)
    assert repr(fast) == repr(general)  # (repr: a NaN score is not equal to itself)


def test_one_cell_of_needs_one_cell() -> None:
    records: list[ValueEpoch] = []
    for n in (0, 1, 2):
        g = np.random.default_rng(n)
        records.append(
            ValueEpoch(
                "G",
                torch.arange(n),
                torch.ones(n, 2, dtype=torch.bool),
                torch.from_numpy(g.random((n, 2))),
                torch.tensor([-1, 0]),
                torch.zeros(n, 2, 0, dtype=torch.bool),
                torch.zeros(0, dtype=torch.int64),
                torch.zeros(n, dtype=torch.int64),
                torch.ones(n, dtype=torch.bool),
                torch.arange(n),
                torch.zeros(n, dtype=torch.bool),
                torch.zeros(n, 0, dtype=torch.bool),
            )
        )
    assert [OneCell.of(ve) is not None for ve in records] == [False, True, False]


def _dump(run_dir: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the run's log and payload store, less the wall-clock columns."""
    clock = {
        "epochs": ("seconds", "model_seconds", "log_seconds", "at", "driver_cpu_s"),
        "checkpoints": ("created",),
        "ruleset_events": ("at",),
    }
    out: dict[str, list[tuple[Any, ...]]] = {}
    for db in [run_dir / DB_NAME, *sorted((run_dir / STORE_DIR).glob("*.db"))]:
        conn = sqlite3.connect(db)
        try:
            tables = [
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            ]
            for t in tables:
                cols = [r[1] for r in conn.execute(f"PRAGMA table_info({t})")]
                keep = [c for c in cols if c not in clock.get(t, ())]
                rows = conn.execute(f"SELECT {', '.join(keep)} FROM {t}").fetchall()
                if t == "meta":
                    rows = [r for r in rows if r[0] not in ("created_at", "finished_at", "argv")]
                out[f"{db.name}:{t}"] = sorted(rows, key=repr)
        finally:
            conn.close()
    return out


@pytest.mark.parametrize("trace", ["summary", "off", "cells"])
def test_a_runs_log_holds_the_general_paths_rows(
    tmp_path: Path, trace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/text.lmpm (one open cell an epoch) run twice, the second time with the one-cell
    paths switched off: the log and the payload store hold the same rows, every table."""
    dirs = []
    for fast in (True, False):
        out = tmp_path / f"run-{fast}"
        with pytest.MonkeyPatch.context() as mp:
            if not fast:
                mp.setattr(commitlog.OneCell, "of", staticmethod(lambda ve: None))
                mp.setattr(protocol, "_checksum_of_one", lambda v: None)
            argv = ["run", str(EX / "text.lmpm"), "--set", "N=40", "--trace", trace]
            argv += ["--input", f"Txt={EX / 'text' / 'prompt.txt'}", "--out", str(out)]
            assert main(argv) == 0
        dirs.append(_dump(out))
    capsys.readouterr()
    fast_rows, general_rows = dirs
    assert fast_rows.keys() == general_rows.keys()
    assert len(fast_rows[f"{DB_NAME}:commits"]) > 5
    for table in fast_rows:
        assert fast_rows[table] == general_rows[table], table


_OPENED = st.lists(st.tuples(st.text(max_size=4), st.integers(0, 2**40)), max_size=3).map(tuple)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("open"), st.integers(0, 2**62) | st.booleans(), _OPENED),
            st.tuples(st.text(max_size=5), st.integers(), _OPENED),
            st.tuples(st.just("open"), st.integers()),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_the_mask_plans_json_is_json_dumps(elems: list[tuple[Any, ...]]) -> None:
    """The epochs row's ``maskplan`` (an epoch's element written around its cached ``opened``) is
    ``json.dumps`` of the element, element after element."""
    import json

    log = _log("off")
    for elem in elems:
        assert log._maskplan_text(elem) == json.dumps(elem, separators=(",", ":"))


def _page_size(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()


def _repage(db: Path, size: int) -> None:
    """Rewrite ``db`` with ``size``-byte pages (as an older version created it), still WAL."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute(f"PRAGMA page_size={size}")
        conn.execute("VACUUM")
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()


def test_new_logs_take_the_page_size_and_older_ones_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new run's log and payload store have PAGE_SIZE-byte pages; a run whose files have
    SQLite's default 4 KiB pages (an older version's) resumes in them, to the rows of a run made
    in one go."""
    text = ["--input", f"Txt={EX / 'text' / 'prompt.txt'}", "--set", "N=40", "--quiet"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["run", str(EX / "text.lmpm"), *text, "--epochs", "12", "--out", str(whole)]) == 0
    assert main(["run", str(EX / "text.lmpm"), *text, "--epochs", "6", "--out", str(part)]) == 0
    dbs = [part / DB_NAME, *sorted((part / STORE_DIR).glob("*.db"))]
    assert len(dbs) == 2 and {_page_size(db) for db in dbs} == {PAGE_SIZE}
    for db in dbs:
        _repage(db, 4096)
    assert main(["run", "--resume", str(part), "--epochs", "12", "--quiet"]) == 0
    capsys.readouterr()
    assert {_page_size(db) for db in dbs} == {4096}
    got, want = _dump(part), _dump(whole)
    resumes = f"{DB_NAME}:resumes"
    assert len(got.pop(resumes)) == 1 and not want.pop(resumes)
    for table in want:
        if table.endswith((":meta", ":checkpoints")):  # (the resume's argv; the part's end)
            continue
        assert got[table] == want[table], table


def test_a_wide_candidate_table_stays_on_the_tensor_path() -> None:
    """k = V candidates of one cell are not read as Python numbers (the default trace's cost must
    not grow with k: benchmarks/trace_k.py); a few candidates are."""
    import torch

    from lmpm.runtime.records import ONE_CELL_COLUMNS, OneCell, ValueEpoch

    def record(columns: int) -> ValueEpoch:
        return ValueEpoch(
            "Txt",
            torch.tensor([3]),
            torch.ones(1, columns, dtype=torch.bool),
            torch.zeros(1, columns),
            torch.zeros(columns, dtype=torch.int64),
            torch.zeros(1, columns, 1, dtype=torch.bool),
            torch.tensor([0]),
            torch.tensor([1]),
            torch.tensor([True]),
            torch.tensor([1]),
            torch.tensor([False]),
            torch.ones(1, 1, dtype=torch.bool),
        )

    one = OneCell.of(record(ONE_CELL_COLUMNS))
    assert one is not None and one.cell == 3 and len(one.valid) == ONE_CELL_COLUMNS
    assert OneCell.of(record(ONE_CELL_COLUMNS + 1)) is None
