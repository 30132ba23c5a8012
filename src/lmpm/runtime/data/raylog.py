"""Ray's alarm about a dead worker, kept off the user's terminal when LMPM handles the death.

When a worker process dies mid-task, the raylet publishes an error to the driver, and Ray's driver
prints it from a background thread (``ray._private.worker.listen_error_messages``): a paragraph
starting "A worker died or was killed while executing a task by an unexpected system error" that
points at OOM killers and dmesg. LMPM supervises its workers itself: it replaces the dead one,
redoes the epoch and says so in one line (and in ``lmpm trace``), or fails with its own error
naming the worker. Ray (2.x) has no setting for that thread, so :func:`quiet_worker_deaths` wraps
the function it prints through, dropping that one message and passing every other one on.

The dropped messages are kept (:data:`DROPPED`, the latest few) for anyone who needs Ray's words.
"""

from __future__ import annotations

from collections import deque
from typing import Any

# The start of the raylet's message for a worker that died while running a task (ray 2.x).
WORKER_DIED = "A worker died or was killed while executing a task by an unexpected system error"
DROPPED: deque[str] = deque(maxlen=16)  # the latest messages kept off the terminal


def handled(data: dict[str, Any]) -> bool:
    """Whether a message Ray's driver is about to print is the dead-worker alarm LMPM handles."""
    lines = data.get("lines") or []
    return data.get("pid") == "raylet" and any(WORKER_DIED in str(line) for line in lines)


def quiet_worker_deaths() -> None:
    """Keep the raylet's dead-worker alarm off the terminal (idempotent; call after ray.init)."""
    from ray._private import worker as ray_worker

    printer = ray_worker.print_to_stdstream
    if getattr(printer, "lmpm_quiet", False):
        return

    def print_to_stdstream(data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if handled(data):
            DROPPED.extend(str(line) for line in data.get("lines") or [])
            return
        printer(data, *args, **kwargs)

    print_to_stdstream.lmpm_quiet = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream
