"""The CUDA backend: ``dispatch`` enqueues, ``collect`` blocks on exactly the events it needs.

Each independent group (``WorkItem.group``) gets its own CUDA stream, so groups overlap on the device.
Per group, dispatch

1. makes the group's stream wait (on the device, not the host) for the current stream, so it sees
   resident tensors written by :meth:`CudaBackend.update` and tensors the caller produced;
2. concatenates the items' host inputs on the host, copies them into pinned memory and then to the
   device with ``non_blocking=True`` — one copy per input name per call, overlapping compute;
3. calls the model (kernels are queued, nothing is read back: output validation is a per-row
   bitmask computed on the device);
4. with ``results_to_host`` (default), queues device-to-host copies into pinned buffers;
5. records an event on the stream.

``collect(handle)`` synchronizes that handle's events only — never the whole device — then checks
the validation bitmasks and raises :class:`~lmpm.errors.ModelError` for a fault.

Resident tensors live on the device; ``update`` scatters in place on the current stream after
waiting (device-side) for every dispatched group still reading that tensor.

Constructing the backend without a GPU raises :class:`~lmpm.errors.BackendUnavailable`:

    >>> import torch
    >>> from lmpm.errors import BackendUnavailable
    >>> from lmpm.workers import get_backend
    >>> try:
    ...     be = get_backend("cuda")
    ... except BackendUnavailable:
    ...     be = get_backend("cpu")
    >>> be.name in ("cpu", "cuda")
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import BackendUnavailable, LmpmError, ModelError, UsageError
from lmpm.workers.base import GroupResult, Handle, Results, Work, WorkItem
from lmpm.workers.batch import as_items, batch_items, execute, first_cells, raise_if_bad
from lmpm.workers.cpu import resolve_refs

__all__ = ["MSG_NO_CUDA", "CudaBackend", "make_backend"]

MSG_NO_CUDA = (
    "the CUDA backend needs a CUDA device, but torch.cuda.is_available() is False "
    "(torch {version}, built with CUDA {cuda})"
)
HINT_NO_CUDA = (
    "use get_backend('cpu'), or run on a machine with an NVIDIA GPU and a CUDA build of torch"
)


@dataclass(slots=True)
class _Pending:
    """One group's queued work: the event after its last op, and what must outlive the copies."""

    event: torch.cuda.Event
    outputs: list[tuple[GroupResult, Tensor]]  # (result, fault bitmask) per batched call
    keep_alive: list[Tensor] = field(default_factory=list)  # pinned staging buffers


@dataclass(slots=True)
class _CudaState:
    pending: list[_Pending] = field(default_factory=list)
    error: LmpmError | None = None
    n_items: int = 0
    rules: tuple[str, ...] = ()
    cells: Tensor | None = None  # host cell ids, for attributing asynchronous device faults


def _pinned_copy_of(t: Tensor) -> Tensor:
    """A pinned host copy of ``t`` (device → host, queued on the current stream)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class CudaBackend:
    """CUDA worker on ``device``; ``results_to_host=False`` keeps results on the device."""

    name = "cuda"

    def __init__(
        self,
        *,
        device: int | str | torch.device = 0,
        worker: str | None = None,
        results_to_host: bool = True,
    ) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                MSG_NO_CUDA.format(version=torch.__version__, cuda=torch.version.cuda),
                hint=HINT_NO_CUDA,
            )
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise UsageError(f"the CUDA backend needs a cuda device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.worker = worker or str(dev)
        self.results_to_host = results_to_host
        self._streams: dict[str | None, torch.cuda.Stream] = {}
        self._store: dict[str, Tensor] = {}
        # Events after the last dispatched group reading a resident key (write-after-read guard).
        self._readers: dict[str, list[torch.cuda.Event]] = {}
        self._ids = itertools.count()

    def _stream(self, group: str | None) -> torch.cuda.Stream:
        stream = self._streams.get(group)
        if stream is None:
            stream = self._streams[group] = torch.cuda.Stream(device=self.device)
        return stream

    def dispatch(self, work: Work) -> Handle:
        items, read = resolve_refs(as_items(work), self._store, self.device)
        state = _CudaState(n_items=len(items))
        state.rules = tuple(dict.fromkeys(it.rule for it in items))
        by_group: dict[str | None, list[int]] = {}
        for i, item in enumerate(items):
            by_group.setdefault(item.group, []).append(i)
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            for group, ids in by_group.items():
                stream = self._stream(group)
                stream.wait_stream(current)  # device-side wait; the host does not block
                pending = self._enqueue(stream, [items[i] for i in ids], ids, read, state)
                state.pending.append(pending)
                for key in read:
                    # Forget readers that already finished (query() never blocks).
                    live = [e for e in self._readers.get(key, []) if not e.query()]
                    self._readers[key] = [*live, pending.event]
                if state.error is not None:
                    break  # a host-detected fault: queue nothing more, report it at collect
        return Handle(self.name, self.worker, next(self._ids), len(items), state)

    def _enqueue(
        self,
        stream: torch.cuda.Stream,
        items: Sequence[WorkItem],
        ids: Sequence[int],
        read: set[str],
        state: _CudaState,
    ) -> _Pending:
        keep: list[Tensor] = []

        def h2d(t: Tensor) -> Tensor:
            if t.device.type != "cpu":
                return t.to(self.device, non_blocking=True)
            pinned = t if t.is_pinned() else t.pin_memory()
            keep.append(pinned)
            return pinned.to(self.device, non_blocking=True)

        for key in read:
            # The resident tensor was allocated on another stream: tell the caching allocator that
            # this stream uses it, so a delete() cannot recycle the memory under a running kernel.
            self._store[key].record_stream(stream)
        for item in items:
            for t in item.inputs.values():
                if isinstance(t, Tensor) and t.is_cuda:
                    t.record_stream(stream)
        outputs: list[tuple[GroupResult, Tensor]] = []
        with torch.cuda.stream(stream):
            calls = batch_items(items, device=self.device, transfer=h2d)
            for call in calls:
                call = replace(call, item_ids=tuple(ids[j] for j in call.item_ids))
                try:
                    result, bad = execute(call, backend=self.name, worker=self.worker)
                except LmpmError as e:
                    state.error = e
                    break
                if self.results_to_host:
                    result = replace(
                        result,
                        cells=_pinned_copy_of(result.cells),
                        proposal=_pinned_copy_of(result.proposal),
                        score=_pinned_copy_of(result.score),
                        aux={k: _pinned_copy_of(v) for k, v in result.aux.items()},
                    )
                    bad = _pinned_copy_of(bad)
                outputs.append((result, bad))
            event = torch.cuda.Event()
            event.record(stream)
        return _Pending(event, outputs, keep)

    def _state(self, handle: Handle) -> _CudaState:
        if handle.backend != self.name or not isinstance(handle.state, _CudaState):
            raise UsageError(
                f"handle {handle.id} belongs to backend '{handle.backend}', not '{self.name}'"
            )
        return handle.state

    def ready(self, handle: Handle) -> bool:
        return all(p.event.query() for p in self._state(handle).pending)

    def collect(self, handle: Handle) -> Results:
        state = self._state(handle)
        try:
            for p in state.pending:
                p.event.synchronize()  # this handle's work only; other streams keep running
        except RuntimeError as e:  # an asynchronous device fault (e.g. a device-side assert)
            cells = [first_cells(r.cells) for p in state.pending for r, _ in p.outputs]
            raise ModelError(
                f"a CUDA error surfaced while waiting for rules {list(state.rules)}: {e}",
                code="R058",
                where={
                    "rule": ",".join(state.rules),
                    "cells": cells[0] if cells else [],
                    "backend": self.name,
                    "worker": self.worker,
                },
            ) from e
        if state.error is not None:
            raise state.error
        results: list[GroupResult] = []
        current = torch.cuda.current_stream(self.device)
        for p in state.pending:
            p.keep_alive.clear()
            for result, bad in p.outputs:
                raise_if_bad(result, bad, backend=self.name, worker=self.worker)
                if not self.results_to_host:
                    # Outputs were allocated on a side stream and are now used on the caller's.
                    for t in (result.cells, result.proposal, result.score, *result.aux.values()):
                        t.record_stream(current)
                results.append(result)
        return Results(results, state.n_items)

    def put(self, key: str, tensor: Tensor) -> None:
        src = tensor.detach()
        if src.device.type == "cpu":
            src = src.pin_memory()
        with torch.cuda.device(self.device):
            self._store[key] = src.to(self.device, non_blocking=True, copy=True)

    def get(self, key: str) -> Tensor:
        try:
            return self._store[key]
        except KeyError:
            raise UsageError(
                f"no resident tensor '{key}'; resident keys: {sorted(self._store)}"
            ) from None

    def update(self, key: str, index: Tensor, values: Tensor) -> None:
        target = self.get(key)
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            for event in self._readers.pop(key, []):
                current.wait_event(event)  # device-side: queued reads finish before the write
            vals = values.detach()
            if vals.device.type == "cpu":
                vals = vals.pin_memory()
            idx = index.pin_memory() if index.device.type == "cpu" else index
            target.index_put_(
                (idx.to(self.device, non_blocking=True),),
                vals.to(self.device, target.dtype, non_blocking=True),
            )

    def delete(self, key: str) -> None:
        self._readers.pop(key, None)  # record_stream already keeps the memory safe
        self._store.pop(key, None)

    def close(self) -> None:
        self._streams.clear()

    def __repr__(self) -> str:
        return f"CudaBackend(device={self.device}, worker={self.worker!r}, resident={sorted(self._store)})"


def make_backend(**opts: Any) -> CudaBackend:
    """Factory found by :func:`lmpm.workers.get_backend` (naming convention: module ``cuda``)."""
    return CudaBackend(**opts)
