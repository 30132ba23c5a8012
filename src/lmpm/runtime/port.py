"""The one declared port between the planes: what the control plane may ask of the data plane.

The control plane (:class:`lmpm.runtime.control.engine.Engine`) keeps the epoch barrier, the RuleSet, the
termination rule, faults and the "epoch durable" mark. Everything per cell is the data plane's:
the payload, and the cells' metadata and decisions (its :class:`~lmpm.runtime.data.owner.Owner`). The
engine is typed against :class:`DataPlanePort` and reaches the data plane through it only (a test
walks engine.py for payload and private-member access). Three data planes implement it:

- :class:`lmpm.runtime.data.dataplane.DataPlane`: one worker in this process, owner of every cell;
  ``compile()`` makes it a fused data plane (:mod:`lmpm.runtime.data.compiled`, ``--compile``);
- :class:`lmpm.runtime.data.group.WorkerGroup`: W partitioned workers in this process;
- :class:`lmpm.runtime.data.raygroup.RayGroup`: W workers as Ray actors, the halo over gloo.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from lmpm.runtime.protocol import EpochReport, EpochRequest

if TYPE_CHECKING:
    from lmpm.runtime.data.owner import Owner


class DataPlanePort(Protocol):
    """A data plane, as the control plane sees it."""

    worker: str  # its name in records ("w0", "group")
    store: Any  # its payload store once the run has a directory (None before)

    @property
    def owner(self) -> Owner:
        """The cells' metadata and decisions (state, why-codes; restored on resume)."""
        ...

    # ---- the epoch ---------------------------------------------------------------------------------
    def epoch(self, req: EpochRequest) -> EpochReport:
        """Run one epoch: open, propose, check, agree, apply, commit; durable when it has a store."""
        ...

    def log_cells(self, tracer: Any) -> bool:
        """Write the run directory's per-cell log rows (commits, and ``tracer``'s trace rows)
        beside the cells, into the workers' stores, from now on: True if this data plane does
        (a worker group), False if the control plane's log writes them from the records."""
        ...

    def compile(self) -> Any:
        """Run the eligible values' epoch as one fused step from now on (``--compile``); the
        step's statistics (:class:`lmpm.runtime.data.compiled.CompiledEpoch`). A data plane that cannot
        raises :class:`lmpm.errors.UsageError`."""
        ...

    # ---- inputs and outputs (the API edge, never inside an epoch) ----------------------------------
    def set_input(self, value: str, payload: Tensor, mask: Tensor) -> Tensor:
        """Commit ``payload[mask]`` as given input; the cells committed."""
        ...

    def read(self, value: str) -> tuple[Tensor, Tensor]:
        """(payload, committed) of a value, on the host."""
        ...

    # ---- durability ------------------------------------------------------------------------------
    @property
    def shard_names(self) -> tuple[str, ...]: ...

    def open_store(self, run_dir: Any) -> None: ...

    def close_store(self) -> None: ...

    def checkpoint_shards(self, label: int, sync: bool = True) -> dict[str, dict[str, Any]]: ...

    def restore_shards(
        self,
        label: int,
        shards: Mapping[str, Mapping[str, Any]],
        upto: int,
        commits: Mapping[tuple[int, str], Tensor],
        committed: Mapping[str, Tensor],
        from_input: Mapping[str, Tensor],
    ) -> None: ...
