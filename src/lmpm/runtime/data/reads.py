"""What a model may ask of its reads beyond the slot layout: clocks, a delta, a dense prefix.

A bound model opts in with the attribute ``lmpm_reads`` (:data:`READS_ATTR`), a
collection of the extras it wants (:data:`READ_OPTIONS`)::

    net.lmpm_reads = {"clocks", "dense"}

- ``"clocks"``: per read ``x``, ``x_clock`` (n, K) int64, the worker's *write clock* of each read
  cell (0 where the slot is invisible or the cell unset), and ``x_changed`` (n, K) bool, the slots
  whose cell was written since this rule's previous model call on this worker; the call also gets
  the keyword ``generation`` (an int). A cell's write clock is a counter the worker stamps on every
  write of the cell (a commit, an input, a halo copy from another worker): two equal clocks of one
  cell under one generation mean the same payload. Anything that replaces state behind the
  model's back (a resume, a rollback after a fault, a payload write the worker did not stamp) draws
  a new generation, and a new worker (a replaced one) starts with its own: a cache keyed on
  ``(generation, cell, clock)`` is never stale. (Not the owner's Lamport clocks: those can repeat
  after a rollback, with a different payload.)
- ``"dense"``: per read ``x``, its visible committed cells in slot order, left-aligned: ``x_dense``
  (n, L[, *cell]) payload, ``x_length`` (n,) int64 (row i's entries are ``[:x_length[i]]``; the
  rest is 0), ``x_dense_index`` (n, L) flat cell ids, and with ``"clocks"``, ``x_dense_clock`` (n,
  L). A causal read ``Txt[0..t-1]`` arrives as the prefix a language model takes: its visible
  slots lead each row, so the dense tensors are the slots narrowed to L (views: they share memory
  with ``x``, ``x_index`` and ``x_clock``, the call's own tensors).

A model that does not opt in gets neither, and the worker keeps no clocks for it: the default path
costs nothing. docs/models.md, "Bring your own model", has the protocol for a cache.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lmpm.errors import BindError

__all__ = ["READS_ATTR", "READ_OPTIONS", "ReadClocks", "dense_host", "dense_read", "read_options"]

READ_OPTIONS = frozenset({"clocks", "dense"})
READS_ATTR = "lmpm_reads"  # the attribute by which a model asks for more of its reads


def read_options(model: object, rule: str) -> frozenset[str]:
    """The extras ``model`` asks for (empty: none). A bad attribute is the binding's error."""
    raw = getattr(model, READS_ATTR, None)
    if raw is None:
        return frozenset()
    if isinstance(raw, str) or not isinstance(raw, Iterable):
        raw = (raw,)
    opts = frozenset(str(o) for o in raw)
    unknown = opts - READ_OPTIONS
    if unknown:
        raise BindError(
            f"the model bound to rule `{rule}` asks for reads {sorted(unknown)} in its "
            f"`{READS_ATTR}`; known: {sorted(READ_OPTIONS)}",
            code="B100",
            hint=f'e.g. model.{READS_ATTR} = {{"clocks", "dense"}} (docs/models.md, "Bring your own '
            'model")',
        )
    return opts


@dataclass(slots=True)
class _Stamped:
    clock: Tensor  # (ncells,) int64 write clock, 0: never written
    payload: Tensor  # the payload tensor the clocks describe ...
    version: int  # ... at this version (a write not stamped here moves it)


class ReadClocks:
    """A worker's write clocks of the values its opted-in models read (none: nothing is kept)."""

    def __init__(self, values: Iterable[str]) -> None:
        self.values = frozenset(values)
        self.generation = secrets.randbits(62)  # new per worker, and on every reset
        self.tick = 0  # the last clock stamped
        self._stamped: dict[str, _Stamped] = {}
        self._seen: dict[int, tuple[int, int]] = {}  # rule id -> (generation, tick) at its call

    def __bool__(self) -> bool:
        return bool(self.values)

    def reset(self, value: str, payload: Tensor, committed: Tensor) -> None:
        """The value's state was replaced (start, resume, rollback): every cache is stale."""
        if value not in self.values:
            return
        self.generation = secrets.randbits(62)
        self.tick += 1
        clock = committed.to(torch.int64) * self.tick
        self._stamped[value] = _Stamped(clock, payload, _version(payload))

    def stamp(self, value: str, payload: Tensor, cells: Tensor) -> None:
        """``cells`` of ``value`` were just written (into ``payload``)."""
        st = self._stamped.get(value)
        if st is None:
            return
        self.tick += 1
        st.clock.index_fill_(0, cells.to(st.clock.device), self.tick)
        st.payload, st.version = payload, _version(payload)

    def clocks(self, value: str, payload: Tensor, committed: Tensor) -> Tensor:
        """(ncells,) write clocks of ``value``, after checking that no write went unstamped."""
        st = self._stamped.get(value)
        if st is None or st.payload is not payload or st.version != _version(payload):
            self.reset(value, payload, committed)
            st = self._stamped[value]
        return st.clock

    def since(self, rule: int) -> int:
        """The last clock ``rule``'s previous call saw, under this generation (-1: none)."""
        gen, tick = self._seen.get(rule, (None, -1))
        return tick if gen == self.generation else -1

    def called(self, rule: int) -> None:
        """``rule``'s model was handed its reads as they are now."""
        self._seen[rule] = (self.generation, self.tick)


def _version(t: Tensor) -> int:
    # (a tensor made in inference mode keeps no version: -1 never matches a recorded one twice)
    return -1 if t.is_inference() else int(t._version)


def dense_read(
    name: str, data: Tensor, mask: Tensor, index: Tensor, clock: Tensor | None
) -> Mapping[str, Tensor]:
    """The dense layout of one read (see the module doc): from its slots (n, K[, *cell]), mask and
    index (n, K), and the slots' clocks (n, K) when asked for."""
    n, k = mask.shape
    if n == 1 and k and mask.device.type == "cpu":  # one row (a decode step): read on the host
        row = mask.numpy()[0]  # (K,) bool, a view
        width = int(row.sum())
        if row[:width].all():  # a causal prefix: its visible slots lead, narrowed
            length = torch.tensor([width], dtype=torch.int64)
            return _leading(name, data, index, clock, length, None, width)
    length = mask.sum(1)  # (n,)
    width = int(length.max()) if n and k else 0
    left = torch.arange(k, device=mask.device) < length.unsqueeze(1)  # (n, K)
    if torch.equal(mask, left):  # the visible slots come first (a causal prefix): no scatter
        return _leading(name, data, index, clock, length, left.narrow(1, 0, width), width)
    # each visible slot's place in its row (slot order); the others go to a sink column, dropped
    place = torch.where(mask, mask.cumsum(1) - 1, width)  # (n, K)

    def dense(t: Tensor) -> Tensor:
        out = torch.zeros((n, width + 1, *t.shape[2:]), dtype=t.dtype, device=t.device)
        if t.dim() == 2:  # (a token per cell: a scatter along the row)
            return out.scatter_(1, place, t).narrow(1, 0, width)
        rows = torch.arange(n, device=t.device).unsqueeze(1).expand(n, k)
        return out.index_put_((rows, place), t).narrow(1, 0, width)

    out = {
        f"{name}_dense": dense(data),  # (n, L, *cell)
        f"{name}_length": length,
        f"{name}_dense_index": dense(index),
    }
    if clock is not None:
        out[f"{name}_dense_clock"] = dense(clock)
    return out


def dense_host(
    name: str,
    data: np.ndarray,
    mask: np.ndarray,
    index: np.ndarray,
    clock: np.ndarray | None,
) -> Mapping[str, Tensor] | None:
    """:func:`dense_read` of one row held in NumPy (a decode step's read on the host: ``data``
    (1, K[, *cell]), ``mask``, ``index`` and ``clock`` (1, K) the arrays its slot tensors wrap)
    when the row is a causal prefix, its visible slots leading: those arrays narrowed in NumPy
    and wrapped, which share memory with the slot tensors as :func:`dense_read`'s views do, at a
    fraction of torch's cost per operation. None for any other row (:func:`dense_read` then)."""
    row = mask[0]  # (K,) bool
    if not row.size:
        return None
    width = int(row.sum())
    if not row[:width].all():
        return None
    out = {
        f"{name}_dense": torch.from_numpy(data[:, :width]),
        f"{name}_length": torch.from_numpy(np.array([width], dtype=np.int64)),
        f"{name}_dense_index": torch.from_numpy(index[:, :width]),
    }
    if clock is not None:
        out[f"{name}_dense_clock"] = torch.from_numpy(clock[:, :width])
    return out


def _leading(
    name: str,
    data: Tensor,
    index: Tensor,
    clock: Tensor | None,
    length: Tensor,
    real: Tensor | None,
    width: int,
) -> Mapping[str, Tensor]:
    """:func:`dense_read` of slots whose visible ones lead each row: the first ``width`` slots,
    0 past each row's length (``real`` (n, width): the entries within it; None: every one is).
    Rows of one length (one open cell: a decode step) are the slots themselves, narrowed."""
    ragged = real is not None and not bool(real.all())

    def dense(t: Tensor) -> Tensor:
        t = t.narrow(1, 0, width)
        if not ragged:
            return t
        assert real is not None
        keep = real.reshape(*real.shape, *([1] * (t.dim() - 2)))
        return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))

    out = {
        f"{name}_dense": dense(data),
        f"{name}_length": length,
        f"{name}_dense_index": dense(index),
    }
    if clock is not None:
        out[f"{name}_dense_clock"] = dense(clock)
    return out
