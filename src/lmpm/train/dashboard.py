"""The frames of ``lmpm top``: one pure function from a :class:`TrainHistory` to a rich renderable.

A frame has five parts: the run's status, the workers table, the loss history (a braille plot of
the train loss per inner step, the per-epoch eval loss as ``●`` markers), throughput, and the last
faults and constraint actions. Nothing here reads a terminal or a clock, so a frame renders the same
way in a test (``Console(record=True, width=100)``) as over SSH.

>>> import io
>>> from rich.console import Console
>>> h = TrainHistory(meta={"kind": "train", "program": "t.lmpm", "status": "running"}, epochs=[],
...                  workers=[], worker_epochs=[], steps=[], constraints=[], faults=[],
...                  checkpoints=[])
>>> c = Console(record=True, width=80, file=io.StringIO())
>>> c.print(frame(h, width=80, now=0.0))
>>> "waiting for the first epoch" in c.export_text()
True
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from lmpm.train.log import TrainHistory
from lmpm.train.log import status as run_status
from lmpm.train.units import UNIT, bits, fmt

GRAPH_HEIGHT = 10  # rows of the loss plot (each row is 4 braille dots high)
FAULT_ROWS = 4  # the last worker_faults rows shown
WORKER_ROWS = 16  # workers shown (those not ready first); the rest are counted
HEALTHY = ("ready", "running", "training", "idle", "done")  # worker states listed after the others
STATUS_STYLE = {
    "running": "bold cyan",
    "finished": "bold green",
    "failed": "bold red",
    "stopped": "bold red",
}
TRAIN_STYLE = "cyan"
EVAL_STYLE = "bold magenta"
EVAL_MARK = "●"

# The dot bit of each (column, row) of a braille cell (U+2800 + bits): 2 columns × 4 rows.
_BRAILLE = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


def frame(history: TrainHistory, *, width: int = 100, now: float | None = None) -> RenderableType:
    """One dashboard frame, ``width`` columns wide. ``now`` (a ``time.time()``) is the end of the
    elapsed time while the run is running; a run that ended uses its ``finished`` time."""
    top = Table.grid(expand=True, padding=(0, 1))
    top.add_column(ratio=1)
    top.add_column(ratio=1)
    top.add_row(
        Panel(_status(history, now), title="status", title_align="left"),
        Panel(_throughput(history), title="throughput", title_align="left"),
    )
    bottom = Table.grid(expand=True, padding=(0, 1))
    bottom.add_column(ratio=1)
    bottom.add_column(ratio=1)
    bottom.add_row(
        Panel(_faults(history), title="faults", title_align="left"),
        Panel(_constraints(history), title="constraints (last epoch)", title_align="left"),
    )
    graph_width = max(width - 4, 20)  # the panel's borders and padding
    return Group(
        top,
        Panel(_workers(history), title="workers", title_align="left"),
        Panel(_loss(history, graph_width), title="loss", title_align="left"),
        bottom,
    )


# ---- status ---------------------------------------------------------------------------------------


def _status(h: TrainHistory, now: float | None) -> RenderableType:
    m = h.meta
    status = run_status(m)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    program = str(m.get("program", "?"))
    if m.get("module"):
        program += f" ({m['module']})"
    grid.add_row("program", program)
    grid.add_row("status", Text(status, style=STATUS_STYLE.get(status, "bold yellow")))
    if status == "stopped":
        grid.add_row("", f"process {m.get('pid')} is gone: lmpm run --resume to continue")
    done = h.epochs[-1]["epoch"] if h.epochs else 0
    planned = m.get("epochs")
    grid.add_row("epoch", f"{done} / {planned}" if planned is not None else str(done))
    elapsed = _elapsed(m, now)
    grid.add_row("elapsed", duration(elapsed) if elapsed is not None else "?")
    kind, params = policy_parts(m)
    grid.add_row("policy", kind)
    if params:
        grid.add_row("", " ".join(params))
    inner = f"{m['steps']} inner steps" if m.get("steps") is not None else "?"
    if m.get("batch") is not None:
        inner += f", batch {m['batch']}"
    grid.add_row("H", inner)
    workers = str(_count(m.get("workers"), len(h.workers)))
    if m.get("driver"):
        workers += f" ({m['driver']} driver)"
    grid.add_row("workers", workers)
    if m.get("error"):
        grid.add_row("error", Text(str(m["error"]), style="red"))
    return grid


def _elapsed(meta: dict[str, Any], now: float | None) -> float | None:
    start = meta.get("created")
    end = meta.get("finished") if meta.get("status") != "running" else now
    if end is None:
        end = meta.get("updated")
    if not isinstance(start, int | float) or not isinstance(end, int | float):
        return None
    return max(float(end) - float(start), 0.0)


def _count(value: Any, fallback: int) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, list | tuple | dict):
        return len(value)
    return fallback


POLICY_ORDER = ("outer_lr", "momentum", "nesterov")  # the order parameters are shown in


def policy_text(meta: dict[str, Any]) -> str:
    """``diloco(outer_lr=0.7, momentum=0.9, nesterov)`` from the run's metadata: ``policy`` is a
    mapping with a ``kind`` (what :mod:`lmpm.train.run` writes) or a kind (its parameters then
    top-level keys). A true flag is its name; a false one is left out.

    >>> policy_text({"policy": {"kind": "diloco", "outer_lr": 0.7, "momentum": 0.9}})
    'diloco(outer_lr=0.7, momentum=0.9)'
    >>> policy_text({"policy": "average"})
    'average'
    """
    kind, params = policy_parts(meta)
    return f"{kind}({', '.join(params)})" if params else kind


def policy_parts(meta: dict[str, Any]) -> tuple[str, list[str]]:
    """(kind, ``["outer_lr=0.7", "momentum=0.9", "nesterov"]``) of the run's commit policy."""
    policy = meta.get("policy")
    if isinstance(policy, dict):
        kind = str(policy.get("kind", "?"))
        params = {k: v for k, v in policy.items() if k != "kind"}
    elif policy is None:
        return "?", []
    else:
        kind = str(policy)
        keys = POLICY_ORDER if kind == "diloco" else ()
        params = {k: meta[k] for k in keys if k in meta}
    ordered = [k for k in POLICY_ORDER if k in params] + sorted(set(params) - set(POLICY_ORDER))
    out = []
    for k in ordered:
        v = params[k]
        if isinstance(v, bool):
            if v:
                out.append(k)
        else:
            out.append(f"{k}={v}")
    return kind, out


# ---- workers ----------------------------------------------------------------------------------------


def _workers(h: TrainHistory) -> RenderableType:
    latest: dict[str, dict[str, Any]] = {}  # worker → its row of the latest epoch it reported
    tokens: dict[str, int] = {}
    for r in h.worker_epochs:  # ordered by epoch
        latest[r["worker"]] = r
        tokens[r["worker"]] = tokens.get(r["worker"], 0) + int(r["tokens"])
    live = {r["worker"]: r for r in h.workers}
    t = Table(expand=True, box=None, pad_edge=False, header_style="bold")
    for name in ("id", "backend", "host", "pid", "state", "restarts"):
        t.add_column(name)
    t.add_column("last loss", justify="right")
    t.add_column("tokens", justify="right")
    names = sorted(set(live) | set(latest))
    names.sort(key=lambda w: str(live.get(w, {}).get("state")) in HEALTHY)
    for w in names[:WORKER_ROWS]:
        row = live.get(w, {})
        state = str(row.get("state", "?"))
        last = latest.get(w)
        t.add_row(
            w,
            str(row.get("backend", "?")),
            str(row.get("host", "?")),
            str(row.get("pid", "?")),
            Text(state, style=_state_style(state)),
            str(row.get("restarts", "?")),
            fmt(last["last_loss"]) if last else "-",
            f"{tokens[w]:,}" if w in tokens else "-",
        )
    if not names:
        return Text("no workers yet", style="dim")
    if len(names) > WORKER_ROWS:
        return Group(t, Text(f"{len(names) - WORKER_ROWS} more workers", style="dim"))
    return t


def _state_style(state: str) -> str:
    if state in HEALTHY:
        return "green"
    if state in ("failed", "dead", "lost", "exited"):
        return "red"
    return "yellow"  # starting, restarting, ...


# ---- loss -------------------------------------------------------------------------------------------


def _loss(h: TrainHistory, width: int) -> RenderableType:
    if not h.steps:
        return Text("waiting for the first epoch", style="dim")
    finite = [(float(s), bits(float(y))) for s, _, y in h.steps if is_finite(y)]
    if not finite:
        return Text(f"no finite loss in {len(h.steps)} steps", style="red")
    xs = [x for x, _ in finite]
    ys = [y for _, y in finite]
    last_step: dict[int, int] = {}  # epoch → its last inner step (where its eval loss is drawn)
    for s, e, _ in h.steps:
        last_step[e] = s
    marks = [
        (float(last_step.get(r["epoch"], xs[-1])), bits(float(r["eval_loss"])))
        for r in h.epochs
        if is_finite(r["eval_loss"])
    ]
    lines = loss_plot(xs, ys, marks, width=width, height=GRAPH_HEIGHT)
    legend = Text.assemble(
        (f"⣀ train loss per inner step ({UNIT})", TRAIN_STYLE),
        ("   "),
        (f"{EVAL_MARK} eval loss per epoch", EVAL_STYLE) if marks else "",
    )
    return Group(*lines, legend)


def loss_plot(
    xs: Sequence[float],
    ys: Sequence[float],
    marks: Sequence[tuple[float, float]] = (),
    *,
    width: int = 80,
    height: int = GRAPH_HEIGHT,
) -> list[Text]:
    """A line plot of ``(xs, ys)`` in braille dots with ``marks`` as ``●``, ``width`` columns by
    ``height`` rows plus two rows of x axis; y-axis labels on the left (top, middle, bottom).

    >>> for t in loss_plot([1, 2, 3], [3.0, 2.0, 1.0], width=20, height=2):
    ...     print(t.plain.rstrip())
     3 ┤⠉⠑⠒⠤⠤⢄⣀
     1 ┤       ⠉⠉⠑⠒⠒⠤⠤⢄⣀
       └────────────────
       step 1          3
    """
    lo = min([*ys, *(y for _, y in marks)])
    hi = max([*ys, *(y for _, y in marks)])
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    x0, x1 = min(xs), max(xs)
    if x1 - x0 < 1e-12:
        x1 = x0 + 1.0
    labels = {0: _num(hi), height - 1: _num(lo)}
    if height >= 3:
        labels[(height - 1) // 2] = _num(hi - (hi - lo) * ((height - 1) // 2) / (height - 1))
    label_width = max(len(s) for s in labels.values()) + 1
    cols = max(width - label_width - 2, 4)  # label, " ", axis, plot
    dots_w, dots_h = 2 * cols, 4 * height

    def px(x: float) -> int:
        return round((x - x0) / (x1 - x0) * (dots_w - 1))

    def py(y: float) -> int:  # 0 is the top row of dots (the highest loss)
        return round((hi - y) / (hi - lo) * (dots_h - 1))

    cells = [[0] * cols for _ in range(height)]

    def dot(x: int, y: int) -> None:
        cells[y // 4][x // 2] |= _BRAILLE[x % 2][y % 4]

    points = [(px(x), py(y)) for x, y in zip(xs, ys, strict=True)]
    dot(*points[0])
    for (ax, ay), (bx, by) in itertools.pairwise(points):
        n = max(abs(bx - ax), abs(by - ay), 1)
        for i in range(1, n + 1):
            dot(ax + round((bx - ax) * i / n), ay + round((by - ay) * i / n))
    marked = {(py(y) // 4, px(x) // 2) for x, y in marks}

    out: list[Text] = []
    for r in range(height):
        line = Text(labels.get(r, "").rjust(label_width) + " " + ("┤" if r in labels else "│"))
        for c in range(cols):
            if (r, c) in marked:
                line.append(EVAL_MARK, style=EVAL_STYLE)
            else:
                line.append(chr(0x2800 + cells[r][c]) if cells[r][c] else " ", style=TRAIN_STYLE)
        out.append(line)
    out.append(Text(" " * label_width + " └" + "─" * cols))
    first, last = f"step {_num(x0)}", _num(x1)
    gap = max(cols + 1 - len(first) - len(last), 1)
    out.append(Text(" " * (label_width + 1) + first + " " * gap + last))
    return out


def _num(v: float) -> str:
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.4g}"


# ---- throughput -------------------------------------------------------------------------------------


def _throughput(h: TrainHistory) -> RenderableType:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    if not h.epochs:
        grid.add_row("tokens/s", "-")
        return grid
    last = h.epochs[-1]
    tokens = sum(int(r["tokens"]) for r in h.epochs)
    seconds = sum(float(r["seconds"]) for r in h.epochs)
    sent = sum(int(r["bytes"]) for r in h.epochs)
    grid.add_row(
        "tokens/s",
        f"last {_rate(last['tokens'], last['seconds'])} · mean {_rate(tokens, seconds)}",
    )
    grid.add_row(
        "epoch time",
        f"last {duration(last['seconds'])} · mean {duration(seconds / len(h.epochs))}",
    )
    grid.add_row("bytes sent", f"last {human_bytes(last['bytes'])} · total {human_bytes(sent)}")
    grid.add_row("tokens", f"{tokens:,}")
    loss = f"last {fmt(last['loss'])}"
    if last["eval_loss"] is not None:
        loss += f" · eval {fmt(last['eval_loss'])}"
    grid.add_row("loss", loss + " bits")
    return grid


def _rate(tokens: float, seconds: float) -> str:
    return f"{tokens / seconds:,.0f}" if seconds > 0 else "-"


def duration(seconds: float) -> str:
    """``0.42 s``, ``12.3 s``, ``3m 05s``, ``1h 02m``."""
    s = float(seconds)
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


# ---- faults and constraints -------------------------------------------------------------------------


def _faults(h: TrainHistory) -> RenderableType:
    if not h.faults:
        return Text("no faults", style="dim")
    t = Table(expand=True, box=None, pad_edge=False, header_style="bold")
    for name in ("epoch", "worker", "phase", "cause"):
        t.add_column(name)
    t.add_column("after", justify="right")
    for r in h.faults[-FAULT_ROWS:]:
        t.add_row(
            str(r["epoch"]),
            r["worker"],
            r["phase"],
            Text(r["cause"], style="red"),
            duration(r["seconds"]),
        )
    if len(h.faults) > FAULT_ROWS:
        return Group(t, Text(f"{len(h.faults)} faults in all", style="dim"))
    return t


def _constraints(h: TrainHistory) -> RenderableType:
    if not h.epochs:
        return Text("-", style="dim")
    epoch = h.epochs[-1]["epoch"]
    rows = [r for r in h.constraints if r["epoch"] == epoch]
    last = h.epochs[-1]
    summary = Text(
        f"{last['changed']} changed, {last['frozen']} frozen, "
        f"{last['projected']} projected, {last['rejected']} rejected",
        style="dim",
    )
    if not rows:
        return Group(Text("no constraints", style="dim"), summary)
    t = Table(expand=True, box=None, pad_edge=False, header_style="bold")
    t.add_column("name")
    t.add_column("kind")
    t.add_column("violations", justify="right")
    t.add_column("action")
    for r in rows:
        action = str(r["action"])
        t.add_row(
            r["name"],
            r["kind"],
            f"{r['violations']} / {r['checked']}",
            Text(action, style="dim" if action == "none" else "yellow"),
        )
    return Group(t, summary)


def is_finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
