"""A model's inputs on a worker, gathered: per read of a fired rule, the read cells' payload,
mask and index from the resident payload (the plan's static gather tables, kept per schedule
phase), what an opted-in model asks beyond them (clocks, dense layout,
:mod:`lmpm.runtime.data.reads`), and the model call's keyword arguments.

A user's model and score get their own tensors: writing into one changes nothing outside their
call. LMPM's own models (``lmpm.*``, which never write into their inputs) get the worker's kept
rows without copies, and under ``--compile`` their reads are gathered by compiled graphs
(:class:`lmpm.runtime.data.compiled.ReadGathers`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmpm.ir.eval import evaluate
from lmpm.resolve.plan import Plan, RulePlan, ValuePlan
from lmpm.runtime.data.reads import ReadClocks, dense_host, dense_read, read_options
from lmpm.runtime.data.resident import Resident, ours

# payload dtypes NumPy holds: one open cell's rows of such a value are read there (host_slots)
_NUMPY = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)


def host_slots(
    index: Tensor, valid: Tensor, cell: int, payload: Tensor, committed: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(payload (1, K, *cell), mask (1, K), index (1, K)) of the slots of host cell ``cell``
    (``index``/``valid``: the read's static tables): what the general gather makes, looked up in
    NumPy, whose few small operations cost a fraction of torch's between two forwards of a model
    (the decode step of a language model). ``index`` is a view of the plan's table."""
    data, mask, idx = _host_arrays(index, valid, cell, payload, committed)
    return torch.from_numpy(data), torch.from_numpy(mask), torch.from_numpy(idx)


def host_row(host: Callable[[Tensor], np.ndarray], table: Tensor, cell: int) -> Tensor:
    """Row ``cell`` of the host plan table ``table`` (1, ...) as a view through its NumPy array
    (``host``: a :class:`HostViews`): after a forward has flushed the caches, a NumPy slice and
    ``from_numpy`` cost a fraction of ``Tensor.narrow`` (the coords of a decode step's one cell)."""
    return torch.from_numpy(host(table)[cell : cell + 1])


def _host_arrays(
    index: Tensor,
    valid: Tensor,
    cell: int,
    payload: Tensor,
    committed: Tensor,
    host: Callable[[Tensor], np.ndarray] = Tensor.numpy,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`host_slots` as the NumPy arrays the tensors wrap (the opted-in extras of the same
    row are worked out from them, not from the tensors); ``host``: a tensor's array."""
    idx = host(index)[cell : cell + 1]  # (1, K)
    mask = host(valid)[cell : cell + 1] & host(committed)[idx]
    data = host(payload)[idx]  # (1, K, *cell)
    return data, mask, idx


class HostViews:
    """The NumPy arrays of the host tensors a worker reads every epoch (plan tables, resident
    payload, flags and clocks), made once per tensor: ``Tensor.numpy`` costs ~10-15 µs right after
    a forward has flushed the caches, a look-up a fraction. A tensor replaced (a restore), or
    whose storage moved, gets a new array; in-place writes show through the array (a view)."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[Tensor, np.ndarray, int]] = {}

    def __call__(self, t: Tensor) -> np.ndarray:
        hit = self._views.get(id(t))
        if hit is not None and hit[0] is t and hit[2] == t.data_ptr():
            return hit[1]
        if len(self._views) >= _VIEWS_KEPT:  # (tensors replaced by restores: let them go)
            self._views.clear()
        view = t.numpy()
        self._views[id(t)] = (t, view, t.data_ptr())
        return view


_VIEWS_KEPT = 256  # arrays a worker's HostViews holds before starting afresh


class ModelInputs:
    """The model inputs of a worker over the resident state ``res`` (see the module doc)."""

    def __init__(self, plan: Plan, res: Resident, seed: int) -> None:
        self.plan = plan
        self.res = res
        self.seed = seed
        # rules whose model and score are LMPM's own (they never write into their inputs)
        self.trusted = {
            rp.id for rp in plan.rules if ours(rp.model) and (rp.score is None or ours(rp.score))
        }
        # values no rule proposes to (inputs only): only set_input, load and the halo transports
        # write them, each through torch (bumping the tensors' versions), so a read of all their
        # cells is kept until their payload or flags change (see uniform_read)
        self._static = set(plan.values) - {rp.target for rp in plan.rules}
        self._uniform_cache: dict[tuple[int, int], tuple[Any, ...]] = {}  # see uniform_read
        self._kwargs_base: dict[int, dict[str, Any]] = {}
        self._score_keys_cache: dict[int, tuple[str, ...]] = {}
        # --compile: LMPM's own models' reads gathered by compiled graphs (DataPlane.compile_reads)
        self.read_gathers: Any = None
        # what each user model asks of its reads (lmpm.runtime.data.reads: clocks, dense); the
        # write clocks are kept only for the values an opted-in model reads with clocks
        self.read_opts = {
            rp.id: opts for rp in plan.rules if (opts := read_options(rp.model, rp.name))
        }
        self.since: dict[int, int] = {}  # rule id -> write clock of its previous call
        self.host = HostViews()  # (a decode step's reads on the host)
        self.read_clocks = ReadClocks(
            rd.source
            for rp in plan.rules
            if "clocks" in self.read_opts.get(rp.id, ())
            for rd in rp.reads
        )

    def gather(
        self, rp: RulePlan, cells: Tensor, on_host: Tensor | None = None
    ) -> dict[str, Tensor]:
        """The model's inputs for ``cells``: per read, payload / mask / index, each (n, K[, *cell]).
        ``on_host``: the same cells on the host, where the request brought them (read there, not
        on the device, which would wait for it)."""
        res = self.res
        vp = self.plan.values[rp.target]
        n = cells.numel()
        phase = res.phase.get(rp.target)
        key = None if phase is None else (rp.id, phase)
        copy = rp.id not in self.trusted  # copies of anything the worker keeps
        one = None  # the one open cell whose rows are read on the host (a decode step)
        if n == 1 and not copy:  # one open cell (causal generation): views of its rows
            c = int((cells if on_host is None else on_host).item())
            key = None
            rows = lambda t, *_: res.dev(t).narrow(0, c, 1)  # noqa: E731
            one = c if res.host else None
        else:
            rows = res.rows
        coords = (
            host_row(self.host, vp.coords, one)
            if one is not None
            else rows(vp.coords, cells, key and ("coords", *key))
        )
        inputs: dict[str, Tensor] = {
            "cells": cells.clone() if copy else cells,
            "coords": coords.clone() if key and copy else coords,
        }
        gathered = (
            self.read_gathers.gather(rp, cells, res)
            if self.read_gathers is not None and n > 1 and not copy
            else {}
        )
        for j, rd in enumerate(rp.reads):
            host = None  # the NumPy arrays of one host row's slots (data, mask, index)
            committed = res.committed[rd.source]
            payload = res.payload[rd.source]
            if j in gathered:
                data, mask, idx = gathered[j]
            elif one is not None and not rd.uniform and payload.dtype in _NUMPY:
                host = _host_arrays(rd.index, rd.valid, one, payload, committed, self.host)
                data, mask, idx = (torch.from_numpy(a) for a in host)
            elif rd.uniform:
                # Every cell reads the same cells: one gathered row, broadcast (an expanded view
                # cannot be written in place).
                row, mask, data = self.uniform_read(rp, j, payload, committed, copy)
                k = row.numel()
                idx = row.expand(n, k)
                mask = mask.expand(n, k)
                data = data.expand(n, k, *data.shape[1:])
            else:
                idx = rows(rd.index, cells, key and ("index", j, *key))  # (n, K)
                valid = rows(rd.valid, cells, key and ("valid", j, *key))
                mask = valid & committed.take(idx)
                if payload.dim() == 1:
                    data = payload.take(idx)  # the flat gather of a 1-D state tensor
                else:
                    data = payload.index_select(0, idx.reshape(-1)).reshape(
                        *idx.shape, *payload.shape[1:]
                    )
                if key is not None and copy:
                    idx = idx.clone()  # the model gets its own copy of the kept rows
            for name in rd.args:
                inputs[name] = data  # (n, K[, *cell]) payload of the read cells
                inputs[f"{name}_mask"] = mask  # (n, K) visible and committed
                inputs[f"{name}_index"] = idx  # (n, K) flat index into the source value
            opts = self.read_opts.get(rp.id)
            if opts:
                for name in rd.args:
                    inputs.update(
                        self.read_extras(rp, opts, name, rd.source, data, mask, idx, host)
                    )
        return inputs

    def read_extras(
        self,
        rp: RulePlan,
        opts: frozenset[str],
        name: str,
        source: str,
        data: Tensor,
        mask: Tensor,
        idx: Tensor,
        host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> dict[str, Tensor]:
        """What an opted-in model asks of read ``name`` beyond its slots
        (:mod:`lmpm.runtime.data.reads`): clocks and the delta since its previous call, and the
        dense layout. ``host``: the NumPy arrays ``data``, ``mask`` and ``idx`` wrap (one open
        cell's row read on the host), from which the extras are worked out in NumPy too."""
        out: dict[str, Tensor] = {}
        clock = None
        ahead = None  # the clock row in NumPy (one row on the host)
        if "clocks" in opts:
            res = self.res
            clocks = self.read_clocks.clocks(source, res.payload[source], res.committed[source])
            since = self.since.get(rp.id, -1)
            if idx.shape[0] == 1 and idx.device.type == "cpu":  # one row: read in NumPy
                row_mask, row_idx = (host[1], host[2]) if host else (mask.numpy(), idx.numpy())
                ahead = np.where(row_mask, self.host(clocks)[row_idx], 0)  # (1, K)
                clock = torch.from_numpy(ahead)
                changed = torch.from_numpy(ahead > since)
            else:
                clock = torch.where(mask, clocks.take(idx), 0)  # (n, K)
                changed = clock > since
            out[f"{name}_clock"] = clock
            out[f"{name}_changed"] = changed
        if "dense" in opts:
            dense = None if host is None else dense_host(name, *host, ahead)
            out.update(dense or dense_read(name, data, mask, idx, clock))
        return out

    def uniform_read(
        self, rp: RulePlan, j: int, payload: Tensor, committed: Tensor, copy: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Read ``j`` of ``rp``, which every cell makes alike: (cells (K,), mask (K,), payload
        (K, *cell)). For LMPM's own models, a read of a value no rule writes is kept while the
        value's tensors are the same ones at the same version (the caption of every video
        epoch); anyone else's model gets fresh rows (it may write into them)."""
        rd = rp.reads[j]
        # (tensors made in inference mode, by a restore inside an epoch, keep no version)
        cache = (
            not copy
            and rd.source in self._static
            and not payload.is_inference()
            and not committed.is_inference()
        )
        if cache:
            stamp = (payload._version, committed._version)
            hit = self._uniform_cache.get((rp.id, j))
            if hit is not None and hit[0] is payload and hit[1] is committed and hit[2] == stamp:
                return hit[3], hit[4], hit[5]
        row = self.res.dev(rd.index)[0]
        mask = self.res.dev(rd.valid)[0] & committed.index_select(0, row)
        data = payload.index_select(0, row)
        if cache:
            self._uniform_cache[(rp.id, j)] = (payload, committed, stamp, row, mask, data)
        return row, mask, data

    def kwargs(self, rp: RulePlan, vp: ValuePlan, e: int) -> dict[str, Any]:
        """The model call's keyword arguments in epoch ``e``: the rule's literals, then the ones
        computed from ``e``, then ``epoch``, ``vocab`` and ``seed`` unless the rule sets them."""
        if not rp.epoch_args and "epoch" not in rp.kwargs:
            base = self._kwargs_base.get(rp.id)
            if base is None:
                base = self._kwargs_base[rp.id] = {"vocab": vp.vocab, "seed": self.seed}
                base.update(rp.kwargs)
            return {**base, "epoch": e}
        kwargs = dict(rp.kwargs)
        for k, ex in rp.epoch_args.items():
            kwargs[k] = evaluate(ex, self.plan.env | {"e": e})
        kwargs.setdefault("epoch", e)
        kwargs.setdefault("vocab", vp.vocab)
        kwargs.setdefault("seed", self.seed)
        return kwargs

    def score_keys(self, rp: RulePlan, inputs: Mapping[str, Tensor]) -> tuple[str, ...]:
        """The model inputs a rule's score call receives: cells, coords and its reads' tensors
        (the same names every epoch: worked out once per rule)."""
        hit = self._score_keys_cache.get(rp.id)
        if hit is None:
            hit = self._score_keys_cache[rp.id] = tuple(
                k
                for k in inputs
                if k in ("cells", "coords")
                or k.removesuffix("_mask").removesuffix("_index") in rp.score_args
            )
        return hit
