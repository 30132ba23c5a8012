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

:func:`count_host` counts what the host does around the replays (torch calls, launches, copies,
waits), the replayed body -- device work -- left out: the host-cost budget tests hold a driver to
it on a CPU.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lmpm.workers import simcuda

Body = Callable[[], Sequence[Tensor]]


@dataclass
class HostCost:
    """What the host did inside :func:`count_host`, device work (a replayed body) left out."""

    calls: int = 0  # Python-level torch calls: functions and tensor methods
    launches: int = 0  # graph replays
    copies: int = 0  # copies between the host and the device
    waits: int = 0  # the host waited for the device: a device value read, LateFlags waiting
    by_name: Counter[str] = field(default_factory=Counter)  # calls by function name
    device_work: int = 0  # > 0 while a replay runs (its calls are the device's)


_COST: list[HostCost] = []  # the innermost count_host() block's, if any

# Tensor methods that read a device tensor's value on the host (the host waits for the device).
_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__"}


def _on_device(x: Any) -> bool:
    return isinstance(x, Tensor) and x.device.type == "cuda"


class _CountMode(TorchFunctionMode):
    def __init__(self, cost: HostCost) -> None:
        super().__init__()
        self.cost = cost

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        cost = self.cost
        if cost.device_work == 0:
            # (under inference mode a tensor method on the simulated device arrives as its aten
            # overload: `.cpu()` as `_to_copy.default`)
            name = getattr(func, "__name__", str(func))
            cost.calls += 1
            cost.by_name[name] += 1
            if name == "copy_" and len(args) > 1 and _on_device(args[0]) != _on_device(args[1]):
                cost.copies += 1
            elif name in ("to", "cuda", "cpu", "_to_copy.default") and args:
                out = func(*args, **kwargs)
                if _on_device(out) != _on_device(args[0]):
                    cost.copies += 1
                    cost.waits += not _on_device(out)  # a copy to the host waits for it
                return out
            elif name in _READS and args and _on_device(args[0]):
                cost.waits += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host() -> Iterator[HostCost]:
    """Count the host's torch calls, graph launches, host-device copies and waits in a block
    (on the simulated device: a replay's body is device work, not counted).

    >>> import torch
    >>> with count_host() as cost:
    ...     x = torch.zeros(3) + 1
    >>> cost.calls, cost.launches
    (2, 0)
    """
    cost = HostCost()
    _COST.append(cost)
    try:
        with _CountMode(cost):
            yield cost
    finally:
        _COST.pop()


def _launched() -> HostCost | None:
    """A replay starts: count it (the innermost :func:`count_host` block's, if any)."""
    if not _COST:
        return None
    cost = _COST[-1]
    cost.launches += 1
    return cost


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
            cost = _launched()
            if cost is not None:
                cost.device_work += 1
            try:
                for static, new in zip(outs, body()):
                    static.copy_(new)
            finally:
                if cost is not None:
                    cost.device_work -= 1

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

    def replay() -> None:
        _launched()
        graph.replay()

    return outs, replay


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
            if _COST:
                _COST[-1].waits += 1
        self.seen = self.host.tolist()
        self.behind = 0
        return self.seen
