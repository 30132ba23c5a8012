"""The worker backend protocol: ``dispatch(work) -> Handle``, ``collect(handle) -> Results``.

A backend holds payload tensors (resident on its device between epochs) and runs models on batches of
cells. The runtime dispatches *all* work of an epoch (every rule, every object, every module) before
it collects anything, so a GPU backend overlaps host work with device work and a CPU backend can run
independent groups on a thread pool:

    handles = [backend.dispatch(batch) for batch in epoch_work]   # never blocks on an accelerator
    results = [backend.collect(h) for h in handles]               # the only blocking point

Faults inside model calls (an exception, NaN, a bad shape...) are raised by ``collect`` as
:class:`lmpm.errors.ModelError`, on every backend, so the runtime handles them in one place. Malformed
work (the caller's bug, detected before any model runs) raises :class:`lmpm.errors.UsageError` from
``dispatch``.

Example:
    >>> import torch
    >>> from lmpm.workers import WorkItem, get_backend
    >>> be = get_backend("cpu")
    >>> double = lambda inputs: inputs["x"] * 2.0           # proposals (n,), score 0
    >>> h = be.dispatch([WorkItem("dbl", double, {"x": torch.ones(3)}, torch.arange(3)),
    ...                  WorkItem("dbl", double, {"x": torch.zeros(2)}, torch.arange(3, 5))])
    >>> res = be.collect(h)
    >>> res[0].proposal.tolist(), res[1].proposal.tolist(), len(res.groups)
    ([2.0, 2.0, 2.0], [0.0, 0.0], 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "PICKS",
    "Backend",
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
]

# A bound model: ``model(inputs, **kwargs)`` with inputs batched over cells along dim 0. See
# docs/backends.md for what it may return.
Model = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Ref:
    """An input read from a resident tensor of the backend instead of shipped with the work.

    ``index`` (int64, shape (n,)) gathers rows on the device (a gather table); ``None`` takes the
    whole tensor, whose dim 0 must then be the item's cells.
    """

    key: str
    index: Tensor | None = None


@dataclass(frozen=True, slots=True)
class MaskSets:
    """A value's static set constraints on its tokens, lowered by the resolver into what the worker
    masks a model's logits with before it chooses (:mod:`lmpm.resolve.masks`; built once per value).

    Constraint ``s`` is satisfied by the tokens where ``ok[s]`` holds (``require X in S``: S;
    ``forbid X in S``: its complement). The worker keeps, of each row's tokens, those the commit
    policy would rank first: the hard constraints' tokens (when any is left), then level by level
    (highest priority first) the tokens satisfying the most constraints of the level.
    """

    ok: Tensor  # (S, V) bool: the token satisfies set constraint s
    levels: tuple[
        tuple[int, ...], ...
    ]  # soft constraints (indices into S) per level, highest first
    hard: tuple[int, ...] = ()  # the `hard` constraints (indices into S)
    # (V,) bool: a token some constraint of ``hard`` or ``levels`` refuses, and (V,) float32 the
    # same as 0 / -inf to add to logits (made once, here): where a row's allowed tokens include one
    # that satisfies them all, masking is one addition (lmpm.workers.choose.masked)
    drop: Tensor = field(init=False, repr=False, compare=False)
    bias: Tensor = field(init=False, repr=False, compare=False)
    # ``drop`` on the host as bytes (one 0/1 byte per token): the greedy choice of a few rows
    # looks its tokens up there without a tensor op (lmpm.workers.choose.greedy)
    drop_host: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        used = sorted({*self.hard, *(s for level in self.levels for s in level)})
        ok = self.ok[used] if used else self.ok[:0]
        drop = ~ok.all(dim=0) if ok.shape[0] else torch.zeros(self.ok.shape[1], dtype=torch.bool)
        bias = torch.zeros(drop.shape, device=self.ok.device).masked_fill(drop, -torch.inf)
        object.__setattr__(self, "drop", drop.to(self.ok.device))
        object.__setattr__(self, "bias", bias)
        object.__setattr__(self, "drop_host", drop.cpu().numpy().tobytes())


@dataclass(frozen=True, slots=True)
class VocabMask:
    """The mask a work item's logits get before the worker chooses tokens (rows: the item's cells).

    ``current`` is the committed token of each row (-1 where unset): the worker scores it afresh as
    one more candidate, which folds into keep-current, as it would among all V candidates."""

    sets: MaskSets
    applies: Tensor  # (n, S) bool: set constraint s speaks about the row's cell this epoch
    current: Tensor | None = None  # (n,) int64 committed token, -1 unset; None: every row unset


PICKS = ("sample", "top")  # how the worker chooses a Logits record's k tokens


@dataclass(frozen=True, slots=True)
class Logits:
    """What a model returns to have the worker choose ``k`` tokens per cell from its distribution.

    ``pick="top"``: the k most likely tokens (ties: the lower token id); ``pick="sample"``: k
    distinct tokens drawn without replacement (Gumbel-top-k over ``logits / temperature``, keyed by
    the counter-based RNG like every draw, so reproducible under any batching). ``-inf`` logits are
    never chosen; where fewer than k tokens are left, the first choice fills the other slots. Each
    token's score is its log-probability under ``log_softmax(logits / temperature)`` (at the
    default temperature, the model's own), before any constraint mask: a mask changes which tokens
    are chosen, never their scores (docs/backends.md, "What the model returns").

    >>> import torch
    >>> from lmpm.workers import WorkItem, get_backend
    >>> be = get_backend("cpu")
    >>> top2 = lambda inputs: Logits(torch.tensor([[0.0, 2.0, 1.0]]), k=2, pick="top")
    >>> be.collect(be.dispatch(WorkItem("r", top2, {}, torch.tensor([0]), vocab=3)))[0].proposal
    tensor([[1, 2]])
    """

    logits: Tensor  # (n, V) float
    k: int = 1  # tokens chosen per cell
    pick: str = "sample"  # one of PICKS
    temperature: float = 1.0  # above 0: divides the logits before the draw and the scores


@dataclass(slots=True)  # not frozen: built per epoch, and frozen costs ~1.5 µs a build
class WorkItem:
    """One rule's work for a set of cells (typically: one object or one module).

    ``inputs`` are batched over the item's cells along dim 0 (``(n, ...)``); a ``<name>_mask`` bool
    tensor marks the valid entries of a padded/ragged ``<name>``. Items of the same rule, model and
    kwargs are concatenated into one model call by :func:`lmpm.workers.batch_items`.
    """

    rule: str  # DSL rule name: error attribution and the RNG rule key
    model: Model  # callable or nn.Module, called once per batched group
    inputs: Mapping[str, Tensor | Ref]  # name -> (n, ...) tensor, or a resident Ref
    cells: Tensor  # int64 (n,) global cell ids: error attribution and the RNG cell key
    vocab: int | None = None  # proposals are tokens in [0, vocab) when set
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # literal extra args to the model
    group: str | None = None  # independent groups run on separate CUDA streams / pool tasks
    dtype: torch.dtype | None = None  # required proposal dtype, when the value fixes one
    seed: int = 0  # RNG key parts for proposals drawn from logits ...
    epoch: int = 0
    value: str | None = None  # ... the value name; None means "use the rule name"
    replica: int = 0  # quorum replica: replicas draw independent noise
    # The rule's score, run by the worker right after the model: ``score(inputs, epoch=...)`` with
    # the inputs named in ``score_inputs`` plus ``proposal`` (n, k); it returns (n, k) scores that
    # replace the model's own. The control plane never calls a model.
    score: Model | None = None
    score_inputs: tuple[str, ...] = ()
    # The value's static set constraints, lowered into a mask on the logits the model returns
    # (None: no mask; a model returning proposals ignores it)
    mask: VocabMask | None = None

    @property
    def n(self) -> int:
        return int(self.cells.shape[0])


@dataclass(frozen=True, slots=True)
class WorkBatch:
    """Work dispatched together; items of the same rule/model are fused into one model call."""

    items: tuple[WorkItem, ...]

    def __len__(self) -> int:
        return len(self.items)


Work = WorkItem | WorkBatch | Sequence[WorkItem]


@dataclass(frozen=True, slots=True)
class Proposal:
    """What a model may return: ``proposal`` with ``score`` of shape ``(n,)`` or ``(n, k)``.

    ``proposal.shape[:score.dim()] == score.shape``; trailing proposal dims are the cell payload.
    Extra tensors with leading dim ``n`` travel in ``aux`` and are split per item like the rest.
    """

    proposal: Tensor
    score: Tensor
    aux: Mapping[str, Tensor] = field(default_factory=dict)


@dataclass(slots=True)  # not frozen: built per dispatch, never changed
class Handle:
    """An in-flight dispatch. Opaque; pass it to the backend's ``collect``."""

    backend: str  # backend name, e.g. "cpu"
    worker: str  # worker identity, e.g. "cpu:0"
    id: int  # unique per backend instance
    n_items: int
    state: Any = field(repr=False, compare=False)  # backend-private


@dataclass(slots=True)  # not frozen: built per call (frozen costs ~1 µs a build), never changed
class GroupResult:
    """The outputs of one batched model call, one row per cell, items back to back along dim 0."""

    rule: str
    cells: Tensor  # (N,) int64
    proposal: Tensor  # (N,) | (N, k) | (N, [k,] *payload)
    score: Tensor  # (N,) | (N, k) float
    aux: Mapping[str, Tensor]  # name -> (N, ...)
    item_ids: tuple[int, ...]  # position of each item in the dispatched work
    offsets: tuple[int, ...]  # row offset of each item; len(item_ids) + 1 entries


@dataclass(frozen=True, slots=True)
class ItemResult:
    """The rows of one work item (views into its :class:`GroupResult`)."""

    rule: str
    cells: Tensor  # (n,)
    proposal: Tensor
    score: Tensor
    aux: Mapping[str, Tensor]


class Results:
    """Per-item results of one dispatch, in dispatch order; slices are taken lazily (views).

    ``groups`` exposes the batched outputs for vectorized consumers (one tensor per model call).
    """

    __slots__ = ("_where", "groups")

    def __init__(self, groups: Sequence[GroupResult], n_items: int) -> None:
        self.groups: tuple[GroupResult, ...] = tuple(groups)
        where: list[tuple[int, int]] = [(-1, -1)] * n_items
        for g, group in enumerate(self.groups):
            for slot, item in enumerate(group.item_ids):
                where[item] = (g, slot)
        self._where = where

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, item: int) -> ItemResult:
        g, slot = self._where[item]
        group = self.groups[g]
        lo, hi = group.offsets[slot], group.offsets[slot + 1]
        return ItemResult(
            rule=group.rule,
            cells=group.cells[lo:hi],
            proposal=group.proposal[lo:hi],
            score=group.score[lo:hi],
            aux={k: v[lo:hi] for k, v in group.aux.items()},
        )

    def __iter__(self) -> Iterator[ItemResult]:
        return (self[i] for i in range(len(self)))

    def split(self, field: str = "proposal") -> list[Tensor]:
        """One tensor per item, in dispatch order: ``field`` is proposal, score, cells or an aux name.

        Faster than ``[r.proposal for r in results]`` for many items (one ``torch.split`` per call).
        """
        out: list[Tensor | None] = [None] * len(self._where)
        for group in self.groups:
            if field in ("proposal", "score", "cells"):
                t: Tensor = getattr(group, field)
            else:
                t = group.aux[field]
            sizes = [hi - lo for lo, hi in zip(group.offsets, group.offsets[1:])]
            for item, part in zip(group.item_ids, t.split(sizes)):
                out[item] = part
        return out  # type: ignore[return-value]  # every item belongs to exactly one group


@runtime_checkable
class Backend(Protocol):
    """What the runtime calls. Implementations live in ``lmpm/workers/<name>.py`` (see __init__)."""

    name: str  # "cpu", "cuda", ...
    worker: str  # identity used in error messages, e.g. "cuda:0"
    device: torch.device

    def dispatch(self, work: Work) -> Handle:
        """Start the work; never blocks on an accelerator. Model faults surface in ``collect``."""
        ...

    def collect(self, handle: Handle) -> Results:
        """Wait for ``handle``'s work only and return its results; raises ModelError on a fault."""
        ...

    def ready(self, handle: Handle) -> bool:
        """True when ``collect(handle)`` would not block."""
        ...

    def put(self, key: str, tensor: Tensor) -> None:
        """Make ``tensor`` resident on the backend's device under ``key`` (copied)."""
        ...

    def get(self, key: str) -> Tensor:
        """The resident tensor (on the backend's device, ordered after pending updates)."""
        ...

    def update(self, key: str, index: Tensor, values: Tensor) -> None:
        """In-place ``resident[index] = values`` on the device; the tensor is not reallocated."""
        ...

    def delete(self, key: str) -> None: ...

    def close(self) -> None:
        """Release pools/streams; pending handles must be collected first."""
        ...
