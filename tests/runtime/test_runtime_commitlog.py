"""The commit log: ranges, blobs, replay, refusing to overwrite, and damaged run directories."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

import lmpm
from lmpm.cli import main
from lmpm.errors import RunDirError
from lmpm.ir import compile_source
from lmpm.runtime.control.commitlog import restore
from lmpm.runtime.control.engine import Engine
from lmpm.runtime.records import EpochRecord
from lmpm.runtime.rundir import (
    SCHEMA_VERSION,
    _commit_runs,
    _one_commit,
    cell_runs,
    connect,
    decode,
    encode,
)
from lmpm.runtime.session import Run

PROG = """
param W = 6
param H = 6
value G : Token[5] shape Grid2D(W, H)
value MaskPlan : Event shape Set()
visible G[x, y] <- G[x+dx, y+dy] when (dx, dy) in N8
rule R:
  on G[x, y]
  read {nb in N8}
  emit proposal G[x, y] := Uniform(nb, k=2)
  score Noise(...)
constraint Lock: forbid change(G[0..1, 0..1]) priority 100
constraint Low: require G[x, y] in Set(0..3) priority 10
commit G[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""

BIND = """
import torch
import lmpm
from lmpm.workers import rng

@lmpm.bind("Noise")
def noise(inputs, *, epoch, **_):
    # later epochs score higher, so cells keep changing and clocks keep moving
    u = rng.uniform(0, "G", inputs["cells"], epoch, "noise", draws=inputs["proposal"].shape[1])
    return u.to(torch.float64) + epoch
"""


def _files(d: Path) -> dict[str, str]:
    """Content hashes of a run directory. A read-only SQLite reader may (re)build the -shm index
    and create an empty -wal: neither holds data, so neither counts as a change."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
        and not p.name.endswith("-shm")
        and not (p.name.endswith("-wal") and p.stat().st_size == 0)
    }


@pytest.fixture
def prog(tmp_path: Path) -> tuple[Path, Path]:
    p = tmp_path / "grid.lmpm"
    p.write_text(PROG)
    b = tmp_path / "noise.py"
    b.write_text(BIND)
    return p, b


def _run(prog: tuple[Path, Path], out: Path, *extra: str) -> int:
    return main(["run", str(prog[0]), "--bind", str(prog[1]), "--out", str(out), "--quiet", *extra])


def test_cell_runs_cover_the_cells_exactly() -> None:
    gen = np.random.default_rng(0)
    for _ in range(50):
        cells = np.unique(gen.integers(0, 200, size=int(gen.integers(1, 120))))
        key = gen.integers(0, 2, size=cells.size) if gen.random() < 0.5 else np.zeros(cells.size)
        starts, counts, steps = cell_runs(cells, key)
        rebuilt = np.concatenate(
            [cells[s] + st * np.arange(n) for s, n, st in zip(starts, counts, steps)]
        )
        assert rebuilt.tolist() == cells.tolist()
        for s, n in zip(starts, counts):
            assert len(set(key[s : s + n].tolist())) == 1
    # a red-black row: one run per row, not one per cell
    cells = np.array([y * 8 + x for y in range(4) for x in range(8) if (x + y) % 2 == 0])
    assert len(cell_runs(cells, np.zeros(cells.size))[0]) == 4


class _Records:
    """An observer keeping each epoch's record (with the payload checksums the log would get)."""

    wants_records = True

    def __init__(self) -> None:
        self.records: list[EpochRecord] = []

    def on_start(self, engine: Engine) -> None:
        engine.checksums = True

    def on_epoch(self, engine: Engine, record: EpochRecord) -> None:
        self.records.append(record)

    def on_end(self, engine: Engine) -> None:
        pass


def test_one_cell_commit_row_is_the_general_paths(prog: tuple[Path, Path]) -> None:
    """The row of an epoch's one committed cell (a decode's epoch) is the row the run splitting
    writes for that cell alone, a NaN score included (its blob, as NaN != NaN)."""
    seen = _Records()
    run = Run.from_source(PROG, bind=[str(prog[1])], seed=3, observers=[seen])
    run.run(4)
    checked = 0
    for rec in seen.records:
        for ve in rec.values:
            for r in np.flatnonzero(ve.changed.numpy()).tolist():
                assert (
                    _one_commit(rec.epoch, ve, r) == _commit_runs(rec.epoch, ve, np.array([r]))[0]
                )
                score = ve.score.clone()
                score[r] = float("nan")
                odd = dataclasses.replace(ve, score=score)
                got, want = (
                    _one_commit(rec.epoch, odd, r),
                    _commit_runs(rec.epoch, odd, np.array([r]))[0],
                )
                assert repr(got) == repr(want) and got[-1] is not None
                checked += 1
    assert checked > 10


def test_blob_codec_round_trips() -> None:
    for tag, arr in [
        ("B", np.array([0, 255])),
        ("H", np.array([7, 65535])),
        ("q", np.array([-3, 2**40])),
        ("d", np.array([0.5, -np.inf])),
        ("f", np.array([1.25], dtype=np.float32)),
    ]:
        assert decode(encode(arr, tag)).tolist() == arr.tolist()


def _copy_forgetting(run: Path, to: Path, where: str) -> Path:
    """A copy of run directory ``run`` whose log forgets the checkpoints ``where`` selects."""
    shutil.copytree(run, to)
    conn = sqlite3.connect(to / "lmpm.db")
    conn.execute(f"DELETE FROM checkpoints WHERE {where}")
    conn.commit()
    conn.close()
    return to


def test_replaying_the_log_rebuilds_the_final_state(
    prog: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    assert _run(prog, out, "--epochs", "9", "--seed", "5", "--checkpoint-every", "4") == 0
    conn = sqlite3.connect(out / "lmpm.db")
    labels = [r[0] for r in conn.execute("SELECT epoch FROM checkpoints ORDER BY epoch")]
    assert labels == [0, 4, 8, 9]  # inputs, every 4 epochs (newest 2 kept), the final state
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(
        [f"epoch-{k:08d}.safetensors" for k in labels]  # the control plane's metadata
        + [f"epoch-{k:08d}.cpu-0.safetensors" for k in labels]  # the worker's payload shard
    )
    # Forget every checkpoint but the first: resume must replay all commits from the log.
    copy = _copy_forgetting(out, tmp_path / "copy", "epoch > 0")
    fresh = Run.from_source(PROG, bind=[str(prog[1])], seed=5)
    restored = restore(fresh.engine, connect(copy), copy)
    assert restored.epoch == 9 and restored.checkpoint == 0 and restored.replayed > 0
    final = Run.from_source(PROG, bind=[str(prog[1])], seed=5)
    restore(final.engine, connect(out), out)  # from the final checkpoint, nothing replayed
    for a, b in [(fresh, final)]:
        sa, sb = a.engine.state["G"], b.engine.state["G"]
        for f in ("committed", "clock", "rule", "epoch", "score"):
            assert torch.equal(getattr(sa, f), getattr(sb, f)), f
        assert torch.equal(a.payload("G"), b.payload("G"))
    grid = np.load(out / "G.npy")
    assert grid.reshape(-1).tolist() == fresh.outputs()["G"].reshape(-1).tolist()
    assert fresh.engine.maskplan.state() == final.engine.maskplan.state()
    # The commits of one cell, with plain SQL.
    cell = 14
    rows = conn.execute(
        "SELECT epoch FROM commits WHERE value = 'G' AND ? BETWEEN first AND last "
        "AND (? - first) % step = 0 ORDER BY epoch",
        (cell, cell),
    ).fetchall()
    assert rows and int(fresh.engine.state["G"].epoch[cell]) == rows[-1][0]
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    assert json.loads(meta["seed"]) == 5 and json.loads(meta["status"]) == "finished"
    assert json.loads(meta["schema_version"]) == SCHEMA_VERSION and "Noise" in json.loads(
        meta["bindings"]
    )
    conn.close()


def _fsynced_checkpoints(
    prog: tuple[Path, Path], out: Path, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> set[str]:
    """Run 9 epochs, a checkpoint every 4; the checkpoint files fsynced (by the name the file had
    when its data was synced: ``.epoch-NNNNNNNN[.worker].safetensors.tmp``)."""
    real = os.fsync
    synced: set[str] = set()

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith(".safetensors.tmp"):
            synced.add(Path(name).name.removeprefix(".").removesuffix(".tmp"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert _run(prog, out, "--epochs", "9", "--checkpoint-every", "4", *extra) == 0
    monkeypatch.setattr(os, "fsync", real)
    return synced


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")
def test_periodic_checkpoints_are_fsynced_only_when_durable(
    prog: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoints of every ``--checkpoint-every`` epochs are written without fsync (a power
    cut may lose them: resume then falls back to an older one), epoch 0's and the final one with;
    ``--durable`` fsyncs every one."""

    def names(*labels: int) -> set[str]:
        return {f"epoch-{k:08d}{w}.safetensors" for k in labels for w in ("", ".cpu-0")}

    out = tmp_path / "run"
    assert _fsynced_checkpoints(prog, out, monkeypatch) == names(0, 9)
    assert _fsynced_checkpoints(prog, tmp_path / "durable", monkeypatch, "--durable") == names(
        0, 4, 8, 9
    )
    # A power cut after epoch 8: the final checkpoint never written, the periodic ones (never
    # fsynced) lost, their files left empty. Resume skips both for epoch 0's and replays every
    # commit after it: the same state as from the final checkpoint.
    cut = _copy_forgetting(out, tmp_path / "cut", "epoch = 9")
    for ck in (cut / "checkpoints").iterdir():
        if ck.name.startswith(("epoch-00000004.", "epoch-00000008.")):
            ck.write_bytes(b"")
        elif ck.name.startswith("epoch-00000009."):
            ck.unlink()
    fresh = Run.from_source(PROG, bind=[str(prog[1])])
    restored = restore(fresh.engine, connect(cut), cut)
    assert (restored.epoch, restored.checkpoint, restored.skipped) == (9, 0, 2)
    final = Run.from_source(PROG, bind=[str(prog[1])])
    restore(final.engine, connect(out), out)
    sa, sb = fresh.engine.state["G"], final.engine.state["G"]
    for f in ("committed", "clock", "rule", "epoch", "score"):
        assert torch.equal(getattr(sa, f), getattr(sb, f)), f
    assert torch.equal(fresh.payload("G"), final.payload("G"))


def test_an_existing_run_is_not_overwritten(
    prog: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _run(prog, out, "--epochs", "2") == 0
    before = _files(out)
    assert _run(prog, out, "--epochs", "2") == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--force" in err
    assert _files(out) == before
    assert _run(prog, out, "--epochs", "3", "--force") == 0
    conn = connect(out)
    assert conn.execute("SELECT count(*) FROM epochs").fetchone()[0] == 3
    conn.close()


def _damage(kind: str, out: Path, prog: tuple[Path, Path]) -> None:
    db = out / "lmpm.db"
    if kind == "newer schema":
        c = sqlite3.connect(db)
        c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
        c.commit()
        c.close()
    elif kind == "truncated db":
        data = db.read_bytes()
        db.write_bytes(data[: len(data) // 3])
    elif kind == "corrupt db":
        data = bytearray(db.read_bytes())
        mid = len(data) // 2
        data[mid - 6000 : mid + 6000] = b"\xa5" * 12000
        db.write_bytes(bytes(data))
    elif kind == "not a database":
        db.write_bytes(b"hello, I am not SQLite" * 100)
    elif kind == "truncated checkpoint":  # all of them: resume falls back past a damaged one
        for ck in (out / "checkpoints").iterdir():
            ck.write_bytes(ck.read_bytes()[:100])
    elif kind == "missing checkpoint":
        for ck in (out / "checkpoints").iterdir():
            ck.unlink()


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("foreign", "D010"),
        ("newer schema", "D004"),
        ("truncated db", "D006"),
        ("corrupt db", "D006"),
        ("not a database", "D003"),
        ("truncated checkpoint", "D007"),
        ("missing checkpoint", "D007"),
        ("no run", "D001"),
        ("different seed", "D011"),
    ],
)
def test_damaged_or_foreign_run_dirs_are_refused(
    kind: str,
    code: str,
    prog: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    assert _run(prog, out, "--epochs", "3") == 0
    if kind == "no run":
        (out / "lmpm.db").unlink()
    _damage(kind, out, prog)
    before = _files(out)
    capsys.readouterr()
    args = ["run", "--resume", str(out), "--bind", str(prog[1])]
    if kind == "foreign":
        other = tmp_path / "other.lmpm"
        other.write_text(PROG.replace("Set(0..3)", "Set(0..2)"))
        args.insert(1, str(other))
    if kind == "different seed":
        args += ["--seed", "9"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"[{code}]" in err, err
    assert _files(out) == before  # nothing overwritten
    if kind not in ("foreign", "truncated checkpoint", "missing checkpoint", "different seed"):
        with pytest.raises(RunDirError):
            connect(out, check=True)


def test_the_program_hash_ignores_formatting(prog: tuple[Path, Path], tmp_path: Path) -> None:
    from lmpm.runtime.control.commitlog import program_hash

    a = compile_source(PROG).ir
    b = compile_source("// a comment\n" + PROG.replace("priority 100", "priority  100"), "x").ir
    c = compile_source(PROG.replace("priority 100", "priority 99")).ir
    assert program_hash(a) == program_hash(b) != program_hash(c)


@pytest.mark.parametrize("durable", [False, True])
def test_the_payload_store_is_as_durable_as_the_log(
    prog: tuple[Path, Path], tmp_path: Path, durable: bool
) -> None:
    """Under --durable the payload store fsyncs every epoch's commit as the log does
    (synchronous=FULL, 2), started and resumed; without it both are NORMAL (1)."""

    def synchronous(run: Run) -> tuple[int, int]:
        assert run.log is not None and run.log.conn is not None
        store = run.engine.dataplane.store
        assert store is not None
        return (
            run.log.conn.execute("PRAGMA synchronous").fetchone()[0],
            store.conn.execute("PRAGMA synchronous").fetchone()[0],
        )

    want = (2, 2) if durable else (1, 1)
    out = tmp_path / "r"
    run = lmpm.compile(prog[0]).runner(
        run_dir=out, bind=[str(prog[1])], seed=1, epochs=2, durable=durable
    )
    try:
        run.run(2)
        assert synchronous(run) == want
    finally:
        run.finish()
    again = lmpm.resume(out, epochs=4, bind=[str(prog[1])])
    try:
        assert synchronous(again) == want
        again.run(again.epochs)
    finally:
        again.finish()


def test_a_one_cell_epoch_writes_the_payload_row_of_a_run_of_one(
    prog: tuple[Path, Path], tmp_path: Path
) -> None:
    """The payload store's one-cell epoch (a decode's) skips the run splitting: its row is the
    one a run of one cell gets (step 1, count 1, the CRC of the bytes after the tag), and restore
    reads it back beside a run of several."""
    import zlib

    from lmpm.runtime.data.store import PayloadStore

    run = Run.from_source(PROG, bind=[str(prog[1])])
    store = PayloadStore(tmp_path, "w0", run.plan)
    try:
        rel, _, sha = store.checkpoint(0, {"G": np.zeros(36, dtype=np.uint8)})
        store.append_commits(0, "G", torch.tensor([7]), torch.tensor([3]))
        store.append_commits(1, "G", torch.tensor([9, 7]), torch.tensor([1, 2]))
        store.sync(1)
        rows = store.conn.execute("SELECT * FROM rows ORDER BY epoch").fetchall()
        tag = store.tags["G"].encode()
        body = np.array([3], dtype=np.uint8).tobytes()
        assert rows[0] == (0, "G", 7, 1, 1, zlib.crc32(body), tag + body)
        assert rows[1][:5] == (1, "G", 7, 2, 2)  # cells 7 and 9: one run of step 2
        got = store.restore(0, rel, sha, 2, {(0, "G"): 1, (1, "G"): 2})["G"]
        assert (got[7], got[9]) == (2, 1) and int(got.sum()) == 3
    finally:
        store.close()
        run.close()


@pytest.mark.parametrize("value", [0, 3, 255, 300, -1])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_a_one_cell_payload_packed_from_the_scalar_is_numpys_bytes(
    prog: tuple[Path, Path], tmp_path: Path, value: int, dtype: torch.dtype
) -> None:
    """A one-number cell's payload is packed from the scalar (a decode's epoch): the same bytes as
    NumPy's conversion to the tag's type, also for a number out of the tag's range (NumPy's wrap)."""
    from lmpm.runtime.data.store import PayloadStore
    from lmpm.runtime.rundir import encode

    run = Run.from_source(PROG, bind=[str(prog[1])])
    store = PayloadStore(tmp_path, "w0", run.plan)
    try:
        payload = torch.tensor([value]).to(dtype)
        store.append_commits(0, "G", torch.tensor([5]), payload)
        store.sync(0)
        (row,) = store.conn.execute("SELECT payload FROM rows").fetchall()
        assert row[0] == encode(payload.numpy(), store.tags["G"])
    finally:
        store.close()
        run.close()
