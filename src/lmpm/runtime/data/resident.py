"""What a worker keeps where its payload lives: every value's payload and flags on its device, the
device copies of the plan's static tables, and this epoch's schedule (phase, RuleSet).

A :class:`Resident` is shared by the parts of a data plane (:mod:`lmpm.runtime.data.dataplane`):
the gather of model inputs (:mod:`lmpm.runtime.data.inputs`), the model calls
(:mod:`lmpm.runtime.data.calls`), the constraint checks (:mod:`lmpm.runtime.data.checks`) and the
candidate tables (:mod:`lmpm.runtime.data.candidates`). The data plane's own ``payload``,
``committed`` and ``from_input`` are these same dicts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lmpm.resolve.plan import Plan


def placed(fn: Any, device: torch.device) -> Any:
    """A bound model, score or predicate ready for a worker on ``device``: an ``nn.Module`` is
    moved there (in place, once per worker), an object with ``.to`` is replaced by
    ``fn.to(device)``; a plain function is called as it is, with its inputs on ``device``."""
    if isinstance(fn, torch.nn.Module):
        return fn.to(device)
    to = getattr(fn, "to", None)
    if callable(to) and not isinstance(fn, type):
        moved = to(device)
        return moved if callable(moved) else fn
    return fn


def ours(fn: Any) -> bool:
    """A callable (or module instance) defined in LMPM itself."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return module == "lmpm" or module.startswith("lmpm.")


class Resident:
    """A worker's resident state on ``device`` (see the module doc)."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self.host = device.type == "cpu"  # replies need no copy to the host
        self.payload: dict[str, Tensor] = {}
        self.committed: dict[str, Tensor] = {}
        self.from_input: dict[str, Tensor] = {}
        for name, vp in plan.values.items():
            self.payload[name] = torch.zeros(
                (vp.ncells, *vp.cell_shape), dtype=vp.dtype, device=device
            )
            self.committed[name] = torch.zeros(vp.ncells, dtype=torch.bool, device=device)
            self.from_input[name] = torch.zeros(vp.ncells, dtype=torch.bool, device=device)
        self.phase: dict[str, int | None] = {}  # this epoch's schedule phase per value
        self.active: frozenset[int] | None = None  # this epoch's RuleSet (None: all constraints)
        self._dev_cache: dict[int, tuple[Tensor, Tensor]] = {}
        self._row_cache: dict[tuple[Any, ...], Tensor] = {}  # see rows
        self._fill_cache: dict[tuple[str, tuple[int, ...]], Tensor] = {}

    def dev(self, t: Tensor) -> Tensor:
        """The device copy of a static plan table (made once; the CPU tensor itself on CPU)."""
        if self.host and t.device.type == "cpu":
            return t
        if t.device == self.device:
            return t
        hit = self._dev_cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self._dev_cache[id(t)] = (t, t.to(self.device))
        return hit[1]

    def ones(self, shape: tuple[int, int]) -> Tensor:
        """An all-True (n, C) mask, made once per shape. Replies share it: the control plane
        only reads replies (a user policy gets copies, lmpm.runtime.data.agree)."""
        return self.fill("ones", shape, torch.bool, True)

    def fill(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, value: Any) -> Tensor:
        """A filled tensor made once per (kind, shape): never written in place, never handed to
        user code as its own (predicates get copies)."""
        key = (kind, shape)
        hit = self._fill_cache.get(key)
        if hit is None:
            hit = torch.full(shape, value, dtype=dtype, device=self.device)
            self._fill_cache[key] = hit
        return hit

    def here(self, t: Tensor) -> Tensor:
        """A request's tensor on this worker's device, without waiting for the device: copied
        from pinned memory (PyTorch's caching host allocator keeps the block until the copy is
        done), since a copy from pageable memory may wait for the work queued before it."""
        if self.host or t.device.type != "cpu":
            return t if self.host else t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def meta(self, t: Tensor) -> Tensor:
        """A reply's metadata tensor on the host."""
        return t if self.host else t.cpu()

    def rows(self, table: Tensor, cells: Tensor, key: tuple[Any, ...] | None = None) -> Tensor:
        """``table[cells]`` for a static per-cell plan table. With a ``key`` naming the table and
        the schedule's phase, the rows are kept for the next time the phase recurs: callers must
        then copy them before handing them to user code."""
        if key is None:
            return self.dev(table).index_select(0, cells)
        hit = self._row_cache.get(key)
        if hit is None or hit.shape[0] != cells.numel():
            hit = self._row_cache[key] = self.dev(table).index_select(0, cells)
        return hit
