"""Counted bytes: each epoch's bytes into and out of the control plane (serialised), the payload
moved worker to worker and the driver's CPU time, in the epoch record, the log and `lmpm trace`;
a run directory of the schema before them still reads and resumes."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch

from lmpm.cli import main
from lmpm.resolve.topology import partition
from lmpm.runtime.data.group import WorkerGroup
from lmpm.runtime.protocol import ValueDecision, nbytes, to_wire, wire_bytes
from lmpm.runtime.rundir import COUNTED, SCHEMA_VERSION
from lmpm.runtime.session import Run

EX = Path(__file__).resolve().parents[2] / "examples"
LATENT = [str(EX / "latent.lmpm"), "--input", f"Z={EX / 'latent' / 'z0.npy'}", "--seed", "2"]
GPT = (EX / "gpt.lmpm", {"N": 12})


def _query(run_dir: Path, sql: str) -> list[sqlite3.Row]:
    conn = sqlite3.connect(run_dir / "lmpm.db")
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _epochs(run_dir: Path) -> list[dict[str, Any]]:
    return [dict(r) for r in _query(run_dir, "SELECT * FROM epochs ORDER BY epoch")]


def test_wire_bytes_count_a_tensor_as_its_bytes_and_a_header() -> None:
    d = ValueDecision(torch.arange(100), torch.zeros(1000, dtype=torch.int64), None)
    data = nbytes(d)
    assert data == 8 * 1100
    assert data < wire_bytes(d) < data + 1000
    assert wire_bytes(to_wire(d)) == wire_bytes(d)  # its wire form crosses as the same bytes


def test_a_group_counts_what_crosses_to_its_workers() -> None:
    path, params = GPT
    run = Run.from_file(path, params=params, seed=3)
    group = WorkerGroup(run.plan, 2, topology=partition(run.plan, 2, replicate_bytes=0), seed=3)
    run.engine.dataplane = run.dataplane = group
    recs = [run.engine.step() for _ in range(3)]
    for r in recs:
        assert 0 < r.message_bytes < r.control_bytes  # serialised: the tensors and more
        assert r.driver_cpu_s >= 0
    assert recs[-1].control_bytes == group.traffic.control_bytes


def test_one_in_process_worker_counts_only_when_asked() -> None:
    path, params = GPT
    run = Run.from_file(path, params=params, seed=3)
    first = run.engine.step()
    assert first.control_bytes == first.message_bytes == 0  # nothing crosses a process boundary
    run.dataplane.count_bytes = True
    rec = run.engine.step()
    assert 0 < rec.message_bytes < rec.control_bytes


def test_the_log_and_trace_give_the_counted_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r"
    args = ["run", *LATENT, "--workers", "2", "--driver", "process", "--epochs", "4"]
    assert main([*args, "--quiet", "--out", str(out)]) == 0
    rows = _epochs(out)
    assert set(COUNTED) <= set(rows[0])
    assert all(int(r["control_bytes"]) > 0 for r in rows)
    assert all(float(r["driver_cpu_s"]) >= 0 for r in rows)
    assert sum(int(r["halo_bytes"]) for r in rows) > 0  # the 2 workers exchanged a halo
    capsys.readouterr()
    assert main(["trace", str(out), "--json"]) == 0
    epochs = json.loads(capsys.readouterr().out)["epochs"]
    assert [e["control_bytes"] for e in epochs] == [r["control_bytes"] for r in rows]
    assert [e["halo_bytes"] for e in epochs] == [r["halo_bytes"] for r in rows]
    assert [e["driver_cpu_s"] for e in epochs] == [r["driver_cpu_s"] for r in rows]
    assert main(["trace", str(out)]) == 0
    text = capsys.readouterr().out
    assert "control kB" in text and "halo kB" in text and "cpu ms" in text


def _as_schema_2(run_dir: Path) -> None:
    """Make a run directory look as the LMPM before the counted columns wrote it."""
    conn = sqlite3.connect(run_dir / "lmpm.db")
    try:
        for name in COUNTED:
            conn.execute(f"ALTER TABLE epochs DROP COLUMN {name}")
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
        conn.commit()
    finally:
        conn.close()


def test_a_schema_2_run_directory_reads_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["run", *LATENT, "--checkpoint-every", "2", "--quiet"]
    assert main([*args, "--epochs", "6", "--out", str(tmp_path / "ref")]) == 0
    old = tmp_path / "old"
    assert main([*args, "--epochs", "3", "--out", str(old)]) == 0
    _as_schema_2(old)
    capsys.readouterr()
    assert main(["trace", str(old), "--json"]) == 0
    epochs = json.loads(capsys.readouterr().out)["epochs"]
    assert [e["control_bytes"] for e in epochs] == [None] * 3
    assert main(["trace", str(old)]) == 0  # the table leaves out what was not logged
    assert "cpu ms" not in capsys.readouterr().out
    assert main(["run", "--resume", str(old), "--epochs", "6", "--quiet"]) == 0
    rows = _epochs(old)
    assert [r["driver_cpu_s"] is None for r in rows] == [True] * 3 + [False] * 3
    version = _query(old, "SELECT value FROM meta WHERE key = 'schema_version'")[0][0]
    assert json.loads(version) == SCHEMA_VERSION
    commits = "SELECT * FROM commits ORDER BY epoch, value, first"
    assert [tuple(r) for r in _query(old, commits)] == [
        tuple(r) for r in _query(tmp_path / "ref", commits)
    ]


def test_the_port_messages_pickle_in_a_few_dozen_bytes() -> None:
    """What crosses between the planes every epoch: a request and, per worker, a report of fixed
    size, pickled as their field values behind a two-byte class code (records.wire_code)."""
    import pickle

    from lmpm.runtime.protocol import EpochReport, EpochRequest, wire_bytes
    from lmpm.runtime.records import Box, LogShare, merge_logs

    req = EpochRequest(5, 0, 5, None, True, None, False)
    rep = EpochReport(5, "w1", (), 2048, 2048, 0, 0.0123, {}, (), [])
    rep.log = LogShare(9, 2, ((5, 0, 1, 4, 1, 1, 1, Box("Z", (0, 1), (2, 3))),))
    for m in (req, rep):
        assert pickle.loads(pickle.dumps(m, protocol=5)) == m
    assert wire_bytes(req) < 40
    assert wire_bytes(EpochReport(5, "w1", (), 2048, 2048, 0, 0.0123, {}, (), [])) < 80
    # the owners' summaries merge: counts add, boxes unite
    both = merge_logs([rep.log, LogShare(1, 0, ((5, 0, 1, 2, 0, 0, 1, Box("Z", (1, 0), (4, 1))),))])
    assert both == LogShare(10, 2, ((5, 0, 1, 6, 1, 1, 2, Box("Z", (0, 0), (4, 3))),))
    assert both.summary[0][7].text() == "Z[0..4, 0..3]"
