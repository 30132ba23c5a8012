"""A check that payload never reaches the control plane (tests and debugging; slow).

With ``Engine(..., guard=True)`` the worker keeps its payload as :class:`PayloadTensor`, a tensor
subclass that every torch operation propagates: whatever is computed from payload is payload too.
The worker declares the fields of its replies metadata (the only place payload-derived tensors
lose the mark: scores, verdicts, checksums). The engine then checks that

- no message that crosses the port (:class:`~lmpm.runtime.protocol.EpochRequest`,
  :class:`~lmpm.runtime.protocol.EpochReport`), no epoch record it hands to observers and none of
  the owner's cell state holds a payload tensor (:func:`check_message`), compiled (fused) epochs
  included;
- nobody reads the worker's payload (:meth:`GuardedDataPlane.read`) while an epoch or an observer
  runs (:func:`guarding`).

A failure raises :class:`PayloadLeak` naming where the payload was found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.owner import Owner
from lmpm.runtime.protocol import ApplyReply, ApplyRequest, ProposeReply, ProposeRequest
from lmpm.runtime.records import ValueEpoch


class PayloadLeak(AssertionError):
    """A payload tensor was found on the control plane."""


class PayloadTensor(Tensor):
    """Payload, marked. torch's default ``__torch_function__`` makes every result a PayloadTensor."""


def _declassify(message: Any) -> Any:
    """The message with every tensor unmarked (metadata fields of a worker's reply)."""
    if isinstance(message, Tensor):
        return message.as_subclass(Tensor) if isinstance(message, PayloadTensor) else message
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return dataclasses.replace(
            message,  # type: ignore[type-var]
            **{f.name: _declassify(getattr(message, f.name)) for f in dataclasses.fields(message)},
        )
    if isinstance(message, Mapping):
        return {k: _declassify(v) for k, v in message.items()}
    if isinstance(message, tuple):
        return tuple(_declassify(v) for v in message)
    return message


def check_message(message: Any, where: str) -> None:
    """Raise :class:`PayloadLeak` if any tensor in ``message`` (recursively) is payload."""
    found = _find(message, where)
    if found:
        raise PayloadLeak(f"payload tensor on the control plane: {found}")


def _find(obj: Any, path: str) -> str | None:
    if isinstance(obj, PayloadTensor):
        return f"{path} {tuple(obj.shape)} {obj.dtype}"
    if isinstance(obj, Tensor):
        return None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            hit = _find(getattr(obj, f.name), f"{path}.{f.name}")
            if hit:
                return hit
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            hit = _find(v, f"{path}[{k!r}]")
            if hit:
                return hit
    elif isinstance(obj, tuple | list):
        for i, v in enumerate(obj):
            hit = _find(v, f"{path}[{i}]")
            if hit:
                return hit
    return None


@contextmanager
def guarding(dataplane: Any) -> Iterator[None]:
    """While the block runs, a guarded data plane refuses payload reads (others: no effect)."""
    if not isinstance(dataplane, GuardedDataPlane):
        yield
        return
    dataplane.busy = True
    try:
        yield
    finally:
        dataplane.busy = False


class GuardedDataPlane(DataPlane):
    """A :class:`DataPlane` whose payload is marked, and that refuses payload reads while the
    control plane is running an epoch (``busy``)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.busy = False
        for name in self.payload:
            self.payload[name] = self.payload[name].as_subclass(PayloadTensor)

    def load(self, value: str, payload: Tensor, committed: Tensor, from_input: Tensor) -> None:
        super().load(value, payload, committed, from_input)
        self.payload[value] = self.payload[value].as_subclass(PayloadTensor)

    def read(self, value: str) -> tuple[Tensor, Tensor]:
        if self.busy:
            raise PayloadLeak(f"the payload of `{value}` was read while the control plane ran")
        payload, committed = super().read(value)
        return payload.as_subclass(Tensor), committed

    def propose(self, req: ProposeRequest) -> ProposeReply:
        with torch.inference_mode(False), torch.no_grad():
            reply: ProposeReply = _declassify(super().propose(req))
        return reply

    def apply(self, req: ApplyRequest) -> ApplyReply:
        with torch.inference_mode(False), torch.no_grad():
            reply: ApplyReply = _declassify(super().apply(req))
        return reply

    def propose_fused(self, req: ProposeRequest) -> tuple[ProposeReply, list[str], dict[str, Any]]:
        with torch.inference_mode(False), torch.no_grad():
            reply, order, parts = super().propose_fused(req)
        declassified: ProposeReply = _declassify(reply)
        return declassified, order, parts  # the fused values' proposals stay on the worker

    def step_fused(
        self, owner: Owner, name: str, e: int, part: Any, checksums: bool
    ) -> tuple[ValueEpoch, int, int]:
        with torch.inference_mode(False), torch.no_grad():
            ve, commits, violations = super().step_fused(owner, name, e, part, checksums)
        record: ValueEpoch = _declassify(ve)
        return record, commits, violations
