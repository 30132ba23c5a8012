"""Property: a mutated run directory is data. Whatever hypothesis does to a real run's SQLite rows
(values of any type, a view in place of a table, an extra trigger) and files (truncated, garbage
bytes), the readers (`lmpm trace`, `trace --cell`, `render`, `top --once`, `run --resume`) end
with a result or a coded LMPM error (never exit 3, "internal error"), write nothing outside the
directory, and end: every SQLite read has a time budget (LMPM_READ_SECONDS, 2 s here).

The default suite runs FUZZ_EXAMPLES examples; `LMPM_FUZZ_EXAMPLES=2000 pytest --runslow ...`
runs the slow variant at that count (docs/security.md reports the last such run)."""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from received_run import copy_run, pristine, run_cli

FUZZ_EXAMPLES = 40  # default suite: one reader per example, about a second each
SLOW_EXAMPLES = int(os.environ.get("LMPM_FUZZ_EXAMPLES", "2000"))

# (table, column) pairs of the log and the store that the readers read
LOG_COLUMNS = {
    "meta": ("key", "value"),
    "value_defs": ("name", "dims", "ncells", "first_id", "vocab", "dtype", "policy"),
    "rule_defs": ("id", "name", "target", "model", "score", "replicas"),
    "constraint_defs": ("id", "name", "value", "kind", "pred", "priority", "status", "text"),
    "epochs": ("epoch", "open_cells", "commits", "seconds", "maskplan", "checksum"),
    "commits": ("epoch", "value", "first", "last", "step", "count", "rule", "sums", "clocks"),
    "checkpoints": ("epoch", "file", "bytes", "sha256"),
    "trace_summary": ("epoch", "constraint_id", "rule", "checked", "violations", "blocked_where"),
    "trace_cells": ("epoch", "value", "cell", "coord", "winner", "payload", "decided_by"),
    "trace_candidates": ("epoch", "value", "cell", "col", "rule", "payload", "score"),
}
STORE_COLUMNS = {"rows": ("epoch", "value", "first", "step", "count", "crc", "payload")}
FILES = (
    "lmpm.db",
    "payload/cpu-0.db",
    "G.npy",
    "G.json",
    "checkpoints/epoch-00000004.safetensors",
    "checkpoints/epoch-00000004.cpu-0.safetensors",
)
READERS = ("trace", "cell", "render", "top", "resume")

values = st.one_of(
    st.none(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["\x1b[2J", "\x1b]52;c;aGk=\x07", "[bold red]x[/]", "../../x", "/dev/zero"]),
    st.binary(max_size=40),
    st.sampled_from(['{"a": 1}', "[]", "null", "1e999", '"G"', "{", "-1"]),
)


@dataclass(frozen=True)
class Mutation:
    kind: str  # "value" | "view" | "trigger" | "truncate" | "garbage"
    target: str  # table or file
    column: str = ""
    value: Any = None
    where: int = 0  # a row (value), a length or an offset (files)


@st.composite
def mutations(draw: st.DrawFn) -> Mutation:
    kind = draw(
        st.sampled_from(["value", "value", "value", "view", "trigger", "truncate", "garbage"])
    )
    if kind == "value":
        store = draw(st.booleans()) and draw(st.booleans())
        table = draw(st.sampled_from(sorted(STORE_COLUMNS if store else LOG_COLUMNS)))
        cols = (STORE_COLUMNS if store else LOG_COLUMNS)[table]
        target = ("store:" if store else "") + table
        return Mutation(
            kind, target, draw(st.sampled_from(cols)), draw(values), draw(st.integers(0, 30))
        )
    if kind in ("view", "trigger"):
        return Mutation(kind, draw(st.sampled_from(sorted(LOG_COLUMNS))))
    return Mutation(kind, draw(st.sampled_from(FILES)), where=draw(st.integers(0, 1 << 16)))


def apply(run: Path, m: Mutation) -> None:
    """Make the change ``m``; one SQLite refuses (a NOT NULL column, a view made before) is
    left out."""
    try:
        _apply(run, m)
    except sqlite3.Error:
        pass


def _apply(run: Path, m: Mutation) -> None:
    if m.kind == "value":
        db = run / ("payload/cpu-0.db" if m.target.startswith("store:") else "lmpm.db")
        table = m.target.removeprefix("store:")
        conn = sqlite3.connect(db, isolation_level=None)
        try:
            conn.execute(
                f'UPDATE "{table}" SET "{m.column}" = ? WHERE rowid IN '
                f'(SELECT rowid FROM "{table}" LIMIT 1 OFFSET ?)',
                (m.value, m.where),
            )
        finally:
            conn.close()
    elif m.kind == "view":  # the table becomes an endless recursive view of the same name
        conn = sqlite3.connect(run / "lmpm.db", isolation_level=None)
        conn.execute(f'ALTER TABLE "{m.target}" RENAME TO "old_{m.target}"')
        conn.execute(
            f'CREATE VIEW "{m.target}" AS WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL '
            f'SELECT x + 1 FROM r) SELECT * FROM "old_{m.target}", r'
        )
        conn.close()
    elif m.kind == "trigger":
        conn = sqlite3.connect(run / "lmpm.db", isolation_level=None)
        conn.execute(
            f'CREATE TRIGGER IF NOT EXISTS t_{m.target} AFTER INSERT ON "{m.target}" BEGIN '
            f'DELETE FROM "{m.target}"; END'
        )
        conn.close()
    else:
        path = run / m.target
        data = path.read_bytes()
        if m.kind == "truncate":
            path.write_bytes(data[: m.where % (len(data) + 1)])
        else:
            at = m.where % max(len(data), 1)
            path.write_bytes(data[:at] + os.urandom(16) + data[at + 16 :])


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def read_it(run: Path, reader: str) -> tuple[int, str]:
    argv = {
        "trace": ["trace", str(run)],
        "cell": ["trace", str(run), "--cell", "G[1,2]", "--json"],
        "render": ["render", str(run)],
        "top": ["top", str(run), "--once"],
        "resume": ["run", "--resume", str(run), "--epochs", "6", "--quiet"],
    }[reader]
    rc, _, err = run_cli(argv)
    return rc, err


def check(ms: list[Mutation], reader: str) -> None:
    pristine()
    with tempfile.TemporaryDirectory(prefix="lmpm-fuzz-") as tmp:
        root = Path(tmp)
        outside = root / "outside"  # a sibling folder holding a user's file
        outside.mkdir()
        (outside / "mydata.csv").write_text("a,b\n1,2\n")
        run = copy_run(root / "run")
        for m in ms:
            apply(run, m)
        before = snapshot(outside)
        siblings = sorted(p.name for p in root.iterdir())
        rc, err = read_it(run, reader)
        assert rc != 3, f"{reader} on {ms}: {err}"  # 3: "internal error", an uncoded exception
        assert rc in (0, 1, 2), (reader, ms, rc, err)
        assert snapshot(outside) == before, (reader, ms)
        assert sorted(p.name for p in root.iterdir()) == siblings, (reader, ms)


@pytest.fixture(autouse=True)
def _budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMPM_READ_SECONDS", "2")


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(mutations(), min_size=1, max_size=3), st.sampled_from(READERS))
def test_a_mutated_run_dir_gives_a_result_or_a_coded_error(ms: list[Mutation], reader: str) -> None:
    check(ms, reader)


@pytest.mark.slow
@settings(
    max_examples=SLOW_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(mutations(), min_size=1, max_size=3), st.sampled_from(READERS))
def test_many_mutated_run_dirs(ms: list[Mutation], reader: str) -> None:
    check(ms, reader)
