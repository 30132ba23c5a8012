"""The compiled epoch step on a GPU: each step one CUDA graph, the owner's metadata on the device.

Under ``lmpm run --compile --backend cuda`` a value's epoch after its model (gather the committed
payload, check, agree, write the winners, advance clocks and provenance:
:func:`lmpm.runtime.data.compiled.value_step`) is compiled by inductor into Triton kernels; launched
one by one, those few dozen kernels would cost more host time than they do work. So each (value,
open-cell bucket) step is captured once as a CUDA graph (:func:`lmpm.workers.graphs.capture`) and
replayed every epoch, one launch.

A graph reads and writes fixed addresses, so:

- the step's metadata lives on the device: :class:`Mirror` keeps a device copy of the owner's
  committed flags, clocks, provenance and scores for the values the steps read. The host state
  stays the owner's (schedules, why-codes, checkpoints and the eager values read it); after a step
  the owner applies the step's records to it (:meth:`lmpm.runtime.data.owner.Owner.settle`), and
  whatever else changes the host state (an eager epoch, an input, a resume) bumps the owner's
  version of that value, which makes the mirror copy it up again before the next step reads it;
- the inputs that change per epoch (the epoch, the open cells, the proposals and their scores, the
  RuleSet) are copied into the graph's static buffers; the rest (payload, flags, mirror, static
  tables) are the graph's inputs themselves. If one of those is replaced (a resume loads new
  tensors), the step is captured again;
- the step's records (winners, scores, verdicts, clocks: a few bytes per open cell) are packed into
  one byte buffer inside the graph and reach the host in one copy, the one wait of the step.

The model runs eagerly before the graph (models read values on the host and make data-dependent
shapes: ByteLM reads ``int(slot.max())``); ``lmpm show --compiled`` says so.

On the simulated CUDA device (:mod:`lmpm.workers.simcuda`) the capture runs the step's own
function and refuses one that would wait for the device, so all of this is exercised on a CPU
(tests/runtime/test_captured.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lmpm.runtime.data.compiled import StepInputs
from lmpm.runtime.protocol import Layout, pack, unpack
from lmpm.runtime.records import CellState
from lmpm.workers import graphs

# The step's arguments (lmpm.runtime.data.compiled.StepInputs, by field) that change per epoch:
# the epoch, the open cells, the proposals, their scores, where their rules fired and the RuleSet
# mask. The others stay.
_INDEX = {name: i for i, name in enumerate(StepInputs._fields)}
PER_EPOCH = tuple(_INDEX[n] for n in ("e", "cells", "prop", "sc", "fired", "active"))
# inputs the run makes once and never writes (the RuleSet mask, Owner.active_mask; the "every
# rule fired" mask): copied in only when a new one comes
CONSTANT = (_INDEX["active"], _INDEX["fired"])
# The arguments the step writes in place (what a simulated capture must put back).
_WRITES = ("payload", "dp_committed", "from_input", "committed", "clock", "rule", "epoch")
WRITTEN = tuple(_INDEX[n] for n in (*_WRITES, "kept_score", "why"))
_FIELDS = ("committed", "clock", "rule", "epoch", "score")


class Mirror:
    """The owner's metadata of the values the captured steps read, on the device.

    ``owner`` has ``state`` and ``why`` (host tensors) and ``version`` (per value: bumped whenever
    the host state changes other than by :meth:`Owner.settle`). :meth:`get` returns a value's
    device copy, copied up again first when the host changed since."""

    def __init__(self, owner: Any, device: torch.device) -> None:
        self.owner = owner
        self.device = device
        self.state: dict[str, CellState] = {}
        self.why: dict[str, Tensor] = {}
        self._seen: dict[str, int] = {}
        self.uploads = 0  # values copied to the device (first use, or the host changed)

    def get(self, name: str) -> tuple[CellState, Tensor | None]:
        version = self.owner.version[name]
        if self._seen.get(name) == version:
            return self.state[name], self.why.get(name)
        host: CellState = self.owner.state[name]
        why = self.owner.why.get(name)
        dev = self.state.get(name)
        if dev is None:  # the device tensors are made once: the graphs hold their addresses
            self.state[name] = CellState(*(getattr(host, f).to(self.device) for f in _FIELDS))
            if why is not None:
                self.why[name] = why.to(self.device)
        else:  # (the device's why-codes are the step's scratch, never read back: the owner
            for f in _FIELDS:  # finds them from the step's records, Owner.settle)
                getattr(dev, f).copy_(getattr(host, f))
        self._seen[name] = version
        self.uploads += 1
        return self.state[name], self.why.get(name)


class _Step:
    """One value's compiled step, captured over its arguments (see the module's docstring)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Tensor]) -> None:
        self.args = list(args)
        for i in PER_EPOCH:  # static buffers for what changes per epoch
            self.args[i] = args[i].clone()
        self.layout: Layout = []

        def body() -> list[Tensor]:
            flat, self.layout = pack(list(fn(*self.args)))  # the records, in one buffer
            return [flat]

        def warmup() -> None:  # on copies: the step writes the payload and metadata in place
            fn(*[a.clone() for a in self.args])

        written = [self.args[i] for i in WRITTEN]
        (self.packed,), self.replay = graphs.capture(body, warmup=warmup, keep=written)
        self._last: dict[int, Tensor] = {}  # the CONSTANT inputs last copied in

    def holds(self, args: Sequence[Tensor]) -> bool:
        """Whether the graph's fixed inputs are still these tensors."""
        return all(a is b for i, (a, b) in enumerate(zip(args, self.args)) if i not in PER_EPOCH)

    def run(self, args: Sequence[Tensor]) -> list[Tensor]:
        """Copy in this epoch's inputs, replay, bring the records to the host (one copy)."""
        for i in PER_EPOCH:
            a = args[i]
            if a is self.args[i]:
                continue
            if i in CONSTANT:
                if self._last.get(i) is a:
                    continue
                self._last[i] = a
            self.args[i].copy_(a)
        self.replay()
        return unpack(self.packed.cpu(), self.layout)  # the step's one wait for the device


class CapturedSteps:
    """A run's captured steps, by (value, bucket, proposals per cell, their dtype)."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats  # the run's CompileStats (captures counted there)
        self._steps: dict[tuple[Any, ...], _Step] = {}

    def run(self, key: tuple[Any, ...], fn: Callable[..., Any], args: Sequence[Tensor]) -> Any:
        """The records of one step (host tensors, as :meth:`CompiledEpoch.step` returns them)."""
        step = self._steps.get(key)
        if step is None or not step.holds(args):
            step = self._steps[key] = _Step(fn, args)
            self.stats.captures += 1
        return tuple(step.run(args))
