"""CUDA graphs for LMPM's per-step work: capture once, replay each step, read flags late.

A step of the token-stream VM (or of a compiled epoch) is tens of small kernels; launched one by
one from Python each costs microseconds of host time whatever its size, so the host, not the GPU,
sets the pace. Captured into a CUDA graph, the whole step is one launch (a few µs), as gpt-fast's
decode step is. Two things make a step capturable, and the callers keep to them:

- **static buffers**: a graph reads and writes fixed addresses. The caller runs its step on the
  buffers :func:`capture` was given and copies in only what changed; what the step returns lives in
  buffers the graph owns, overwritten by the next replay (the caller copies out what must outlive
  the step);
- **no host synchronisation inside**: no value read back, no data-dependent size. What the host
  must know after a step (is every stream done, does a tool wait) goes to a pinned host buffer by
  an asynchronous copy after the replay and is read by :class:`LateFlags` once the GPU got there.

On the simulated device (:mod:`lmpm.workers.simcuda`) there is no graph to capture: :func:`capture`
runs the body once and each replay runs it again, writing into the first run's outputs, so the
callers' buffer discipline is exercised on a CPU (the body runs on static buffers and its outputs
stay where the first run put them). A real capture runs nothing, so the simulated one puts back
what its first run wrote (``keep``), and it refuses what a real capture refuses: a body that reads
a value on the host, makes a data-dependent size or copies to or from the host (a real capture
fails on it, or records a graph that replays stale values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lmpm.workers import simcuda

Body = Callable[[], Sequence[Tensor]]


class NotCapturable(RuntimeError):
    """The body waits for the device or makes a data-dependent size (the simulated capture's
    verdict; a real capture fails on the same body)."""


def capture(
    body: Body,
    *,
    warmup: Callable[[], object] | None = None,
    keep: Sequence[Tensor] = (),
) -> tuple[Sequence[Tensor], Callable[[], None]]:
    """Capture ``body`` (a function of static buffers returning tensors) as one CUDA graph.

    ``warmup`` runs first, on a side stream, so that lazy initialisation (cuBLAS handles, Triton
    autotuning, the allocator's first blocks) does not land in the graph; it must not touch the
    state the body reads (run it on copies). ``keep``: tensors the body writes in place that must
    not change by capturing (a real capture runs nothing; the simulated one runs the body and puts
    them back). Returns the body's outputs — the graph's static output buffers — and
    ``replay()``, which reruns the whole body with one launch."""
    sim = simcuda.active()
    if sim is not None:
        saved = [t.clone() for t in keep]
        before = len(sim.warnings)
        outs = list(body())
        waits = sim.warnings[before:]
        if waits:
            raise NotCapturable(
                "the step cannot be captured as a CUDA graph: "
                + "; ".join(f"{w.op} at {w.where()}" for w in waits[:3])
            )
        for t, old in zip(keep, saved):
            t.copy_(old)

        def replay_simulated() -> None:
            for static, new in zip(outs, body()):
                static.copy_(new)

        return outs, replay_simulated
    if warmup is not None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warmup()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = list(body())
    return outs, graph.replay


class LateFlags:
    """Small int64 flags a replayed step leaves on the device, read on the host without waiting.

    ``device_flags`` is the graph's static output buffer of the flags. :meth:`mark` (after each
    replay) copies it to a pinned host buffer asynchronously and records an event (the copy is
    outside the graph: a copy to host memory inside a capture depends on the host allocator's
    bookkeeping, which PyTorch does not promise to capture). :meth:`read` returns the flags of the
    newest step the GPU has finished, never blocking, unless the host has run ``lag`` steps ahead
    of the last flags it saw: then it waits for the newest step. So the host learns of a change
    (a stream done, a tool waiting) at most ``lag`` steps late and never syncs per step. Flags
    that only ever turn on and that the caller may act on late (finishing, tool calls) are what
    this is for: acting a few steps late must change when, not what, is committed."""

    def __init__(self, device_flags: Tensor, *, lag: int = 8) -> None:
        self.device_flags = device_flags
        self.lag = lag
        self.host = torch.zeros(device_flags.shape, dtype=device_flags.dtype).pin_memory()
        self.seen: list[int] = [0] * device_flags.numel()  # the newest flags read
        self.behind = 0  # steps marked since they were read
        self.waits = 0  # reads that had to wait for the GPU
        self._event: torch.cuda.Event | None = None

    def reset(self) -> None:
        """Forget what was read (a new owner of the graph: its streams start anew)."""
        self.seen = [0] * len(self.seen)
        self.behind = 0
        self._event = None

    def mark(self) -> None:
        """After a replay: this step's flags on their way to the host, and an event after them."""
        self.host.copy_(self.device_flags, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._event = ev
        self.behind += 1

    def read(self) -> list[int]:
        """The newest flags the GPU has written (waiting only when ``lag`` steps behind)."""
        ev = self._event
        if ev is None or self.behind == 0:
            return self.seen
        if not ev.query():
            if self.behind < self.lag:
                return self.seen
            ev.synchronize()
            self.waits += 1
        self.seen = self.host.tolist()
        self.behind = 0
        return self.seen
