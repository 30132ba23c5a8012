"""Property: a mutated run directory is data. Whatever hypothesis does to a real run's SQLite rows
(values of any type, a view in place of a table, an extra trigger) and files (truncated, garbage
bytes), the readers end with a result or a coded LMPM error (never exit 3, "internal error"),
write nothing outside the directory, and end: every SQLite read has a time budget
(LMPM_READ_SECONDS, 2 s here). Two kinds of run directory are mutated: a grid program's (read by
`lmpm trace`, `trace --cell`, `render`, `top --once`, `run --resume` and `scripts/compare.py`)
and a training run's (`train.db`, `inner-w0-*.pt`; read by `lmpm top --once`, `lmpm trace` and
`run --resume`).

The default suite runs FUZZ_EXAMPLES examples; `LMPM_FUZZ_EXAMPLES=2000 pytest --runslow -k many
...` runs the slow variant at that count (docs/security.md reports the last such run)."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sqlite3
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from received_run import ROOT, copy_run, pristine, pristine_training, run_cli

FUZZ_EXAMPLES = 40  # default suite: one reader per example, about a second each
SLOW_EXAMPLES = int(os.environ.get("LMPM_FUZZ_EXAMPLES", "2000"))


@dataclass(frozen=True)
class RunKind:
    """One kind of run directory: where its databases are, what the readers read of them."""

    made: Callable[[], Path]  # the pristine run directory (made once per process)
    tables: dict[str, dict[str, tuple[str, ...]]]  # database file -> table -> columns read
    files: tuple[str, ...]  # files to truncate or garble
    readers: tuple[str, ...]


GRID = RunKind(
    pristine,
    {
        "lmpm.db": {
            "meta": ("key", "value"),
            "value_defs": ("name", "dims", "ncells", "first_id", "vocab", "dtype", "policy"),
            "rule_defs": ("id", "name", "target", "model", "score", "replicas"),
            "constraint_defs": (
                "id",
                "name",
                "value",
                "kind",
                "pred",
                "priority",
                "status",
                "text",
            ),
            "epochs": ("epoch", "open_cells", "commits", "seconds", "maskplan", "checksum"),
            "commits": (
                "epoch",
                "value",
                "first",
                "last",
                "step",
                "count",
                "rule",
                "sums",
                "clocks",
            ),
            "checkpoints": ("epoch", "file", "bytes", "sha256"),
            "trace_summary": (
                "epoch",
                "constraint_id",
                "rule",
                "checked",
                "violations",
                "blocked_where",
            ),
            "trace_cells": ("epoch", "value", "cell", "coord", "winner", "payload", "decided_by"),
            "trace_candidates": ("epoch", "value", "cell", "col", "rule", "payload", "score"),
        },
        "payload/cpu-0.db": {
            "rows": ("epoch", "value", "first", "step", "count", "crc", "payload"),
        },
    },
    (
        "lmpm.db",
        "payload/cpu-0.db",
        "G.npy",
        "G.json",
        "checkpoints/epoch-00000004.safetensors",
        "checkpoints/epoch-00000004.cpu-0.safetensors",
    ),
    ("trace", "cell", "render", "top", "resume", "compare"),
)
TRAINING = RunKind(
    pristine_training,
    {
        "train.db": {
            "meta": ("key", "value"),
            "train_epochs": (
                "epoch",
                "loss",
                "eval_loss",
                "tokens",
                "seconds",
                "bytes",
                "rejected",
                "checksum",
            ),
            "train_workers": ("epoch", "worker", "steps", "loss", "last_loss", "tokens"),
            "train_steps": ("step", "epoch", "loss"),
            "constraint_events": ("epoch", "name", "kind", "checked", "violations", "action"),
            "workers": ("worker", "backend", "host", "pid", "state", "restarts", "updated"),
            "worker_faults": ("seq", "epoch", "worker", "phase", "cause", "seconds"),
            "checkpoints": ("epoch", "file", "bytes", "sha256", "created"),
        },
    },
    (
        "train.db",
        "checkpoints/inner-w0-000002.pt",
        "checkpoints/params-000002.safetensors",
        "Theta.safetensors",
    ),
    ("top", "trace", "resume"),
)

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
    target: str  # a database file (value, view, trigger) or the file to damage
    table: str = ""
    column: str = ""
    value: Any = None
    where: int = 0  # a row (value), a length or an offset (files)


@dataclass(frozen=True)
class Case:
    run: RunKind
    mutations: tuple[Mutation, ...]
    reader: str


def mutations(run: RunKind) -> st.SearchStrategy[Mutation]:
    dbs = sorted(run.tables)

    @st.composite
    def one(draw: st.DrawFn) -> Mutation:
        kind = draw(
            st.sampled_from(["value", "value", "value", "view", "trigger", "truncate", "garbage"])
        )
        if kind in ("truncate", "garbage"):
            return Mutation(
                kind, draw(st.sampled_from(run.files)), where=draw(st.integers(0, 1 << 16))
            )
        db = dbs[0] if kind != "value" or draw(st.booleans()) else draw(st.sampled_from(dbs))
        table = draw(st.sampled_from(sorted(run.tables[db])))
        if kind != "value":
            return Mutation(kind, db, table)
        column = draw(st.sampled_from(run.tables[db][table]))
        return Mutation(kind, db, table, column, draw(values), draw(st.integers(0, 30)))

    return one()


@st.composite
def cases(draw: st.DrawFn) -> Case:
    run = draw(st.sampled_from([GRID, GRID, TRAINING]))  # a training resume is the slow reader
    ms = draw(st.lists(mutations(run), min_size=1, max_size=3))
    return Case(run, tuple(ms), draw(st.sampled_from(run.readers)))


def apply(run: Path, m: Mutation) -> None:
    """Make the change ``m``; one SQLite refuses (a NOT NULL column, a view made before) is
    left out."""
    try:
        _apply(run, m)
    except sqlite3.Error:
        pass


def _apply(run: Path, m: Mutation) -> None:
    if m.kind in ("value", "view", "trigger"):
        conn = sqlite3.connect(run / m.target, isolation_level=None)
        try:
            _change(conn, m)
        finally:
            conn.close()
    else:
        path = run / m.target
        data = path.read_bytes()
        if m.kind == "truncate":
            path.write_bytes(data[: m.where % (len(data) + 1)])
        else:
            at = m.where % max(len(data), 1)
            path.write_bytes(data[:at] + os.urandom(16) + data[at + 16 :])


def _change(conn: sqlite3.Connection, m: Mutation) -> None:
    t = m.table
    if m.kind == "value":
        conn.execute(
            f'UPDATE "{t}" SET "{m.column}" = ? WHERE rowid IN '
            f'(SELECT rowid FROM "{t}" LIMIT 1 OFFSET ?)',
            (m.value, m.where),
        )
    elif m.kind == "view":  # the table becomes an endless recursive view of the same name
        conn.execute(f'ALTER TABLE "{t}" RENAME TO "old_{t}"')
        conn.execute(
            f'CREATE VIEW "{t}" AS WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL '
            f'SELECT x + 1 FROM r) SELECT * FROM "old_{t}", r'
        )
    else:
        conn.execute(
            f'CREATE TRIGGER IF NOT EXISTS "t_{t}" AFTER INSERT ON "{t}" BEGIN '
            f'DELETE FROM "{t}"; END'
        )


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


_compare: list[Callable[[list[str]], int]] = []


def compare_cli(argv: list[str]) -> tuple[int, str]:
    """`python scripts/compare.py ARGV` in this process: (exit code, stderr)."""
    if not _compare:
        _compare.append(runpy.run_path(str(ROOT / "scripts" / "compare.py"))["main"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = _compare[0](argv)
    return rc, err.getvalue()


def read_it(run: Path, reader: str, alone: Path) -> tuple[int, str]:
    if reader == "compare":  # the received run as the constrained one, no --trust-bind
        return compare_cli([str(alone), str(run), "--value", "G", "--json"])
    trained = (run / "train.db").exists()  # 2 epochs; the grid run has 5
    argv = {
        "trace": ["trace", str(run)],
        "cell": ["trace", str(run), "--cell", "G[1,2]", "--json"],
        "render": ["render", str(run)],
        "top": ["top", str(run), "--once"],
        "resume": ["run", "--resume", str(run), "--epochs", "3" if trained else "6", "--quiet"],
    }[reader]
    rc, _, err = run_cli(argv)
    return rc, err


def check(case: Case) -> None:
    source = case.run.made()
    with tempfile.TemporaryDirectory(prefix="lmpm-fuzz-") as tmp:
        root = Path(tmp)
        outside = root / "outside"  # a sibling folder holding a user's file
        outside.mkdir()
        (outside / "mydata.csv").write_text("a,b\n1,2\n")
        alone = copy_run(root / "alone") if case.reader == "compare" else root
        run = copy_run(root / "run", source)
        for m in case.mutations:
            apply(run, m)
        before = snapshot(outside)
        siblings = sorted(p.name for p in root.iterdir())
        rc, err = read_it(run, case.reader, alone)
        what = (case.reader, case.mutations)
        assert rc != 3, f"{what}: {err}"  # 3: "internal error", an uncoded exception
        assert rc in (0, 1, 2), (what, rc, err)
        assert snapshot(outside) == before, what
        assert sorted(p.name for p in root.iterdir()) == siblings, what


@pytest.fixture(autouse=True)
def _budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMPM_READ_SECONDS", "2")


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(cases())
def test_a_mutated_run_dir_gives_a_result_or_a_coded_error(case: Case) -> None:
    check(case)


@pytest.mark.slow
@settings(
    max_examples=SLOW_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(cases())
def test_many_mutated_run_dirs(case: Case) -> None:
    check(case)
