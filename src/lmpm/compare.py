"""The model alone vs the same model under a program's constraints: two runs compared cell by cell.

Both runs are ordinary run directories (``lmpm run --trace cells``): one of a program without its
constraints (e.g. ``examples/video_free.lmpm``), one of the program itself, with the same inputs and
seed. :func:`compare` reads their outputs, the constrained run's constraint trace (which constraint
*decided* which cell, see :mod:`lmpm.runtime.control.trace`) and commit log, and measures, per constraint,
how far each run satisfies it at the end:

- ``require/forbid X in Set`` (IN_SET): the share of the cells it speaks about, other than the
  given (input) cells, whose final payload is (not) in the set (an unset cell satisfies no
  ``require``);
- ``forbid change(X)`` (CHANGE): the share of its cells never changed after they were first
  committed (by an input or by a rule) — from the commit log;
- other predicates: not measured here (``None``).

:func:`sheet` draws the two runs' grids side by side (model alone above, constrained below, frames
across) with a third row marking the cells that differ, coloured by the constraint that decided them.
``scripts/compare.py`` is the command line.
"""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmpm.errors import RunDirError, UsageError
from lmpm.printable import printable
from lmpm.runtime.received import interpreting
from lmpm.runtime.rundir import connect, read_meta
from lmpm.runtime.runfiles import check_database, read_file


@dataclass(frozen=True, slots=True)
class ConstraintCheck:
    """One constraint of the constrained program, measured in both runs."""

    name: str
    text: str  # the constraint's source line (from the trace)
    priority: int
    cells: int  # cells it speaks about
    satisfied: dict[str, float | None]  # run label -> share of its cells satisfying it at the end
    decided_cells: int  # distinct cells where it decided the winner (constrained run, trace)
    decisions: int  # decisions it decided (a cell decided in several epochs counts each time)
    decided_and_differ: int  # decided cells whose final payload differs between the runs


@dataclass(frozen=True, slots=True)
class Comparison:
    value: str
    dims: tuple[int, ...]
    alone: np.ndarray  # (dims) final payload of the model alone (-1: unset)
    constrained: np.ndarray  # (dims) final payload under the constraints
    decided: dict[str, np.ndarray]  # constraint -> (dims) bool: cells it decided
    checks: list[ConstraintCheck] = field(default_factory=list)
    labels: tuple[str, str] = ("alone", "constrained")
    vocab: int | None = None  # the value's vocabulary (tokens), if it has one

    @property
    def differ(self) -> np.ndarray:
        """(dims) bool: cells whose final payload differs between the runs."""
        return np.asarray(self.alone != self.constrained)

    def example(self, name: str) -> str | None:
        """A cell the constraint ``name`` decided (one that differs between the runs if any), as
        ``Value[i,j,...]`` for ``lmpm trace --cell``."""
        mask = self.decided.get(name)
        if mask is None or not mask.any():
            return None
        pick = mask & self.differ if (mask & self.differ).any() else mask
        idx = np.unravel_index(int(np.flatnonzero(pick.reshape(-1))[0]), self.dims)
        return f"{self.value}[{','.join(str(int(i)) for i in idx)}]"

    def numbers(self) -> dict[str, Any]:
        """The comparison as JSON-ready numbers."""
        return {
            "value": self.value,
            "cells": int(self.alone.size),
            "cells_differ": int(self.differ.sum()),
            "share_differ": round(float(self.differ.mean()), 4),
            "constraints": [
                {
                    "name": c.name,
                    "priority": c.priority,
                    "cells": c.cells,
                    "decided_cells": c.decided_cells,
                    "decisions": c.decisions,
                    "decided_and_differ": c.decided_and_differ,
                    "satisfied": c.satisfied,
                    "example": self.example(c.name),
                }
                for c in self.checks
            ],
        }


def _meta(conn: sqlite3.Connection) -> dict[str, Any]:
    return read_meta(conn)


def _connect(run_dir: Path) -> sqlite3.Connection:
    """The run's log, opened as every reader opens one (:func:`lmpm.runtime.rundir.connect`: its
    schema checked, a time budget; a multi-worker run's commits read from its workers' stores)."""
    if not (run_dir / "lmpm.db").is_file():
        raise UsageError(f"{printable(str(run_dir))} holds no run (no lmpm.db)", code="U070")
    check_database(run_dir / "lmpm.db", "read")  # regular files: SQLite would follow a link
    return connect(run_dir)


def _output(run_dir: Path, value: str) -> np.ndarray:
    path = run_dir / f"{value}.npy"
    if not path.is_file():
        raise UsageError(f"{run_dir} has no output {value}.npy", code="U071")
    try:  # a regular file of the run (D032), no pickles
        data = read_file(run_dir, path.name)
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise RunDirError(
            f"{path} is not a readable array ({type(e).__name__}: {e})", code="D035"
        ) from None


def commits_per_cell(conn: sqlite3.Connection, value: str, ncells: int) -> np.ndarray:
    """(ncells,) how many epochs committed each cell of ``value`` (inputs not counted)."""
    counts = np.zeros(ncells, dtype=np.int64)
    for first, step, count in conn.execute(
        "SELECT first, step, count FROM commits WHERE value = ?", (value,)
    ):
        np.add.at(counts, first + step * np.arange(count), 1)
    return counts


def decided_by(
    conn: sqlite3.Connection, value: str, ncells: int
) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """Per constraint id: (ncells,) bool of the cells it decided, and its number of decisions.
    Needs a run traced at the ``cells`` level."""
    level = _meta(conn).get("trace")
    if level != "cells":
        raise UsageError(
            "the constrained run was traced at the "
            f"{level!r} level; which cell each constraint decided needs `--trace cells`",
            code="U072",
        )
    cells: dict[int, np.ndarray] = {}
    decisions: dict[int, int] = {}
    for cell, by in conn.execute(
        "SELECT cell, decided_by FROM trace_cells WHERE value = ? AND decided_by IS NOT NULL",
        (value,),
    ):
        for cid in json.loads(by):
            cells.setdefault(cid, np.zeros(ncells, dtype=bool))[cell] = True
            decisions[cid] = decisions.get(cid, 0) + 1
    return cells, decisions


def compare(
    alone_dir: str | Path,
    constrained_dir: str | Path,
    value: str,
    labels: tuple[str, str] = ("alone", "constrained"),
    *,
    trust_bind: bool = False,
) -> Comparison:
    """Compare ``value`` between a run of the model alone and a run under the constraints.

    The constrained run must be traced at the ``cells`` level; both must be runs of programs with
    the same values and parameters. A run started with ``--bind`` modules is compared only with
    ``trust_bind=True`` (``--trust-bind``): its modules are imported to resolve the program
    (:func:`lmpm.bindings.recorded_modules`, UsageError U040 otherwise)."""
    from lmpm.bindings import Bindings, recorded_modules
    from lmpm.ir import compile_source
    from lmpm.ir.nodes import PredKind, Status
    from lmpm.resolve.plan import resolve
    from lmpm.runtime.io import load_input

    dirs = (Path(alone_dir), Path(constrained_dir))
    conns = tuple(_connect(d) for d in dirs)
    # a log is data: any value of any type in any column is D043, never a traceback
    reading = interpreting(dirs[1], f"compare {printable(str(dirs[0]))} with")
    with reading:
        try:
            outs = tuple(_output(d, value) for d in dirs)
            if outs[0].shape != outs[1].shape:
                raise UsageError(
                    f"{value} has shape {outs[0].shape} in {dirs[0]} but {outs[1].shape} in {dirs[1]}",
                    code="U073",
                )
            metas = tuple(_meta(c) for c in conns)
            meta = metas[1]
            # the program the log stores (as resume does), never a file the log names
            front = compile_source(
                meta["source"], meta["program_file"], overrides=dict(meta.get("params") or {})
            )
            bind = Bindings(
                recorded_modules(meta.get("bind"), where=str(dirs[1]), trust=trust_bind)
            )
            plan = resolve(front.ir, dict(meta.get("params") or {}), bind)
            vp = plan.values[value]
            ncells = int(np.prod(outs[0].shape))
            flat = tuple(o.reshape(-1) for o in outs)
            given: list[np.ndarray] = []
            for m in metas:
                path = (m.get("inputs") or {}).get(value)
                if path is None:
                    given.append(np.zeros(ncells, dtype=bool))
                else:
                    _, committed = load_input(path, vp)
                    given.append(np.asarray(committed).reshape(-1).astype(bool))
            commits = tuple(commits_per_cell(c, value, ncells) for c in conns)
            decided, decisions = decided_by(conns[1], value, ncells)
            names = {
                cid: name for cid, name in conns[1].execute("SELECT id, name FROM constraint_defs")
            }
            texts = {
                cid: text for cid, text in conns[1].execute("SELECT id, text FROM constraint_defs")
            }
        finally:
            for c in conns:
                c.close()

    differ = flat[0] != flat[1]
    checks = []
    decided_masks: dict[str, np.ndarray] = {}
    dims = tuple(int(d) for d in outs[0].shape)
    for cp in plan.constraints:
        if cp.target != value or cp.status == Status.PROVED:
            continue
        covers = np.asarray(cp.cells.cpu()).astype(bool)
        satisfied: dict[str, float | None] = {}
        for label, payload, n_commits, inputs in zip(labels, flat, commits, given):
            share: float | None = None
            if cp.pred == PredKind.IN_SET and cp.table is not None:
                table = np.asarray(cp.table.cpu()).astype(bool)
                tok = np.clip(payload, -1, table.size - 1)
                member = np.where(tok >= 0, table[np.maximum(tok, 0)], False)
                ok = member if cp.kind == "require" else ~member & (tok >= 0)
                written = covers & ~inputs  # the givens are not the model's doing
                share = float(ok[written].mean()) if written.any() else None
            elif cp.pred == PredKind.CHANGE:
                changed = (n_commits >= 2) | (inputs & (n_commits >= 1))
                ok = ~changed if cp.kind == "forbid" else changed
                share = float(ok[covers].mean()) if covers.any() else None
            satisfied[label] = None if share is None else round(share, 4)
        mask = decided.get(cp.id, np.zeros(ncells, dtype=bool))
        decided_masks[names.get(cp.id, cp.name)] = mask.reshape(dims)
        checks.append(
            ConstraintCheck(
                names.get(cp.id, cp.name),
                texts.get(cp.id) or cp.name,
                cp.priority,
                int(covers.sum()),
                satisfied,
                int(mask.sum()),
                decisions.get(cp.id, 0),
                int((mask & differ).sum()),
            )
        )
    return Comparison(value, dims, outs[0], outs[1], decided_masks, checks, labels, vp.vocab)


# ---- the sheet -------------------------------------------------------------------------------------
DECIDED_COLOURS = ((255, 0, 255), (0, 255, 255), (255, 128, 0), (0, 255, 0))


def _palette(vocab: int) -> np.ndarray:
    """(vocab + 1, 3) uint8 colours; the last row is unset (dark grey)."""
    from lmpm.models import world

    if vocab == world.K:
        rgb = np.array(world.RGB, dtype=np.uint8)
    else:
        import matplotlib

        cmap = matplotlib.colormaps["tab20" if vocab <= 20 else "viridis"]
        rgb = (cmap(np.linspace(0, 1, max(vocab, 1)))[:, :3] * 255).astype(np.uint8)
    return np.concatenate([rgb, np.array([[60, 60, 60]], dtype=np.uint8)])


def _frames(grid: np.ndarray) -> list[np.ndarray]:
    """A (T, W, H) or (W, H) grid as images (rows = y, columns = x)."""
    if grid.ndim == 2:
        return [grid.T]
    if grid.ndim == 3:
        return [g.T for g in grid]
    raise UsageError(f"the sheet draws 2-D or 3-D grids, got {grid.ndim} axes", code="U074")


def sheet(
    cmp: Comparison,
    out: str | Path,
    *,
    title: str = "",
    scale: int = 8,
) -> Path:
    """Write the side-by-side PNG: model alone, under the constraints, and where they differ (the
    differing cells coloured by the constraint that decided them, grey where none did)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    vocab = cmp.vocab or int(max(cmp.alone.max(), cmp.constrained.max(), 0)) + 1
    pal = _palette(vocab)

    def rgb(grid: np.ndarray) -> np.ndarray:
        return pal[np.where((grid >= 0) & (grid < vocab), grid, vocab)]

    rows_a, rows_c = _frames(cmp.alone), _frames(cmp.constrained)
    differ = _frames(cmp.differ)
    decided = {k: _frames(v) for k, v in cmp.decided.items()}
    n = len(rows_a)
    h, w = rows_a[0].shape
    fig, axes = plt.subplots(
        3, n, figsize=(max(n * w * scale / 100, 4), 3 * h * scale / 100 + 1.2), squeeze=False
    )
    legend = []
    for t in range(n):
        faded = (rgb(rows_c[t]).astype(np.float32) * 0.25 + 160).astype(np.uint8)
        marks = np.where(differ[t][..., None], np.uint8(110), faded)
        for frames, colour in zip(decided.values(), DECIDED_COLOURS):
            m = frames[t] & differ[t]
            marks[m] = colour
        for r, img in enumerate((rgb(rows_a[t]), rgb(rows_c[t]), marks)):
            ax = axes[r][t]
            ax.imshow(img, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"t = {t}", fontsize=9)
        if t == 0:
            axes[0][0].set_ylabel(f"{cmp.labels[0]}", fontsize=9)
            axes[1][0].set_ylabel(f"{cmp.labels[1]}", fontsize=9)
            axes[2][0].set_ylabel("differ", fontsize=9)
    for (name, _), colour in zip(decided.items(), DECIDED_COLOURS):
        rgb01 = (colour[0] / 255, colour[1] / 255, colour[2] / 255)
        legend.append(Patch(color=rgb01, label=f"differs; decided by {name}"))
    legend.append(Patch(color=(110 / 255,) * 3, label="differs; no constraint here"))
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def text_lines(cmp: Comparison, marks: Sequence[str] = "^~*+") -> list[str]:
    """A byte value of both runs as two lines, with a line of marks under the constrained one:
    the first letter of each constraint's mark under the bytes it decided."""

    def show(arr: np.ndarray) -> str:
        return "".join(chr(b) if 32 <= b < 127 else ("·" if b < 0 else "?") for b in arr.tolist())

    a, c = show(cmp.alone.reshape(-1)), show(cmp.constrained.reshape(-1))
    under = [" "] * len(c)
    for (_, mask), m in zip(cmp.decided.items(), marks):
        for i in np.flatnonzero(mask.reshape(-1)):
            under[i] = m
    return [a, c, "".join(under).rstrip()]


def legend_of(cmp: Comparison, marks: Sequence[str] = "^~*+") -> Mapping[str, str]:
    return {name: m for name, m in zip(cmp.decided, marks)}
