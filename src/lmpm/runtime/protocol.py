"""The messages between the control plane and the data plane (the workers). Metadata only.

An epoch is two round trips. The control plane sends a :class:`ProposeRequest` (the epoch, and per
rule the cells it fires on); each worker gathers the reads from its resident payload, runs the
models and scores, checks every constraint on every candidate and answers with a
:class:`ProposeReply`: per value, per open cell and candidate, the score, the violation bits, the
validity and (where the policy asks) a payload checksum. After agreement the control plane sends an
:class:`ApplyRequest` (per value, the rows that commit and their winning column, or aggregation
weights); the worker writes the winners into its payload, makes them durable when it has a store,
and answers with an :class:`ApplyReply` (which rows really changed, their checksums for the log).

No message carries payload: every tensor in them is a cell index, a flag, a score, a verdict, a
column id or a checksum, so their size does not depend on the payload's width (``Token[16]`` and
``Tensor[256]`` values cost the same bytes per epoch). :func:`nbytes` measures their tensor data,
:func:`wire_bytes` the whole message as it crosses a process boundary.

The messages are plain slotted dataclasses, built every epoch (a frozen one costs ~1.5 µs more to
build): treat them as immutable once sent.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmpm.runtime.records import Compact, Dissent, LogShare, ValueEpoch, wire_code

# splitmix64's multipliers as signed int64 (torch has no uint64 arithmetic); products wrap.
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _mix(z: Tensor) -> Tensor:
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


def checksum(payload: Tensor, cell_dims: int) -> Tensor:
    """int64 checksum of each cell's payload: ``payload`` (..., *cell) -> (...). Integer arithmetic
    on the payload's bits, so it is identical on every device; equal payloads, equal checksums
    (what a worker sends for a policy that compares payloads, ``quorum``).

    >>> import torch
    >>> a = checksum(torch.tensor([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0]]), 1)
    >>> bool(a[0] == a[1]), bool(a[0] == a[2])
    (True, False)
    """
    # (not while torch.compile traces a compiled step: .item() would break its graph)
    if not cell_dims and payload.is_cpu and payload.numel() == 1 and not _compiling():
        one = _checksum_of_one(payload.item())
        if one is not None:  # (a decode's commit: torch's few kernels on one number cost ~20 µs)
            return torch.full(payload.shape, one, dtype=torch.int64)
    x = payload
    if x.is_floating_point():
        x = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    elif x.dtype != torch.int64:
        x = x.to(torch.int64)
    if cell_dims:
        x = x.flatten(-cell_dims)
        pos = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=torch.int64) * _GOLDEN
        x = _mix(x + pos).sum(dim=-1)
    return _mix(x + _GOLDEN)


_U64 = (1 << 64) - 1
_compiling = torch.compiler.is_compiling


def _i64(n: int) -> int:
    """``n`` wrapped to a signed 64-bit integer, as torch's int64 arithmetic wraps."""
    n &= _U64
    return n - (1 << 64) if n >> 63 else n


def _checksum_of_one(v: bool | int | float | complex) -> int | None:
    """:func:`checksum` of one scalar cell's payload (``Tensor.item()``) in Python integers, the
    same number (the tests hold them equal); None where only torch's conversion says it: a NaN
    (its bits), a number beyond float32's range, a complex number."""
    if isinstance(v, float):
        if v != v:
            return None
        try:
            z = struct.unpack("<i", struct.pack("<f", v))[0]  # float32 bits, as torch's view
        except OverflowError:
            return None
    elif isinstance(v, int):  # (bool included: True is 1, as torch's conversion)
        z = _i64(v)
    else:
        return None
    z = _i64(z + _GOLDEN)
    z = _i64((z ^ (z >> 30)) * _MIX1)  # (>> of a negative int is arithmetic, as torch's)
    z = _i64((z ^ (z >> 27)) * _MIX2)
    return z ^ (z >> 31)


@dataclass(slots=True)
class RuleWork:
    """One rule fired on ``cells`` (sorted flat cell ids of its target value)."""

    rule: int  # RulePlan.id
    cells: Tensor  # (m,) int64
    # the quorum replicas this worker computes (a `quorum(k of n)` value spread over workers:
    # replica p on worker p); None: every replica of the rule
    replicas: tuple[int, ...] | None = None


@dataclass(slots=True)
class ProposeRequest:
    epoch: int
    rules: tuple[RuleWork, ...]
    # per value: the schedule opens unset cells only (no proposal can equal a committed payload)
    fresh: Mapping[str, bool]
    # per value: the cells whose candidate payloads the worker records in its store (--trace cells)
    record: Mapping[str, Tensor] | None = None
    # per value: the schedule's phase when the open cells are a fixed set that recurs (the worker
    # may keep the rows of its static tables for that set), or None
    phases: Mapping[str, int | None] | None = None
    # the ids of the constraints in the RuleSet this epoch (the worker evaluates only those), or
    # None when all of them are
    active: frozenset[int] | None = None


@dataclass(slots=True)
class Candidates:
    """One value's candidates in one epoch: n open cells that had proposals, C columns (column 0
    is keep-current), K constraints evaluated at run time."""

    value: str
    cells: Tensor  # (n,) int64 sorted open cells
    valid: Tensor  # (n, C) bool: the candidate exists (padding and folded duplicates are False)
    score: Tensor  # (n, C) float64; column 0: the fresh score of a proposal equal to the committed
    #                payload where ``refreshed``, else undefined (the control plane knows it)
    violated: Tensor  # (n, C, K) bool: masked by ``applies`` and ``valid``
    applies: Tensor  # (n, K) bool: the constraint speaks about the cell
    col_rule: Tensor  # (C,) int64 rule id per column (-1: keep)
    col_replica: Tensor  # (C,) int64
    col_slot: Tensor  # (C,) int64
    refreshed: Tensor | None  # (n,) bool: a proposal equalled the committed payload (folded)
    checksum: Tensor | None  # (n, C) int64 payload checksums, when the policy compares payloads

    @classmethod
    def build(
        cls,
        value: str,
        cells: Tensor,
        checked: tuple[Tensor, Tensor, Tensor, Tensor],
        columns: tuple[Tensor, Tensor, Tensor],
        refreshed: Tensor | None = None,
        checksum: Tensor | None = None,
    ) -> Candidates:
        """The candidates of ``value``'s open ``cells`` from the checked table ``checked`` =
        (valid, score, violated, applies) and its column layout ``columns`` = (rule, replica,
        slot) per column; ``refreshed`` and ``checksum`` as the fields say."""
        valid, score, violated, applies = checked
        col_rule, col_replica, col_slot = columns
        return cls(
            value,
            cells,
            valid,
            score,
            violated,
            applies,
            col_rule,
            col_replica,
            col_slot,
            refreshed,
            checksum,
        )

    @classmethod
    def of_record(cls, ve: ValueEpoch) -> Candidates:
        """The candidates an epoch record ``ve`` kept (no fold, no checksums)."""
        assert ve.col_replica is not None and ve.col_slot is not None
        checked = (ve.valid, ve.score, ve.violated, ve.applies)
        return cls.build(ve.value, ve.cells, checked, (ve.col_rule, ve.col_replica, ve.col_slot))

    def to_host(self) -> Candidates:
        """The same candidates with every tensor on the host (a worker on an accelerator): one
        copy of them all (:func:`pack`), one wait for the device."""
        moved: dict[str, Any] = {}
        on_device = []
        for f in dataclasses.fields(self)[1:]:
            t = moved[f.name] = getattr(self, f.name)
            if t is not None and t.device.type != "cpu":
                on_device.append(f.name)
        if on_device:
            flat, layout = pack([moved[n] for n in on_device])
            moved.update(zip(on_device, unpack(flat.cpu(), layout)))
        return Candidates(self.value, **moved)


# how :func:`unpack` reads a packed tensor back: per tensor, its dtype, shape and position
Layout = list[tuple[torch.dtype, tuple[int, ...], int]]
_NUMPY = {
    torch.int64: np.int64,
    torch.float64: np.float64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
}


def pack(tensors: list[Tensor]) -> tuple[Tensor, Layout]:
    """Every tensor's bytes in one uint8 tensor on their device (widest elements first, so each
    starts at a multiple of its size), and how to read them back: a device's results reach the
    host in one copy (one wait) instead of one per tensor."""
    order = sorted(range(len(tensors)), key=lambda j: -tensors[j].element_size())
    layout = [(tensors[j].dtype, tuple(tensors[j].shape), j) for j in order]
    if not tensors:
        return torch.zeros(0, dtype=torch.uint8), layout
    parts = [tensors[j].contiguous().reshape(-1).view(torch.uint8) for j in order]
    return torch.cat(parts), layout


def unpack(flat: Tensor, layout: Layout) -> list[Tensor]:
    """The tensors :func:`pack` packed, from its packed tensor on the host, in their order: views
    of it (numpy's, no tensor operation per tensor)."""
    data = flat.numpy()
    out: list[Tensor] = [flat] * len(layout)
    at = 0
    for dt, shape, j in layout:
        size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out[j] = torch.from_numpy(data[at : at + size].view(_NUMPY[dt]).reshape(shape))
        at += size
    return out


@dataclass(slots=True)
class ProposeReply:
    worker: str
    values: Mapping[str, Candidates]
    model_seconds: float  # time in dispatch + collect of the models


@dataclass(slots=True)
class ValueDecision:
    """What commits in one value: ``rows`` index the open cells of the epoch's :class:`Candidates`."""

    rows: Tensor | None  # (m,) int64 rows that commit; None: every row
    winner: Tensor  # (m,) int64 winning column per committing row
    weights: Tensor | None  # (m, C) float64: aggregate the candidates instead of taking the winner


@dataclass(slots=True)
class ApplyRequest:
    epoch: int
    values: Mapping[str, ValueDecision]
    checksums: bool  # return the committed rows' payload checksums (the commit log wants them)
    sync: bool = True  # make the rows durable now (False: the caller syncs the store later)


@dataclass(slots=True)
class Applied:
    changed: Tensor | None  # (m,) bool: the row's payload changed (None: every row did)
    checksum: Tensor | None  # (m,) int64 checksum of each committed row's new payload


@dataclass(slots=True)
class ApplyReply:
    worker: str
    values: Mapping[str, Applied]
    durable: bool  # the committed rows are in the worker's store (written and synced)


@dataclass(slots=True)
class EpochRequest(Compact):
    """The control plane's only per-epoch message to the data plane (:class:`DataPlanePort`):
    run epoch ``epoch``. Its size does not depend on the number of cells."""

    epoch: int
    # the schedules that open a few unset cells pass over the `skip` cells tried since epoch
    # `start` (the last commit): the control plane's count of commit-free epochs
    skip: int
    start: int
    # the ids of the constraints in the RuleSet this epoch, or None when all of them are
    active: frozenset[int] | None = None
    checksums: bool = False  # committed rows' checksums in the records (the commit log wants them)
    # per value: the cells whose candidate payloads the workers record (--trace cells; set once)
    record: Mapping[str, Tensor] | None = None
    # the per-cell records (EpochReport.values) are wanted: an observer writes them, or the
    # caller keeps them. A group's owners send them to the control plane only then.
    records: bool = True


@dataclass(slots=True)
class EpochReport(Compact):
    """What the data plane answers an :class:`EpochRequest` with: counts of fixed size for the
    control plane (the schedule's termination reads ``unset``), and the owner's per-cell records
    (``values``), handed to the observers that write them (commit log, trace) beside the owner."""

    epoch: int
    worker: str
    opened: tuple[tuple[str, int], ...]  # (value, open cells), sorted by value
    commits: int
    attempts: int
    violations: int
    model_seconds: float  # time in dispatch + collect of the models
    unset: Mapping[str, int]  # per value, its unset cells after the epoch
    dissent: tuple[Dissent, ...] = ()  # quorum replicas outvoted
    values: list[ValueEpoch] = dataclasses.field(default_factory=list)  # per value, in order
    faults: tuple[Any, ...] = ()  # worker faults survived (the epoch was redone after each)
    halo_bytes: int = 0  # payload bytes moved worker to worker
    # a group's worker: (value, rows) its payload store took in the epoch (restores check them)
    stored: tuple[tuple[str, int], ...] = ()
    # the owners wrote the per-cell log rows into their stores: what is left for the log
    log: LogShare | None = None
    # the messages between the control plane's process and the workers (a :class:`Traffic`):
    # serialised, and their tensor data (one in-process worker: counted on request)
    control_bytes: int = 0
    message_bytes: int = 0
    # the workers' acknowledgement: every commit of the epoch is in their payload stores (written
    # and synced; True for an epoch without commits). The control plane marks an epoch durable
    # in its log only on it.
    durable: bool = True


def nbytes(message: Any) -> int:
    """Bytes of tensor data in a message (recursively): what would cross the wire."""
    if isinstance(message, Tensor):
        return message.numel() * message.element_size()
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return sum(nbytes(getattr(message, f.name)) for f in dataclasses.fields(message))
    if isinstance(message, Mapping):
        return sum(nbytes(v) for v in message.values())
    if isinstance(message, tuple | list):
        return sum(nbytes(v) for v in message)
    return 0


def wire_bytes(message: Any) -> int:
    """Bytes of ``message`` serialised to cross a process boundary: the pickle (protocol 5) of
    its wire form (:func:`to_wire`), every array's data out of band as Ray sends it, plus those
    buffers. An array costs its data and a header of about a hundred bytes (dtype, shape).

    >>> wire_bytes(ValueDecision(None, torch.zeros(1000, dtype=torch.int64), None)) > 8000
    True
    """
    head, data = _wire_sizes(to_wire(message))
    return head + data


def _wire_sizes(wired: Any) -> tuple[int, int]:
    """(bytes pickled in band, array bytes out of band) of a message in its wire form: one pickle
    gives both (the arrays' data is not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(wired, protocol=5, buffer_callback=buffers.append)
    return len(head), sum(b.raw().nbytes for b in buffers)


@dataclass(slots=True)
class Traffic:
    """The bytes of the messages that crossed between the control plane and the workers in one
    epoch (a data plane's ``traffic``, reset each epoch; one in-process worker counts only when
    asked: nothing crosses a process boundary there)."""

    control_bytes: int = 0  # serialised: :func:`wire_bytes`
    message_bytes: int = 0  # their tensor data (the arrays sent out of band)

    def count(self, *messages: Any, wired: bool = False) -> None:
        """Add ``messages`` (None: no message); ``wired``: they are in their wire form already
        (:func:`to_wire`, as a worker process receives them)."""
        for m in messages:
            if m is not None:
                head, data = _wire_sizes(m if wired else to_wire(m))
                self.control_bytes += head + data
                self.message_bytes += data

    def times(self, message: Any, n: int, *, wired: bool = False) -> None:
        """Add ``n`` more copies of ``message`` (sent to several workers), serialised once."""
        if n > 0:
            head, data = _wire_sizes(message if wired else to_wire(message))
            self.control_bytes += n * (head + data)
            self.message_bytes += n * data


def tensors(message: Any) -> list[Tensor]:
    """Every tensor in a message (recursively)."""
    if isinstance(message, Tensor):
        return [message]
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return [t for f in dataclasses.fields(message) for t in tensors(getattr(message, f.name))]
    if isinstance(message, Mapping):
        return [t for v in message.values() for t in tensors(v)]
    if isinstance(message, tuple | list):
        return [t for v in message for t in tensors(v)]
    return []


def to_wire(message: Any) -> Any:
    """The message with every tensor as a numpy array (a process boundary: numpy arrays pickle
    about ten times faster than tensors, which go through ``torch.save`` one by one)."""
    if isinstance(message, Tensor):
        return message.detach().cpu().numpy()
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return type(message)(
            **{f.name: to_wire(getattr(message, f.name)) for f in dataclasses.fields(message)}
        )
    if isinstance(message, Mapping):
        return {k: to_wire(v) for k, v in message.items()}
    if isinstance(message, tuple):
        return tuple(to_wire(v) for v in message)
    if isinstance(message, list):
        return [to_wire(v) for v in message]
    return message


def from_wire(message: Any) -> Any:
    """The inverse of :func:`to_wire` (arrays that arrive read-only are copied)."""
    if isinstance(message, np.ndarray):
        return torch.from_numpy(message if message.flags.writeable else message.copy())
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return type(message)(
            **{f.name: from_wire(getattr(message, f.name)) for f in dataclasses.fields(message)}
        )
    if isinstance(message, Mapping):
        return {k: from_wire(v) for k, v in message.items()}
    if isinstance(message, tuple):
        return tuple(from_wire(v) for v in message)
    if isinstance(message, list):
        return [from_wire(v) for v in message]
    return message


wire_code(EpochRequest, 243)  # the port's two messages: two bytes of class reference each
wire_code(EpochReport, 244)
