"""The CPU backend: computes at dispatch, so ``collect`` only hands back what is already there.

With ``threads > 1``, independent groups (``WorkItem.group``) run as tasks of a thread pool; dispatch
then returns once they are submitted and ``collect`` waits for its own tasks. torch releases the GIL
inside its kernels, so groups overlap; mind that each task also uses torch's intra-op threads
(``torch.set_num_threads``).

Example:
    >>> import torch
    >>> from lmpm.workers.cpu import CpuBackend
    >>> be = CpuBackend()
    >>> be.put("emb", torch.arange(6.0).reshape(3, 2))
    >>> be.update("emb", torch.tensor([1]), torch.tensor([[9.0, 9.0]]))
    >>> be.get("emb")[1].tolist()
    [9.0, 9.0]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import LmpmError, UsageError
from lmpm.workers.base import GroupResult, Handle, Ref, Results, Work, WorkItem
from lmpm.workers.batch import BatchedCall, as_items, batch_items, execute, raise_if_bad

__all__ = ["CpuBackend", "make_backend"]


@dataclass(slots=True)
class _CpuState:
    # Either finished outputs (inline) or futures of pool tasks; each yields a list of GroupResults.
    done: list[GroupResult] = field(default_factory=list)
    futures: list[Future[list[GroupResult]]] = field(default_factory=list)
    error: LmpmError | None = None
    n_items: int = 0


def resolve_refs(
    items: Sequence[WorkItem], store: dict[str, Tensor], device: torch.device
) -> tuple[tuple[WorkItem, ...], set[str]]:
    """Replace :class:`Ref` inputs by (gathered) resident tensors; returns the keys read."""
    read: set[str] = set()
    out: list[WorkItem] = []
    for item in items:
        if not any(issubclass(kind, Ref) for kind in set(map(type, item.inputs.values()))):
            out.append(item)  # (the inputs' few distinct types looked at: no Ref among them)
            continue
        inputs: dict[str, Tensor | Ref] = {}
        for name, v in item.inputs.items():
            if isinstance(v, Ref):
                if v.key not in store:
                    raise UsageError(
                        f"rule '{item.rule}': input '{name}' refers to resident tensor '{v.key}', "
                        f"which was never put; resident keys: {sorted(store)}"
                    )
                read.add(v.key)
                t = store[v.key]
                inputs[name] = t if v.index is None else t[v.index.to(device)]
            else:
                inputs[name] = v
        out.append(replace(item, inputs=inputs))
    return tuple(out), read


class CpuBackend:
    """Eager CPU worker. ``worker`` names it in errors; ``threads`` > 1 enables the group pool."""

    name = "cpu"

    def __init__(self, *, worker: str = "cpu:0", threads: int = 1) -> None:
        if threads < 1:
            raise UsageError(f"threads must be >= 1, got {threads}")
        self.worker = worker
        self.device = torch.device("cpu")
        self._store: dict[str, Tensor] = {}
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="lmpm-cpu") if threads > 1 else None
        )
        # Pool tasks that read a resident tensor; update() waits for them (write after read).
        self._readers: dict[str, list[Future[list[GroupResult]]]] = {}
        self._ids = itertools.count()

    def _run(self, calls: Sequence[BatchedCall]) -> list[GroupResult]:
        out = []
        for call in calls:
            result, bad = execute(call, backend=self.name, worker=self.worker)
            raise_if_bad(result, bad, backend=self.name, worker=self.worker)
            out.append(result)
        return out

    def dispatch(self, work: Work) -> Handle:
        items, read = resolve_refs(as_items(work), self._store, self.device)
        calls = batch_items(items, device=self.device)
        state = _CpuState(n_items=len(items))
        by_group: dict[str | None, list[BatchedCall]] = {}
        pool = self._pool
        if pool is not None and len(calls) > 1:  # (groups run as tasks of the pool)
            for call in calls:
                by_group.setdefault(call.group, []).append(call)
        if pool is not None and len(by_group) > 1:
            state.futures = [pool.submit(self._run, group) for group in by_group.values()]
            for key in read:
                pending = [f for f in self._readers.get(key, []) if not f.done()]
                self._readers[key] = pending + state.futures
        else:
            try:
                state.done = self._run(calls)
            except LmpmError as e:  # model faults surface in collect, as on every backend
                state.error = e
        return Handle(self.name, self.worker, next(self._ids), len(items), state)

    def _state(self, handle: Handle) -> _CpuState:
        if handle.backend != self.name or not isinstance(handle.state, _CpuState):
            raise UsageError(
                f"handle {handle.id} belongs to backend '{handle.backend}', not '{self.name}'"
            )
        return handle.state

    def ready(self, handle: Handle) -> bool:
        return all(f.done() for f in self._state(handle).futures)

    def collect(self, handle: Handle) -> Results:
        state = self._state(handle)
        if state.futures:
            futures, state.futures = state.futures, []
            for f in futures:
                try:
                    state.done.extend(f.result())
                except LmpmError as e:
                    state.error = state.error or e
        if state.error is not None:
            raise state.error
        return Results(state.done, state.n_items)

    def put(self, key: str, tensor: Tensor) -> None:
        self._store[key] = tensor.detach().to(self.device, copy=True)

    def get(self, key: str) -> Tensor:
        try:
            return self._store[key]
        except KeyError:
            raise UsageError(
                f"no resident tensor '{key}'; resident keys: {sorted(self._store)}"
            ) from None

    def update(self, key: str, index: Tensor, values: Tensor) -> None:
        target = self.get(key)
        self._wait_readers(key)
        # index_put_ writes into the existing storage: views handed out by get() see the update.
        if values.dtype != target.dtype or values.device != target.device:
            values = values.to(target.device, target.dtype)
        if index.device != target.device:
            index = index.to(target.device)
        target.index_put_((index,), values)

    def delete(self, key: str) -> None:
        self._wait_readers(key)
        self._store.pop(key, None)

    def _wait_readers(self, key: str) -> None:
        for f in self._readers.pop(key, []):
            f.exception()  # wait; the fault itself is reported by collect

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"CpuBackend(worker={self.worker!r}, resident={sorted(self._store)})"


def make_backend(**opts: Any) -> CpuBackend:
    """Factory found by :func:`lmpm.workers.get_backend` (naming convention: module ``cpu``)."""
    return CpuBackend(**opts)
