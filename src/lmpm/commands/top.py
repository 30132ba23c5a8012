"""`lmpm top RUN_DIR`: a live view of a training run (status, workers, loss curve, throughput,
faults), read from its training log (``RUN_DIR/train.db``) every ``--interval`` seconds.

It follows the run until its status leaves ``running`` (then leaves the final frame on the screen
and exits 0), or until Ctrl-C (exit 0). Plain terminal output, no mouse or alternate screen, so it
works over SSH. With ``--once``, or when stdout is not a terminal, it prints one frame and exits;
``--follow`` keeps reading a piped run to its end and prints the final frame.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from lmpm.errors import LmpmError, UsageError

if TYPE_CHECKING:
    from lmpm.train.log import TrainHistory

HELP = "watch a training run: status, workers, loss curve, throughput, faults (live)"

READ_RETRIES = 5  # consecutive failed reads of a live log before giving up


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of a training run")
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1)",
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument(
        "--follow",
        action="store_true",
        help="follow the run to its end even when stdout is not a terminal (prints the last frame)",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from lmpm.train.dashboard import frame
    from lmpm.train.log import read
    from lmpm.train.log import status as run_status

    if not args.interval > 0:
        raise UsageError(
            f"--interval {args.interval}: give a positive number of seconds", code="U050"
        )
    console = Console(highlight=False)
    history = _shown(read(args.run_dir))
    if args.once or not (console.is_terminal or args.follow):
        console.print(frame(history, width=console.width, now=time.time()))
        return 0
    failures = 0
    try:
        with Live(
            frame(history, width=console.width, now=time.time()),
            console=console,
            auto_refresh=False,
            transient=False,  # the final frame stays on the screen
        ) as live:
            while run_status(history.meta) == "running":
                time.sleep(args.interval)
                try:
                    history = _shown(read(args.run_dir))
                    failures = 0
                except LmpmError:  # a log being checkpointed or rewritten: try again
                    failures += 1
                    if failures >= READ_RETRIES:
                        raise
                    continue
                live.update(frame(history, width=console.width, now=time.time()), refresh=True)
    except KeyboardInterrupt:
        return 0
    return 0


def _shown(history: TrainHistory) -> TrainHistory:
    """``history`` with every string from the log printable and markup-escaped: the dashboard
    prints worker names, fault causes and constraint names it read (docs/security.md)."""
    from lmpm.printable import printable_tree

    shown = {f.name: printable_tree(getattr(history, f.name), markup=True) for f in fields(history)}
    return replace(history, **shown)
