"""The log is data: a received database's schema is checked before any query, its SQL never
pastes a name read from it, its views cannot spin forever, and Ctrl-C interrupts a query."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from received_run import copy_run, run_cli, sql

from lmpm.errors import RunDirError
from lmpm.runtime.received import Schema, open_reader
from lmpm.runtime.rundir import STORE_SCHEMA, connect

ENDLESS = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r"


def test_a_received_log_is_opened_with_trusted_schema_off(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    conn = connect(run)
    try:
        assert conn.execute("PRAGMA trusted_schema").fetchone()[0] == 0
    finally:
        conn.close()


def test_a_view_in_place_of_a_table_is_refused_before_any_query(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    sql(
        run / "lmpm.db",
        "ALTER TABLE epochs RENAME TO e0",
        f"CREATE VIEW epochs AS SELECT e0.* FROM e0, ({ENDLESS})",
    )
    for argv in (["trace", str(run)], ["run", "--resume", str(run), "--epochs", "6"]):
        rc, _, err = run_cli(argv)
        assert rc == 1 and "[D040]" in err and "view in place of the table 'epochs'" in err, err


def test_a_trigger_is_refused_for_reading_and_for_resuming(tmp_path: Path) -> None:
    run = copy_run(tmp_path / "run")
    sql(run / "lmpm.db", "CREATE TRIGGER t AFTER INSERT ON epochs BEGIN DELETE FROM meta; END")
    for argv in (["trace", str(run)], ["run", "--resume", str(run), "--epochs", "6", "--quiet"]):
        rc, _, err = run_cli(argv)
        assert rc == 1 and "[D040]" in err and "trigger" in err, err
    conn = sqlite3.connect(run / "lmpm.db")
    assert conn.execute("SELECT count(*) FROM meta").fetchone()[0] > 0  # nothing fired
    conn.close()


def test_a_column_name_from_a_store_is_never_evaluated(tmp_path: Path) -> None:
    """A worker's store (payload/w0.db) whose commits table has a column named like SQL: the
    merged view names the log's own columns, so the expression never runs (it would overflow)."""
    run = copy_run(tmp_path / "run")
    store = run / "payload" / "w0.db"
    conn = sqlite3.connect(store)
    conn.executescript(STORE_SCHEMA)
    conn.execute("DROP TABLE commits")
    conn.execute(
        "CREATE TABLE commits (epoch, value, first, last, step, count, rule, clock_min, "
        'clock_max, score_min, score_max, crc, sums, clocks, scores, "abs(-9223372036854775808) '
        'AS pwn")'
    )
    conn.commit()
    conn.close()
    conn = connect(run)
    try:
        rows = conn.execute("SELECT * FROM commits").fetchall()  # the merged view
        assert rows and all(len(r) == 15 for r in rows)
    finally:
        conn.close()


def test_reading_past_the_time_budget_is_a_coded_error(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    sql(db, "CREATE TABLE t (a)")
    conn = open_reader(db, Schema.of("CREATE TABLE t (a);"), seconds=0.2)
    with conn, pytest.raises(RunDirError) as info:
        conn.execute(ENDLESS).fetchone()
    assert info.value.code == "D041" and "LMPM_READ_SECONDS" in (info.value.hint or "")


def test_ctrl_c_interrupts_a_running_query(tmp_path: Path) -> None:
    """SIGINT while SQLite runs an endless query: KeyboardInterrupt, long before the budget."""
    db = tmp_path / "x.db"
    sql(db, "CREATE TABLE t (a)")
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    with open_reader(db, Schema.of("CREATE TABLE t (a);"), seconds=600) as conn:
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                conn.execute(ENDLESS).fetchone()
        finally:
            timer.cancel()
        assert not conn.budget.tripped


def test_a_bad_budget_setting_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = copy_run(tmp_path / "run")
    monkeypatch.setenv("LMPM_READ_SECONDS", "soon")
    rc, _, err = run_cli(["trace", str(run)])
    assert rc == 2 and "LMPM_READ_SECONDS" in err, err


def test_a_schema_that_is_not_utf8_is_corrupt_not_an_internal_error(tmp_path: Path) -> None:
    """SQLite's message about a damaged schema quotes its bytes; Python cannot decode them
    (UnicodeDecodeError, once an internal error of `lmpm top`): D006 for every reader."""
    run = copy_run(tmp_path / "run")
    bad = b"CREATE TABLE meta (key TEXT, value TEXT) \xa8\xc2"  # not UTF-8, not SQL
    conn = sqlite3.connect(run / "lmpm.db", isolation_level=None)
    conn.execute("PRAGMA writable_schema=ON")
    conn.execute("UPDATE sqlite_master SET sql = CAST(? AS TEXT) WHERE name = 'meta'", (bad,))
    conn.close()
    for argv in (["trace", str(run)], ["run", "--resume", str(run), "--epochs", "6"]):
        rc, _, err = run_cli(argv)
        assert rc == 1 and "[D006]" in err and "corrupt" in err, (argv, err)
