"""`lmpm render RUN_DIR`: frames, GIF, text, the violations plot, and the program's value types."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
from PIL import Image

from lmpm.cli import main

PROG = """\
param T = 3
param N = 12
value Txt : Token[Byte] shape Seq(N) clock Lamport
value Vid : Token[16] shape Grid3D(T, 8, 8) clock Lamport
value MaskPlan : Event shape Set() clock Lamport
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Gen:
  on Vid[t,x,y]
  emit proposal Vid[t,x,y] := Uniform(k=2)
rule Say:
  on Txt[t]
  read {context = Txt[0..t-1]}
  emit proposal Txt[t] := Uniform(context, k=4)
constraint Blue:
  require Vid[t, x, y] in Set(0..3) priority 5
constraint Lower:
  require Txt[t] in Set(97..122) priority 5
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_render_run_dir(tmp_path: Path) -> None:
    prog = tmp_path / "p.lmpm"
    prog.write_text(PROG)
    run_dir = tmp_path / "run"
    rc, _, err = cli("run", str(prog), "--epochs", "6", "--out", str(run_dir), "--quiet")
    assert rc == 0, err
    rc, out, err = cli("render", str(run_dir))
    assert rc == 0, err
    r = run_dir / "render"
    frames = sorted(r.glob("Vid_*.png"))
    assert len(frames) == 3
    with Image.open(frames[0]) as im:
        assert im.size == (64, 64)  # 8×8 cells × scale 8
    with Image.open(r / "Vid.gif") as gif:
        assert gif.n_frames == 3
    text = (r / "Txt.txt").read_text().strip()
    assert out.startswith("Txt: ") and text  # unprintable bytes are written as \xNN
    if (run_dir / "lmpm.db").is_file():  # the commit log + trace of `lmpm run`
        assert (r / "violations.png").is_file()


def test_render_without_program_guesses_types(tmp_path: Path) -> None:
    np.save(tmp_path / "Vid.npy", np.array([[[0, 1], [2, -1]], [[3, 3], [10, 15]]]))
    np.save(tmp_path / "Txt.npy", np.array([*b"hi there", -1, -1]))
    rc, out, err = cli("render", str(tmp_path), "--out", str(tmp_path / "pics"), "--scale", "2")
    assert rc == 0, err
    assert (tmp_path / "pics" / "Vid.gif").is_file() and "Txt: hi there" in out
    with Image.open(tmp_path / "pics" / "Vid_001.png") as im:
        px = im.convert("RGB").load()
        assert px is not None and px[0, 0] == (90, 200, 220)  # Vid[1, 0, 0] = 3: cyan
        assert px[2, 0] == (220, 40, 40)  # Vid[1, 1, 0] = 10: red (x is the column)


def test_render_errors(tmp_path: Path) -> None:
    assert cli("render", str(tmp_path / "nope"))[0] == 2
    assert cli("render", str(tmp_path))[0] == 2  # no values


ANY = """\
value A : Float shape Grid2D(W, 4)
value B : Token[Byte] shape Seq(N)
value C : Token[5] shape Seq(N)
value D : Token[VQ] shape Grid3D(2, W, W)
rule Gen:
  on D[t,x,y] when t == 1
  emit proposal D[t,x,y] := Uniform(k=1)
"""


def test_render_any_run_set_dims_unset_cells_every_value_type(tmp_path: Path) -> None:
    """Implicit dims bound with --set, cells left unset, numbers, text, non-text sequences."""
    prog = tmp_path / "any.lmpm"
    prog.write_text(ANY)
    a = np.full((3, 4), np.nan, dtype=np.float32)
    a[0, 0] = 1.5
    np.save(tmp_path / "a.npy", a)
    (tmp_path / "b.txt").write_text("hi")
    out = tmp_path / "run"
    sets = ["--set", "W=3", "--set", "N=5", "--set", "VQ=7"]
    argv = ["run", str(prog), *sets, "--input", f"A={tmp_path / 'a.npy'}"]
    argv += ["--input", f"B={tmp_path / 'b.txt'}", "--epochs", "1", "--out", str(out), "--quiet"]
    with redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        assert main(["render", str(out)]) == 0, stderr.getvalue()
    render = out / "render"
    assert (render / "B.txt").read_text() == "hi\n" and "B: hi" in stdout.getvalue()
    for name in ("A.png", "C.png", "D.png", "D.gif"):
        assert (render / name).is_file(), name
    with Image.open(render / "A.png") as im:
        assert im.size[0] > 0


TENSORS = """\
value Z : Tensor[4] shape Grid2D(6, 4)
value Q : Tensor[3] shape Seq(4)
value MaskPlan : Event shape Set()
"""


def test_a_tensor_value_renders_by_its_cells_not_its_payload_axis(tmp_path: Path) -> None:
    """`Z : Tensor[4] shape Grid2D(6, 4)` is one 6×4 picture of its cells' norms (not six 4×4
    frames), with a labelled sheet of its components; a Seq of Tensor[3] is one row of 4 cells."""
    prog = tmp_path / "t.lmpm"
    prog.write_text(TENSORS)
    z = np.arange(6 * 4 * 4, dtype=np.float32).reshape(6, 4, 4)
    q = np.ones((4, 3), dtype=np.float32)
    q[2] = np.nan  # an unset cell
    np.save(tmp_path / "z.npy", z)
    np.save(tmp_path / "q.npy", q)
    out = tmp_path / "run"
    argv = ["run", str(prog), "--input", f"Z={tmp_path / 'z.npy'}"]
    argv += ["--input", f"Q={tmp_path / 'q.npy'}", "--epochs", "1", "--out", str(out), "--quiet"]
    with redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    rc, _, err = cli("render", str(out))
    assert rc == 0, err
    render = out / "render"
    assert not list(render.glob("Z_0*.png")) and not (render / "Z.gif").exists()
    with Image.open(render / "Z.png") as im:
        assert im.size == (6 * 8, 4 * 8)  # W × H cells, scale 8
        rgb = np.asarray(im.convert("RGB"))
    # the norm grows with the cell index: the last cell (x=5, y=3) is the brightest (viridis)
    assert rgb[-1, -1].sum() > rgb[0, 0].sum()
    with Image.open(render / "Q.png") as im:
        assert im.size == (4 * 8, 8)
        row = np.asarray(im.convert("RGB"))[0]
    assert tuple(row[2 * 8]) == (48, 48, 48)  # the unset cell
    for sheet in ("Z_components.png", "Q_components.png"):
        with Image.open(render / sheet) as im:
            assert im.size[0] > im.size[1] > 0
