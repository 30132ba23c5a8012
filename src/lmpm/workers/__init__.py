"""Worker backends: the data plane that holds payload and runs models on batches of cells.

Backends are found by naming convention, not by a registry: ``get_backend("cpu")`` imports
``lmpm.workers.cpu`` and calls its ``make_backend(**opts)``. A new backend is one new module
``lmpm/workers/<name>.py`` defining ``make_backend`` (see docs/backends.md).

Example:
    >>> import torch
    >>> from lmpm.workers import WorkItem, get_backend
    >>> be = get_backend("cpu", worker="w0")
    >>> item = WorkItem("inc", lambda inputs: inputs["x"] + 1, {"x": torch.zeros(2)}, torch.arange(2))
    >>> be.collect(be.dispatch(item))[0].proposal.tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from lmpm.errors import UsageError
from lmpm.workers.base import (
    PICKS,
    Backend,
    GroupResult,
    Handle,
    ItemResult,
    Logits,
    MaskSets,
    Model,
    Proposal,
    Ref,
    Results,
    VocabMask,
    Work,
    WorkBatch,
    WorkItem,
)
from lmpm.workers.batch import BatchedCall, batch_items

__all__ = [
    "PICKS",
    "Backend",
    "BatchedCall",
    "GroupResult",
    "Handle",
    "ItemResult",
    "Logits",
    "MaskSets",
    "Model",
    "Proposal",
    "Ref",
    "Results",
    "VocabMask",
    "Work",
    "WorkBatch",
    "WorkItem",
    "available_backends",
    "batch_items",
    "get_backend",
]

# Modules of this package that are infrastructure, not backends (checked without importing them).
_NOT_BACKENDS = frozenset({"base", "batch", "choose", "rng"})


def available_backends() -> list[str]:
    """Names of the backend modules in this package (those defining ``make_backend``), sorted.

    A backend listed here may still be unusable on this machine (``cuda`` without a GPU): its
    ``make_backend`` then raises :class:`lmpm.errors.BackendUnavailable`.

    >>> "cpu" in available_backends() and "cuda" in available_backends()
    True
    """
    names = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name in _NOT_BACKENDS or info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if callable(getattr(module, "make_backend", None)):
            names.append(info.name)
    return sorted(names)


def get_backend(name: str, **opts: Any) -> Backend:
    """Construct backend ``name`` (module ``lmpm.workers.<name>``) with its options.

    Raises UsageError for an unknown name (listing the available ones) and BackendUnavailable when
    the backend cannot run here.
    """
    available = available_backends()
    if name not in available:
        raise UsageError(
            f"unknown worker backend '{name}'; available backends: {', '.join(available)}",
            hint="a backend is a module lmpm/workers/<name>.py defining make_backend(**opts)",
        )
    module = importlib.import_module(f"{__name__}.{name}")
    backend: Backend = module.make_backend(**opts)
    return backend
