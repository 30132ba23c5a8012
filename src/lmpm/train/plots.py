"""Pictures of a training run for ``lmpm render``: the loss curve (``loss.png``).

The train loss of every inner step (the workers' mean) is a line over the inner step; the eval
loss of each committed epoch is a marker at the epoch's last inner step; dotted vertical lines mark
the epoch boundaries (outer steps) when there are few enough of them to read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmpm.train.dashboard import is_finite, policy_text
from lmpm.train.log import TrainHistory
from lmpm.train.units import UNIT, bits

MAX_EPOCH_LINES = 40  # more outer steps than this: no boundary lines (they would fill the plot)


def plot_loss(history: TrainHistory, path: str | Path) -> Path:
    """Write the loss curve of ``history`` to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    steps = [(s, e, y) for s, e, y in history.steps if is_finite(y)]
    last_step: dict[int, int] = {}  # epoch → its last inner step
    for s, e, _ in history.steps:
        last_step[e] = s
    evals = [
        (last_step[r["epoch"]], r["eval_loss"])
        for r in history.epochs
        if is_finite(r["eval_loss"]) and r["epoch"] in last_step
    ]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if steps:
        ax.plot(
            [s for s, _, _ in steps], [bits(y) for _, _, y in steps], lw=1.2, label="train loss"
        )
    if evals:
        ax.plot(
            [s for s, _ in evals],
            [bits(y) for _, y in evals],
            ls="none",
            marker="o",
            ms=5,
            color="tab:red",
            label="eval loss (per epoch)",
        )
    if 1 < len(last_step) <= MAX_EPOCH_LINES:
        for s in sorted(last_step.values())[:-1]:
            ax.axvline(s + 0.5, color="0.85", lw=0.8, ls=":", zorder=0)
    if not steps and not evals:
        ax.text(0.5, 0.5, "no epochs logged yet", ha="center", va="center", transform=ax.transAxes)
    meta = history.meta
    status = meta.get("status", "?")
    ax.set_title(f"{meta.get('program', '?')} · {policy_text(meta)} · {status}", fontsize=10)
    ax.set_xlabel("inner step")
    ax.set_ylabel(f"loss ({UNIT})")
    if steps or evals:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, Path(path))
    plt.close(fig)
    return path


def save_figure(fig: Any, path: Path, **options: Any) -> None:
    """A figure in ``path``'s format (PNG by default), written beside and renamed (no link at
    ``path`` is written through); ``options`` go to ``savefig``."""
    import io

    from lmpm.runtime.lock import atomic_write

    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".").lower() or "png", **options)
    atomic_write(path, buf.getvalue())
