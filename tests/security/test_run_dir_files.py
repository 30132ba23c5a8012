"""A run directory is data: hostile files and folders in it never make LMPM write, delete or read
outside it, nor hang; every case ends in a coded error or a correct result (issue 44).

One real run of a small program (no bindings) is made once per module; each test copies it and
plants one hostile thing: a link where LMPM writes (the lock, a temporary file, render/, a
checkpoint folder), a name in the log that points elsewhere (absolute, ``..``, ``/dev/zero``, a
FIFO), a user's own folder given as ``--out``. Beside every copy lies ``outside/``, files the run
must never touch; each test checks them byte for byte afterwards. Blocking opens are bounded by
an alarm, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from safetensors.numpy import load

from lmpm.cli import main
from lmpm.runtime.rundir import safetensors_bytes

PROG = """
param W = 4
param H = 4
value G : Token[5] shape Grid2D(W, H)
value MaskPlan : Event shape Set()
visible G[x, y] <- G[x+dx, y+dy] when (dx, dy) in N8
rule R:
  on G[x, y]
  read {nb in N8}
  emit proposal G[x, y] := Uniform(nb, k=2)
constraint Low: require G[x, y] in Set(0..3) priority 10
commit G[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""

OUTSIDE = {"victim.txt": b"the user's file\n", "keep/other.bin": b"\x00\x01 not a checkpoint"}
HANG_LIMIT = 20  # seconds any one command may take here (a FIFO opened blocking would wait forever)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 5-epoch run with checkpoints every 2 epochs (shared: tests copy it)."""
    d = tmp_path_factory.mktemp("made")
    prog = d / "p.lmpm"
    prog.write_text(PROG)
    out = d / "run"
    args = ["run", str(prog), "--epochs", "5", "--checkpoint-every", "2", "--quiet"]
    assert main([*args, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(made: Path, tmp_path: Path) -> Path:
    """A copy of the made run, with ``outside/`` beside it."""
    out = tmp_path / "run"
    shutil.copytree(made, out, symlinks=True)
    (tmp_path / "p.lmpm").write_text(PROG)
    for rel, data in OUTSIDE.items():
        (tmp_path / "outside" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "outside" / rel).write_bytes(data)
    return out


def outside_untouched(tmp_path: Path) -> None:
    """Every file of ``outside/`` is there, unchanged, and nothing was added."""
    root = tmp_path / "outside"
    found = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert found == set(OUTSIDE)
    for rel, data in OUTSIDE.items():
        assert (root / rel).read_bytes() == data


@pytest.fixture
def deadline() -> Iterator[None]:
    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"a command took over {HANG_LIMIT} s (a hang)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(HANG_LIMIT)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def lmpm(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().err


def resume(capsys: pytest.CaptureFixture[str], run: Path, epochs: int = 7) -> tuple[int, str]:
    return lmpm(capsys, "run", "--resume", str(run), "--epochs", str(epochs), "--quiet")


def set_checkpoint_files(run: Path, name: str) -> None:
    with sqlite3.connect(run / "lmpm.db") as c:
        c.execute("UPDATE checkpoints SET file = ?", (name,))


# ---- writes through links -------------------------------------------------------------------------
def test_a_linked_lock_file_is_refused_and_its_target_kept(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "lmpm.lock").unlink()
    (run / "lmpm.lock").symlink_to(tmp_path / "outside" / "victim.txt")
    rc, err = resume(capsys, run)
    assert rc == 1 and "error[D032]" in err and "symbolic link" in err
    outside_untouched(tmp_path)


def test_a_linked_temporary_file_is_replaced_not_written_through(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / ".G.npy.tmp").symlink_to(tmp_path / "outside" / "victim.txt")
    (run / "G.npy").unlink()
    (run / "G.npy").symlink_to(tmp_path / "outside" / "victim.txt")  # the output itself, too
    rc, err = resume(capsys, run)
    assert rc == 0, err
    assert not (run / "G.npy").is_symlink() and (run / "G.npy").read_bytes()[:6] == b"\x93NUMPY"
    assert not (run / ".G.npy.tmp").exists()
    outside_untouched(tmp_path)


def test_a_linked_checkpoint_folder_is_refused_and_left_as_it_is(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ext = tmp_path / "outside" / "keep"
    for p in (run / "checkpoints").iterdir():
        shutil.copy(p, ext / p.name)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(ext)
    before = sorted(p.name for p in ext.iterdir())
    rc, err = resume(capsys, run, epochs=9)
    assert rc == 1 and "error[D032]" in err and "checkpoints" in err
    assert sorted(p.name for p in ext.iterdir()) == before  # nothing pruned, nothing written
    assert (ext / "other.bin").read_bytes() == OUTSIDE["keep/other.bin"]


def test_a_new_run_never_writes_through_a_linked_checkpoint_folder(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(tmp_path / "outside" / "keep")
    args = ["run", str(tmp_path / "p.lmpm"), "--epochs", "3", "--out", str(run), "--force"]
    rc, err = lmpm(capsys, *args, "--quiet")
    assert rc == 1 and "error[D032]" in err
    outside_untouched(tmp_path)


@pytest.mark.parametrize("linked", ["folder", "file"])
def test_render_never_writes_through_a_link(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], linked: str
) -> None:
    if linked == "folder":
        (run / "render").symlink_to(tmp_path / "outside" / "keep")
    else:
        (run / "render").mkdir()
        (run / "render" / "G.png").symlink_to(tmp_path / "outside" / "victim.txt")
    rc, err = lmpm(capsys, "render", str(run))
    if linked == "folder":
        assert rc == 1 and "error[D032]" in err
    else:
        assert rc == 0, err
        png = run / "render" / "G.png"
        assert not png.is_symlink() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    outside_untouched(tmp_path)


# ---- --out on a folder LMPM did not write ---------------------------------------------------------
def users_folder(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    d = tmp_path / "project"
    files = {"payload/mydata.csv": b"a,b\n1,2\n", "checkpoints/best.pt": b"my weights"}
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d, files


@pytest.mark.parametrize("force", [False, True])
def test_out_on_a_users_folder_is_refused_and_nothing_in_it_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], force: bool
) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROG)
    d, files = users_folder(tmp_path)
    args = ["run", str(prog), "--epochs", "3", "--checkpoint-every", "1", "--out", str(d)]
    rc, err = lmpm(capsys, *args, *(["--force"] if force else []))
    assert rc == 1 and "error[D034]" in err and "not an LMPM run" in err
    assert {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()} == set(files)
    assert all((d / rel).read_bytes() == data for rel, data in files.items())


def test_a_users_files_inside_a_run_survive_force_and_pruning(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "checkpoints" / "best.pt").write_bytes(b"my weights")
    (run / "payload" / "mydata.csv").write_bytes(b"a,b\n")
    args = ["run", str(tmp_path / "p.lmpm"), "--epochs", "5", "--checkpoint-every", "1"]
    rc, err = lmpm(capsys, *args, "--out", str(run), "--force", "--quiet")
    assert rc == 0, err
    rc, err = resume(capsys, run, epochs=8)  # prunes checkpoints at every epoch
    assert rc == 0, err
    assert (run / "checkpoints" / "best.pt").read_bytes() == b"my weights"
    assert (run / "payload" / "mydata.csv").read_bytes() == b"a,b\n"
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "epoch-00000000.safetensors" in kept and "epoch-00000008.safetensors" in kept


def test_vm_run_out_refuses_a_users_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(__file__).resolve().parents[2]
    d, files = users_folder(tmp_path)
    args = ["vm", "run", str(root / "examples" / "vm.lmpm"), "--out", str(d), "--force"]
    rc, err = lmpm(capsys, *args, "--bind", str(root / "examples" / "vm" / "tools.py"))
    assert rc == 1 and "error[D034]" in err
    assert all((d / rel).read_bytes() == data for rel, data in files.items())


# ---- names in the log ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("ABS", "D033"),  # an absolute path to a file outside
        ("../outside/victim.txt", "D033"),
        ("checkpoints/../../outside/victim.txt", "D033"),
        ("/dev/zero", "D033"),
        ("checkpoints/zero", "D032"),  # a device under a plain name
        ("checkpoints/fifo", "D032"),  # a FIFO: opening it blocking would hang
        ("checkpoints/outside", "D032"),  # a link to a file outside
    ],
)
def test_checkpoint_names_from_the_log_stay_inside_the_run(
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    deadline: None,
    name: str,
    code: str,
) -> None:
    os.mkfifo(run / "checkpoints" / "fifo")
    (run / "checkpoints" / "zero").symlink_to("/dev/zero")  # lstat: a link, refused as one
    (run / "checkpoints" / "outside").symlink_to(tmp_path / "outside" / "victim.txt")
    if name == "ABS":
        name = str(tmp_path / "outside" / "victim.txt")
    set_checkpoint_files(run, name)
    rc, err = resume(capsys, run)
    assert rc == 1 and f"error[{code}]" in err and "no checkpoint is usable" in err
    rc, err = lmpm(capsys, "trace", str(run), "--cell", "G[2,2]")
    assert rc in (0, 1) and "internal error" not in err
    outside_untouched(tmp_path)


def test_a_bad_name_in_a_newer_checkpoint_falls_back_to_an_older_one(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with sqlite3.connect(run / "lmpm.db") as c:
        top = c.execute("SELECT max(epoch) FROM checkpoints").fetchone()[0]
        c.execute("UPDATE checkpoints SET file = '/dev/zero' WHERE epoch = ?", (top,))
    rc, err = resume(capsys, run)
    assert rc == 0 and "using an older one" in err
    outside_untouched(tmp_path)


@pytest.mark.parametrize("name", ["/dev/zero", "../../outside/victim.txt", "checkpoints/fifo"])
def test_shard_names_in_a_checkpoint_stay_inside_the_run(
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    deadline: None,
    name: str,
) -> None:
    """A control checkpoint rewritten (with its sha256 in the log) to name a hostile shard."""
    os.mkfifo(run / "checkpoints" / "fifo")
    with sqlite3.connect(run / "lmpm.db") as c:
        rows = c.execute("SELECT epoch, file FROM checkpoints").fetchall()
        for epoch, rel in rows:
            data = (run / rel).read_bytes()
            n = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + n])
            meta = header.pop("__metadata__")
            shards = json.loads(meta["shards"])
            for s in shards.values():
                s["file"] = name
            meta["shards"] = json.dumps(shards)
            new = safetensors_bytes(load(data), meta)
            (run / rel).write_bytes(new)
            c.execute(
                "UPDATE checkpoints SET sha256 = ?, bytes = ? WHERE epoch = ?",
                (hashlib.sha256(new).hexdigest(), len(new), epoch),
            )
    rc, err = resume(capsys, run)
    assert rc == 1 and ("error[D033]" in err or "error[D032]" in err), err
    outside_untouched(tmp_path)


# ---- reads of files in the run ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["garbage", "fifo", "link", "objects"])
def test_render_of_a_bad_value_file_is_a_coded_error(
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    deadline: None,
    bad: str,
) -> None:
    npy = run / "G.npy"
    npy.unlink()
    if bad == "garbage":
        npy.write_bytes(b"\x93NUMPY\x01\x00{'descr': '<i8', 'shape': (4, 4)")
    elif bad == "fifo":
        os.mkfifo(npy)
    elif bad == "link":
        npy.symlink_to(tmp_path / "outside" / "victim.txt")
    else:
        import numpy as np

        np.save(npy, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    rc, err = lmpm(capsys, "render", str(run))
    assert rc == 1 and ("error[D035]" in err or "error[D032]" in err), err
    assert not (run / "render").exists() or not any((run / "render").iterdir())
    outside_untouched(tmp_path)


def test_render_with_damaged_meta_json_guesses_the_kinds(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with sqlite3.connect(run / "lmpm.db") as c:
        c.execute("UPDATE meta SET value = '{not json' WHERE key = 'source'")
    rc, err = lmpm(capsys, "render", str(run))
    assert rc == 0, err
    assert (run / "render" / "G.png").read_bytes()[:4] == b"\x89PNG"


def test_a_linked_log_or_wal_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "outside" / "victim.txt"
    (run / "lmpm.db-wal").symlink_to(victim)
    rc, err = resume(capsys, run)
    assert rc == 1 and "error[D032]" in err
    rc, err = lmpm(capsys, "trace", str(run))
    assert rc == 1 and "error[D032]" in err
    outside_untouched(tmp_path)


# ---- a training run --------------------------------------------------------------------------------
def test_a_training_resume_refuses_tampered_checkpoints_inputs_and_meta(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(__file__).resolve().parents[2]
    data = root / "examples" / "train"
    out = tmp_path / "t"
    inputs = ["--input", f"Corpus={data / 'corpus.npy'}", "--input", f"Held={data / 'held.npy'}"]
    small = ["--set", "H=2", "--set", "B=2", "--epochs", "2", "--quiet"]
    prog = root / "examples" / "train_bytelm.lmpm"
    rc, err = lmpm(
        capsys,
        "run",
        str(prog),
        *inputs,
        *small,
        "--out",
        str(out),
    )
    assert rc == 0, err
    inner = out / "checkpoints" / "inner-w0-000002.pt"
    kept = inner.read_bytes()
    inner.write_bytes(kept + b"tampered")
    rc, err = lmpm(capsys, "run", "--resume", str(out), "--epochs", "3", "--quiet")
    assert rc == 1 and "error[D021]" in err and "inner-w0-000002.pt" in err
    inner.write_bytes(kept)
    with sqlite3.connect(out / "train.db") as c:
        c.execute("""UPDATE meta SET value = '"abc"' WHERE key = 'workers'""")
    rc, err = lmpm(capsys, "run", "--resume", str(out), "--epochs", "3", "--quiet")
    assert rc == 1 and "error[D006]" in err and "`workers`" in err
    secret = tmp_path / "secret.npy"  # a file of this machine the log names as the corpus
    secret.write_bytes((data / "corpus.npy").read_bytes()[:-1] + b"!")
    with sqlite3.connect(out / "train.db") as c:
        c.execute("UPDATE meta SET value = '1' WHERE key = 'workers'")
        (got,) = c.execute("SELECT value FROM meta WHERE key = 'inputs'").fetchone()
        c.execute(
            "UPDATE meta SET value = ? WHERE key = 'inputs'",
            (json.dumps({**json.loads(got), "Corpus": str(secret)}),),
        )
    rc, err = lmpm(capsys, "run", "--resume", str(out), "--epochs", "3", "--quiet")
    assert rc == 1 and "error[D036]" in err and "Corpus" in err
    with sqlite3.connect(out / "train.db") as c:
        c.execute("UPDATE meta SET value = ? WHERE key = 'inputs'", (got,))
        c.execute("UPDATE checkpoints SET file = '../../outside' WHERE epoch = 2")
    rc, err = lmpm(capsys, "run", "--resume", str(out), "--epochs", "3", "--quiet")
    assert rc == 1 and "error[D033]" in err
    (out / "checkpoints" / "best.pt").write_bytes(b"my weights")
    rc, err = lmpm(capsys, "run", str(prog), *inputs, *small, "--out", str(out), "--force")
    assert rc == 0, err
    assert (out / "checkpoints" / "best.pt").read_bytes() == b"my weights"
    shutil.rmtree(out / "checkpoints")
    (tmp_path / "outside").mkdir()
    (out / "checkpoints").symlink_to(tmp_path / "outside")
    rc, err = lmpm(capsys, "run", "--resume", str(out), "--epochs", "3", "--quiet")
    assert rc == 1 and "error[D032]" in err
    assert not any((tmp_path / "outside").iterdir())
