"""`lmpm render RUN_DIR`: pictures of a run's committed values.

- grid values (``Grid2D`` / ``Grid3D``): PNG frames and, over the first axis of a 3-D grid, an
  animated GIF and a contact sheet, in palette colours (16-token values use the world palette of
  ``lmpm.models.world``; other vocabularies a categorical colour map; unset cells are dark grey);
- ``Tensor[D]`` values (one vector per cell): drawn by their cells, never with the payload axis
  as an image axis: the per-cell Euclidean norm as a grid (``NAME.png``, frames and a GIF for a
  3-D grid, as a numeric grid), and a labelled sheet ``NAME_components.png`` with the norm and
  one small panel per component (the first 16), each with its colour scale;
- ``Token[Byte]`` sequences: the text (``NAME.txt``; unset bytes shown as ``_``), also printed;
  so are the ``Seq`` / ``Grid2D`` values of a vocabulary bound to a tokenizer (``--tokenizer``;
  decoded with the run directory's copy, :mod:`lmpm.runtime.vocab`);
- with a run database in RUN_DIR (``lmpm.db``, the commit log and trace): a plot of violations per constraint per epoch
  (``violations.png``);
- a training run (``train.db`` and no ``lmpm.db``): the loss curve, ``RUN_DIR/loss.png`` (or
  ``--out DIR/loss.png``), see :mod:`lmpm.train.plots`.

Value types come from the program: ``--program FILE``, else the program source and parameters the
run database stores, else they are guessed from the arrays (1-D integer arrays of bytes are text, 2-D and
3-D integer arrays are grids).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmpm.errors import UsageError
from lmpm.printable import printable
from lmpm.runtime.runfiles import atomic_write

if TYPE_CHECKING:
    import numpy as np

HELP = "render a run directory: PNG frames + GIF for grids, text for bytes, violations per epoch"

UNSET_RGB = (48, 48, 48)
MAX_COLOURS = 4096  # larger vocabularies are coloured along viridis per cell, not by a table
MAX_RENDER_CELLS = 1 << 26  # cells of one value render draws (a 2-D grid of 8192 x 8192)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of `lmpm run`")
    p.add_argument(
        "--program", metavar="FILE", help="the .lmpm program (value types, vocabularies)"
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write pictures here (default RUN_DIR/render; RUN_DIR for a training run)",
    )
    p.add_argument("--scale", type=int, default=8, help="pixels per cell (default 8)")
    p.add_argument("--fps", type=float, default=3.0, help="GIF frames per second (default 3)")
    p.add_argument("--value", action="append", default=[], help="render only these values")
    p.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help=argparse.SUPPRESS
    )


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    kind: str  # "text" | "grid" | "tensor" | "skip"
    vocab: int | None
    rank: int = 0  # "tensor": the cell axes (the array's trailing axes are each cell's payload)


def run(args: argparse.Namespace) -> int:

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"no such run directory: {run_dir}", code="U030")
    if (run_dir / "train.db").is_file() and trace_db(run_dir) is None:
        return render_training(run_dir, Path(args.out) if args.out else run_dir)
    arrays = load_values(run_dir)
    if args.value:
        missing = [v for v in args.value if v not in arrays]
        if missing:
            raise UsageError(
                f"RUN_DIR has no value {', '.join(missing)}; values: {', '.join(arrays)}",
                code="U031",
            )
        arrays = {k: v for k, v in arrays.items() if k in args.value}
    if not arrays:
        raise UsageError(
            f"{run_dir} holds no NAME.npy values (write them with `lmpm run --out`)", code="U032"
        )
    kinds = value_kinds(run_dir, arrays, args.program)
    out = output_folder(run_dir, args.out)
    written: list[Path] = []
    texts = tokenizer_texts(run_dir)
    for name, arr in arrays.items():
        k = kinds.get(name) or guess(name, arr)
        if name in texts:  # a tokenizer's vocabulary: its text
            path = out / f"{name}.txt"
            atomic_write(path, texts[name].encode("utf-8"))
            written.append(path)
            sys.stdout.write(f"{name}: {texts[name]}")
        elif k.kind == "text":
            text = as_text(arr)
            path = out / f"{name}.txt"
            atomic_write(path, (text + "\n").encode("utf-8"))
            written.append(path)
            sys.stdout.write(f"{printable(name)}: {text}\n")
        elif k.kind == "grid":
            grid = arr.reshape(-1, 1) if arr.ndim == 1 else arr  # a sequence: one row
            written.extend(render_grid(name, grid, k.vocab, out, args.scale, args.fps))
        elif k.kind == "tensor":
            written.extend(render_tensor(name, arr, k.rank, out, args.scale, args.fps))
    db = trace_db(run_dir)
    if db is not None:
        plot = plot_violations(db, out / "violations.png")
        if plot is not None:
            written.append(plot)
    for p in written:
        sys.stderr.write(f"wrote {printable(str(p))}\n")
    return 0


def load_values(run_dir: Path) -> dict[str, np.ndarray]:
    """The run's ``NAME.npy`` values: regular files of the run only (a link or a FIFO is refused,
    D032), each loaded without pickles; one that is not a readable array is RunDirError D035."""
    import io

    import numpy as np

    from lmpm.errors import RunDirError
    from lmpm.runtime.runfiles import is_plain_file, read_file

    arrays = {}
    for p in sorted(run_dir.glob("*.npy")):
        if is_plain_file(p):
            _check_value(p)  # its header, before a byte of its data is read
        try:
            data = read_file(run_dir, p.name)
            arrays[p.stem] = np.load(io.BytesIO(data), allow_pickle=False)
        except RunDirError:
            raise
        except Exception as e:  # OSError, a bad header or data, an object array (pickles)
            raise RunDirError(
                f"{p} is not a readable array ({type(e).__name__}: {e}); nothing was written",
                code="D035",
                hint="restore the file from a copy, or render the other values with --value",
            ) from None
    return arrays


def output_folder(run_dir: Path, given: str | None) -> Path:
    """Where pictures go: ``--out DIR`` (the user's path, made if missing), else ``RUN_DIR/render``,
    a real folder of the run (a link in its place is refused, D032, never written through)."""
    from lmpm.runtime.runfiles import folder, os_error

    if given is None:
        return folder(run_dir, "render", create=True)
    out = Path(given)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, "create the folder", out) from None
    return out


def _image_bytes(image: Any, **options: Any) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, **options)
    return buf.getvalue()


def _check_value(path: Path) -> None:
    """A value's ``NAME.npy`` header, checked before its data (D035): numbers, at most
    :data:`MAX_RENDER_CELLS` cells, no more data than the file holds."""
    from lmpm.errors import RunDirError
    from lmpm.npyfile import NpyError, npy_header

    try:
        head = npy_header(path)
        cells = head.nbytes // max(head.dtype.itemsize, 1)
        if head.dtype.kind not in "biuf":
            raise NpyError(f"{path} holds {head.dtype}, not real numbers or tokens")
        if cells > MAX_RENDER_CELLS:
            raise NpyError(
                f"{path} has {cells:,} cells ({list(head.shape)}); render draws at most "
                f"{MAX_RENDER_CELLS:,} per value"
            )
    except NpyError as e:
        raise RunDirError(
            f"cannot render {printable(str(e))}",
            code="D035",
            hint="render the other values with --value NAME",
        ) from None


def render_training(run_dir: Path, out: Path) -> int:
    """The loss curve of a training run: ``OUT/loss.png``."""
    from lmpm.train.log import read
    from lmpm.train.plots import plot_loss

    history = read(run_dir)
    if out != run_dir:
        out.mkdir(parents=True, exist_ok=True)
    path = plot_loss(history, out / "loss.png")
    sys.stderr.write(f"wrote {path}\n")
    return 0


def value_kinds(run_dir: Path, arrays: dict[str, Any], program: str | None) -> dict[str, Kind]:
    """Kinds of the values from the program (``--program``, or the IR in the run database)."""
    ir = None
    params: dict[str, int] = {}
    if program is not None:
        from lmpm.ir import compile_file

        p = Path(program)
        if not p.is_file():
            raise UsageError(f"--program {program}: no such file", code="U033")
        ir = compile_file(p).ir
    else:
        ir, params = run_program(run_dir)
    if ir is None:
        return {}
    from lmpm.errors import LmpmError
    from lmpm.ir.eval import bind_params, evaluate
    from lmpm.ir.nodes import DType, ShapeKind

    try:
        env = bind_params(ir, params)  # the run's --set values: its dims and vocabularies
    except LmpmError:
        env = {}
    out: dict[str, Kind] = {}
    for v in ir.values:
        if v.shape == ShapeKind.SET:
            out[v.name] = Kind(v.name, "skip", None)
            continue
        vocab = None
        if v.vocab is not None and v.dtype == DType.TOKEN:
            try:
                vocab = int(evaluate(v.vocab, env))
            except Exception:
                vocab = None
        arr = arrays.get(v.name)
        if v.dtype == DType.TENSOR:  # the array's last axes are each cell's payload
            rank = len(v.dims)
            fits = arr is None or arr.ndim > rank
            out[v.name] = Kind(
                v.name, "tensor" if rank in (1, 2, 3) and fits else "skip", None, rank
            )
            continue
        rank = arr.ndim if arr is not None else len(v.dims)
        if vocab == 256 and rank == 1:
            out[v.name] = Kind(v.name, "text", vocab)
        elif rank in (1, 2, 3):  # a sequence of other tokens or numbers: a one-row grid
            out[v.name] = Kind(v.name, "grid", vocab)
        else:
            out[v.name] = Kind(v.name, "skip", vocab)
    return out


def guess(name: str, arr: np.ndarray) -> Kind:
    import numpy as np

    if not np.issubdtype(arr.dtype, np.integer):
        return Kind(name, "grid" if arr.ndim in (1, 2, 3) else "skip", None)
    top = int(arr.max()) if arr.size else -1
    if arr.ndim == 1 and top < 256:
        return Kind(name, "text", 256)
    if arr.ndim in (1, 2, 3):
        return Kind(name, "grid", 16 if top < 16 else top + 1)
    return Kind(name, "skip", None)


def as_text(arr: np.ndarray) -> str:
    chars = []
    for b in arr.reshape(-1).tolist():
        if b is None or b < 0:
            chars.append("_")
        elif 32 <= b < 127:
            chars.append(chr(b))
        elif b == 10:
            chars.append("\\n")
        else:
            chars.append(f"\\x{b:02x}")
    return "".join(chars).rstrip("_")


def colours(vocab: int | None) -> np.ndarray:
    """(vocab, 3) uint8 RGB per token, for a vocabulary of at most :data:`MAX_COLOURS`."""
    import numpy as np

    from lmpm.models.world import RGB

    if vocab is not None and vocab <= len(RGB):
        return np.array(RGB[:vocab], dtype=np.uint8)
    import matplotlib

    n = min(max(vocab or 1, 1), MAX_COLOURS)
    cmap = matplotlib.colormaps["tab20" if n <= 20 else "viridis"]
    rgb = [cmap(i % 20 if n <= 20 else i / max(n - 1, 1))[:3] for i in range(n)]
    return (np.array(rgb) * 255).astype(np.uint8)


def to_rgb(grid: np.ndarray, vocab: int | None, scale: int) -> np.ndarray:
    """(W, H) tokens (x, y; -1 unset) → (H*scale, W*scale, 3) image, rows = y."""
    import matplotlib
    import numpy as np

    img = grid.T  # rows are y
    if np.issubdtype(img.dtype, np.floating):
        unset = np.isnan(img)
        lo, hi = (
            np.nanmin(img) if (~unset).any() else 0.0,
            np.nanmax(img) if (~unset).any() else 1.0,
        )
        norm = (np.nan_to_num(img) - lo) / max(hi - lo, 1e-9)
        rgb = (matplotlib.colormaps["viridis"](norm)[..., :3] * 255).astype(np.uint8)
    else:
        unset = img < 0
        n = vocab if vocab is not None else int(img.max()) + 1 if img.size else 1
        if n > MAX_COLOURS:  # a token id of 10**12: colour along the map, no table of n entries
            norm = np.clip(img, 0, n - 1).astype(np.float64) / (n - 1)
            rgb = (matplotlib.colormaps["viridis"](norm)[..., :3] * 255).astype(np.uint8)
        else:
            pal = colours(n)
            rgb = pal[np.clip(img, 0, len(pal) - 1)]
    rgb[unset] = UNSET_RGB
    s = max(int(scale), 1)
    return np.repeat(np.repeat(rgb, s, axis=0), s, axis=1)


def render_grid(
    name: str, arr: np.ndarray, vocab: int | None, out: Path, scale: int, fps: float
) -> list[Path]:
    import numpy as np
    from PIL import Image

    frames = arr[None] if arr.ndim == 2 else arr
    images = [Image.fromarray(to_rgb(f, vocab, scale)) for f in frames]
    written = []
    if len(images) == 1:
        p = out / f"{name}.png"
        atomic_write(p, _image_bytes(images[0], format="PNG"))
        return [p]
    for t, im in enumerate(images):
        p = out / f"{name}_{t:03d}.png"
        atomic_write(p, _image_bytes(im, format="PNG"))
        written.append(p)
    gap = max(scale // 2, 1)
    w, h = images[0].size
    sheet = Image.new("RGB", (len(images) * (w + gap) - gap, h), (255, 255, 255))
    for t, im in enumerate(images):
        sheet.paste(im, (t * (w + gap), 0))
    p = out / f"{name}.png"
    atomic_write(p, _image_bytes(sheet, format="PNG"))
    written.append(p)
    gif = out / f"{name}.gif"
    gif_bytes = _image_bytes(
        images[0],
        format="GIF",
        save_all=True,
        append_images=images[1:],
        duration=int(1000 / max(fps, 0.1)),
        loop=0,
        optimize=False,
    )
    atomic_write(gif, gif_bytes)
    written.append(gif)
    del np
    return written


COMPONENT_PANELS = 16  # the components a Tensor value's sheet shows one panel each


def render_tensor(
    name: str, arr: np.ndarray, rank: int, out: Path, scale: int, fps: float
) -> list[Path]:
    """A ``Tensor[D]`` value, ``arr`` of shape (*cells, *payload) with ``rank`` cell axes: the
    per-cell norm as a numeric grid (``NAME.png``; frames and GIF over a 3-D grid's first axis),
    and the labelled sheet ``NAME_components.png``. Unset cells (NaN) are dark grey."""
    import numpy as np

    cells = arr.reshape(*arr.shape[:rank], -1).astype(np.float64)  # (*cells, D)
    norm = np.sqrt((cells**2).sum(axis=-1))  # (*cells,) NaN where unset
    grid = norm.reshape(-1, 1) if rank == 1 else norm  # a sequence: one row
    written = render_grid(name, grid, None, out, scale, fps)
    written.append(tensor_sheet(name, cells, rank, out / f"{name}_components.png"))
    return written


def tensor_sheet(name: str, cells: np.ndarray, rank: int, path: Path) -> Path:
    """Small multiples of a Tensor value, (*cells, D): the norm per cell, then one panel per
    component (the first :data:`COMPONENT_PANELS`); a 3-D grid shows its last frame's. Each
    panel has a title and a colour bar; x runs right, y down (as the frames draw them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    frame = ""
    if rank == 3:
        frame = f"frame {len(cells) - 1} of {len(cells)}, "
        cells = cells[-1]
    planes = cells.reshape(-1, 1, cells.shape[-1]) if rank == 1 else cells  # (W, H, D)
    d = planes.shape[-1]
    shown = min(d, COMPONENT_PANELS)
    panels = [("‖" + name + "‖ (norm)", np.sqrt((planes**2).sum(axis=-1)))]
    panels += [(f"{name}[..., {i}]", planes[..., i]) for i in range(shown)]
    cols = min(len(panels), 6)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.4 * rows + 0.6), squeeze=False)
    r, g, b = (c / 255 for c in UNSET_RGB)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=(r, g, b))
    for ax, (title, plane) in zip(axes.flat, panels):
        im = ax.imshow(np.ma.masked_invalid(plane.T), cmap=cmap, interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("x" if rank > 1 else "cell", fontsize=8)
        if rank > 1:
            ax.set_ylabel("y", fontsize=8)
        else:
            ax.set_yticks([])
        ax.tick_params(labelsize=7)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    more = f"; the first {shown} of {d} components" if shown < d else ""
    fig.suptitle(f"{name}: Tensor[{d}] per cell ({frame}norm and components{more})", fontsize=10)
    fig.tight_layout()
    from lmpm.train.plots import save_figure

    save_figure(fig, path, dpi=80)
    plt.close(fig)
    return path


# ---- the trace database (lmpm.runtime.control.commitlog: RUN_DIR/lmpm.db) ------------------------------
DB_NAME = "lmpm.db"


def trace_db(run_dir: Path) -> Path | None:
    from lmpm.runtime.runfiles import is_plain_file

    p = run_dir / DB_NAME
    return p if is_plain_file(p) else None


def _query(db: Path, sql: str) -> list[tuple[Any, ...]] | None:
    import sqlite3

    from lmpm.errors import RunDirError
    from lmpm.runtime.received import open_reader
    from lmpm.runtime.rundir import attach_shards, log_schema

    try:
        con = open_reader(db, log_schema())
    except RunDirError:
        return None
    try:
        attach_shards(con, db.parent)  # the per-cell tables of a multi-worker run
        return con.execute(sql).fetchall()
    except sqlite3.Error:
        return None
    except RunDirError as e:
        if e.code == "D041":  # the time budget: say so rather than draw nothing
            raise
        return None
    finally:
        con.close()


def ir_from_db(run_dir: Path) -> Any:
    """The program's IR, compiled from the source and parameters the run database stores."""
    return run_program(run_dir)[0]


def tokenizer_texts(run_dir: Path) -> dict[str, str]:
    """Value -> its text, for the values of a vocabulary the run bound to a tokenizer."""
    import json

    from lmpm.runtime.vocab import run_texts

    db = trace_db(run_dir)
    rows = None if db is None else _query(db, "SELECT value FROM meta WHERE key = 'tokenizers'")
    if not rows:
        return {}
    return run_texts(run_dir, {"tokenizers": json.loads(rows[0][0])})


def run_program(run_dir: Path) -> tuple[Any, dict[str, int]]:
    """(IR, --set parameters) of the run, from its database; (None, {}) when unreadable."""
    import json

    db = trace_db(run_dir)
    if db is None:
        return None, {}
    rows = _query(
        db, "SELECT key, value FROM meta WHERE key IN ('source', 'params', 'program_file')"
    )
    if not rows:
        return None, {}
    try:
        meta = {str(k): json.loads(v) for k, v in rows}
    except (ValueError, TypeError):  # a damaged meta entry: the kinds are guessed instead
        return None, {}
    source = meta.get("source")
    params = meta.get("params") or {}
    if not isinstance(source, str) or not isinstance(params, dict):
        return None, {}
    from lmpm.ir import compile_source

    try:
        front = compile_source(
            source, str(meta.get("program_file", "<run>")), overrides=meta.get("params") or None
        )
    except Exception:
        return None, {}
    return front.ir, params


def violations_by_epoch(db: Path) -> dict[str, dict[int, int]] | None:
    """constraint → epoch → violated candidates (every rule, keep-current included)."""
    rows = _query(
        db,
        "SELECT s.epoch, c.name, SUM(s.violations) FROM trace_summary s "
        "JOIN constraint_defs c ON c.id = s.constraint_id GROUP BY s.epoch, c.name ORDER BY s.epoch",
    )
    if rows is None:
        return None
    out: dict[str, dict[int, int]] = {}
    for epoch, name, count in rows:
        try:
            out.setdefault(printable(str(name)), {})[int(epoch)] = int(count or 0)
        except (TypeError, ValueError, OverflowError):
            continue  # a value LMPM never writes: left out of the plot
    return out


def plot_violations(db: Path, path: Path) -> Path | None:
    data = violations_by_epoch(db)
    if not data:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, series in sorted(data.items()):
        xs = sorted(series)
        ax.plot(xs, [series[x] for x in xs], marker="o", ms=3, label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("violated candidates")
    ax.set_title("violations per constraint per epoch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    from lmpm.train.plots import save_figure

    save_figure(fig, path)
    plt.close(fig)
    return path
