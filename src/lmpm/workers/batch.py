"""Batching: fuse many work items into few model calls, run them, validate, attribute faults.

The ≥20× claim of the backends rests here. A per-object loop pays Python and kernel-launch overhead
once per object; :func:`batch_items` groups every item of the same ``(rule, model, kwargs, ...)`` —
across objects, modules and learning modules — into one :class:`BatchedCall`: inputs concatenated
along dim 0, ragged trailing dims zero-padded to the largest item with ``<name>_mask`` marking the
valid entries. :func:`execute` calls the model once per call and checks the output; a
:class:`~lmpm.workers.base.GroupResult` keeps item boundaries as offsets so splitting back is free.

Validation is split so that a GPU backend never syncs at dispatch: metadata (type, shape, dtype) is
checked on the host at once; data (NaN/inf, token range) becomes a per-row bitmask tensor on the
device, read by :func:`raise_if_bad` after the backend waited for the call.

Example:
    >>> import torch
    >>> from lmpm.workers import WorkItem, batch_items
    >>> f = lambda inputs: inputs["nbr"].sum(-1)
    >>> calls = batch_items([WorkItem("r", f, {"nbr": torch.ones(2, 3)}, torch.arange(2)),
    ...                      WorkItem("r", f, {"nbr": torch.ones(1, 5)}, torch.arange(2, 3))])
    >>> c = calls[0]
    >>> tuple(c.inputs["nbr"].shape), c.inputs["nbr_mask"].sum(-1).tolist(), c.offsets
    ((3, 5), [3, 3, 5], (0, 2, 3))
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmpm.errors import ModelError, UsageError, user_frame
from lmpm.workers import choose, rng
from lmpm.workers.base import (
    PICKS,
    GroupResult,
    Logits,
    Model,
    Proposal,
    VocabMask,
    Work,
    WorkBatch,
    WorkItem,
)

__all__ = [
    "BAD_LOGITS",
    "BAD_PROPOSAL",
    "BAD_SCORE",
    "BAD_TOKEN",
    "BatchedCall",
    "RowKeys",
    "as_items",
    "batch_items",
    "execute",
    "first_cells",
    "raise_if_bad",
    "rule_score",
]

# Per-row fault bits of the validation mask (int8, one entry per row of a model call).
BAD_PROPOSAL = 1  # NaN/inf in a float proposal
BAD_SCORE = 2  # NaN/inf in the score
BAD_TOKEN = 4  # token outside [0, vocab)
BAD_LOGITS = 8  # NaN/+inf logit, or every logit of a row is -inf
# Model fault codes (docs/runtime.md, "Faults"): every one names rule, cells, backend and worker.
R_RAISED = "R050"  # the model raised an Exception
R_EXITED = "R051"  # the model raised a BaseException (SystemExit, ...) that would end the process
R_TYPE = "R052"  # the output is not a tensor / mapping with 'proposal' or 'logits'
R_SHAPE = "R053"  # a dim has the wrong size (leading dim != cells, logits over the wrong vocab)
R_RANK = "R054"  # the wrong number of dims (scalar, (n, k, m) proposals, 1-D logits)
R_DTYPE = "R055"  # the wrong dtype (float tokens, int logits, proposals not the value's dtype)
R_NONFINITE = "R056"  # NaN/inf in proposals, scores or logits (or a row of all -inf logits)
R_VOCAB = "R057"  # a token outside [0, vocab)
R_DEVICE = "R059"  # an output (or a score) on another device than the inputs the worker handed in
MSG_DEVICE = (
    "returned '{name}' on {got}; the worker handed the model its inputs on {want}, and outputs "
    'must be on the same device (docs/runtime.md, "Devices")'
)
HINT_DEVICE = (
    "make new tensors on the inputs' device (`torch.zeros(n, device=x.device)`), and keep "
    "tables and weights there (LMPM moves a bound nn.Module to the worker's device)"
)
_BAD_TEXT = {
    BAD_PROPOSAL: "NaN/inf in 'proposal'",
    BAD_SCORE: "NaN/inf in 'score'",
    BAD_TOKEN: "a token outside [0, vocab)",
    BAD_LOGITS: "NaN/+inf logits or a row of only -inf logits",
}
_CELLS_SHOWN = 4  # how many cell ids an error message names

MSG_OUTPUT_TYPE = (
    "the model bound to rule '{rule}' returned {what}; expected a tensor of proposals, a "
    "Proposal/dataclass/dict with 'proposal' (and optionally 'score'), or one with 'logits'"
)


@dataclass(slots=True)  # not frozen: built per call, never changed
class RowKeys:
    """RNG key parts per row of a call: an int when every item agrees, else an int64 (N,) tensor."""

    seed: int | Tensor
    value: int | Tensor
    epoch: int | Tensor
    replica: int | Tensor


@dataclass(slots=True)  # not frozen: built per call (frozen costs ~2 µs a build), never changed
class BatchedCall:
    """One model call covering several work items (rows of item i: ``offsets[i]:offsets[i+1]``)."""

    rule: str
    model: Model
    kwargs: Mapping[str, Any]
    vocab: int | None
    dtype: torch.dtype | None
    group: str | None
    inputs: dict[str, Tensor]  # name -> (N, ...), padded; <name>_mask bool where ragged
    cells: Tensor  # (N,) int64 global cell ids
    keys: RowKeys
    item_ids: tuple[int, ...]  # positions in the dispatched work
    offsets: tuple[int, ...]  # len(item_ids) + 1 row offsets
    score: Model | None = None  # the rule's score (see WorkItem.score)
    score_inputs: tuple[str, ...] = ()
    mask: VocabMask | None = None  # the items' masks, rows back to back (see WorkItem.mask)


def as_items(work: Work) -> tuple[WorkItem, ...]:
    """Normalize what ``dispatch`` accepts (an item, a batch, a sequence of items) to a tuple."""
    if isinstance(work, WorkItem):
        return (work,)
    if isinstance(work, WorkBatch):
        return work.items
    items = tuple(work)
    for item in items:
        if not isinstance(item, WorkItem):
            raise UsageError(f"dispatch expects WorkItems, got {type(item).__name__}")
    return items


def _freeze(v: Any) -> Hashable:
    # kwargs are literals in practice; anything unhashable (a tensor) groups by identity.
    if isinstance(v, int | float | str | bool | bytes | type(None)):
        return (type(v).__name__, v)
    if isinstance(v, tuple):
        return tuple(_freeze(x) for x in v)
    return ("id", id(v))


def _group_key(item: WorkItem) -> Hashable:
    inputs = item.inputs
    names = tuple(sorted(k for k in inputs if not (k.endswith("_mask") and k[:-5] in inputs)))
    kw = tuple(sorted((k, _freeze(v)) for k, v in item.kwargs.items())) if item.kwargs else ()
    score = (id(item.score), item.score_inputs) if item.score is not None else None
    mask = None if item.mask is None else id(item.mask.sets)
    return (item.rule, id(item.model), item.group, item.vocab, item.dtype, kw, names, score, mask)


Transfer = Callable[[Tensor], Tensor]


def _place(t: Tensor, device: torch.device | None, transfer: Transfer | None) -> Tensor:
    if device is None or t.device == device:
        return t
    return transfer(t) if transfer is not None else t.to(device)


def _concat(
    parts: Sequence[Tensor], device: torch.device | None, transfer: Transfer | None
) -> Tensor:
    if len({p.device for p in parts}) > 1:
        parts = [_place(p, device, transfer) for p in parts]
    # Concatenate where the parts live (host for fresh inputs), then move once: one transfer per
    # input name per call instead of one per item.
    out = parts[0] if len(parts) == 1 else torch.cat(list(parts))
    return _place(out, device, transfer)


def _gather(
    rule: str,
    name: str,
    parts: Sequence[Tensor],
    device: torch.device | None,
    transfer: Transfer | None,
) -> tuple[Tensor, int]:
    """Concatenate ``parts`` along dim 0, zero-padding ragged trailing dims.

    Returns the (N, ...) tensor and the last padded dim (0 when nothing was padded).
    """
    first = parts[0]
    trailing = first.shape[1:]
    if all(p.shape[1:] == trailing for p in parts):
        if any(p.dtype != first.dtype for p in parts):
            raise UsageError(f"rule '{rule}': input '{name}' has different dtypes across items")
        return _concat(parts, device, transfer), 0
    if any(p.dim() != first.dim() for p in parts):
        raise UsageError(
            f"rule '{rule}': input '{name}' has different numbers of dims across items "
            f"({sorted({p.dim() for p in parts})}); only the sizes of dims >= 1 may differ"
        )
    if any(p.dtype != first.dtype for p in parts):
        raise UsageError(f"rule '{rule}': input '{name}' has different dtypes across items")
    target = [max(p.shape[d] for p in parts) for d in range(1, first.dim())]
    last_ragged = max(
        d for d in range(1, first.dim()) if any(p.shape[d] != target[d - 1] for p in parts)
    )
    where = parts[0].device if len({p.device for p in parts}) == 1 else device
    rows = sum(p.shape[0] for p in parts)
    out = torch.zeros((rows, *target), dtype=first.dtype, device=where)
    off = 0
    for p in parts:
        n = p.shape[0]
        out[(slice(off, off + n), *(slice(0, s) for s in p.shape[1:]))] = p
        off += n
    return _place(out, device, transfer), last_ragged


def _row_key(values: list[int], sizes: list[int], device: torch.device | None) -> int | Tensor:
    if all(v == values[0] for v in values):
        return values[0]
    per_item = torch.tensor([rng.signed64(v) for v in values], dtype=torch.int64)
    return torch.repeat_interleave(per_item, torch.tensor(sizes)).to(device or "cpu")


def _build_one(
    item: WorkItem, item_ids: list[int], device: torch.device | None, transfer: Transfer | None
) -> BatchedCall:
    """:func:`_build_call` of one item (an epoch's one rule firing: the common case): its inputs
    as they are (placed on ``device``), nothing to concatenate or pad."""
    rule, n = item.rule, item.n
    elsewhere = False  # some input is not on ``device`` yet
    for name, t in item.inputs.items():
        if not isinstance(t, Tensor):
            raise UsageError(
                f"rule '{rule}': input '{name}' is a {type(t).__name__}; resolve Refs through "
                "a backend's dispatch, and pass tensors otherwise"
            )
        if t.dim() == 0 or t.shape[0] != n:
            raise UsageError(
                f"rule '{rule}': input '{name}' has shape {tuple(t.shape)} but the item has "
                f"{n} cells; inputs are batched over cells along dim 0"
            )
        elsewhere = elsewhere or (device is not None and t.device != device)
    tensors: dict[str, Tensor] = item.inputs  # type: ignore[assignment]  # checked just above
    inputs = (
        {name: _place(t, device, transfer) for name, t in tensors.items()}
        if elsewhere
        else dict(tensors)  # (the model's own dict: what it adds stays in its call)
    )
    if item.cells.dim() != 1 or item.cells.dtype != torch.int64:
        raise UsageError(
            f"rule '{rule}': cells must be an int64 tensor of shape (n,), got "
            f"{item.cells.dtype} {tuple(item.cells.shape)}"
        )
    value = item.value or item.rule
    key = _KEYS.get(value)
    if key is None:
        key = _KEYS[value] = rng.key_of(value)
    return BatchedCall(
        rule=rule,
        model=item.model,
        mask=_merge_masks((item,), device, transfer),
        kwargs=item.kwargs,
        vocab=item.vocab,
        dtype=item.dtype,
        group=item.group,
        inputs=inputs,
        cells=_place(item.cells, device, transfer),
        keys=RowKeys(seed=item.seed, value=key, epoch=item.epoch, replica=item.replica),
        item_ids=tuple(item_ids),
        offsets=(0, n),
        score=item.score,
        score_inputs=item.score_inputs,
    )


_KEYS: dict[str, int] = {}  # rng.key_of of the value names seen (a hash each: kept)


def _build_call(
    items: Sequence[WorkItem],
    item_ids: list[int],
    device: torch.device | None,
    transfer: Transfer | None,
) -> BatchedCall:
    if len(items) == 1:
        return _build_one(items[0], item_ids, device, transfer)
    head = items[0]
    rule = head.rule
    sizes = [it.n for it in items]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    base_names = [k for k in head.inputs if not (k.endswith("_mask") and k[:-5] in head.inputs)]
    mask_names = {f"{k}_mask" for k in base_names if any(f"{k}_mask" in it.inputs for it in items)}
    inputs: dict[str, Tensor] = {}
    for name in base_names:
        parts = [it.inputs[name] for it in items]
        for it, p in zip(items, parts):
            if not isinstance(p, Tensor):
                raise UsageError(
                    f"rule '{rule}': input '{name}' is a {type(p).__name__}; resolve Refs through "
                    "a backend's dispatch, and pass tensors otherwise"
                )
            if p.dim() == 0 or p.shape[0] != it.n:
                raise UsageError(
                    f"rule '{rule}': input '{name}' has shape {tuple(p.shape)} but the item has "
                    f"{it.n} cells; inputs are batched over cells along dim 0"
                )
        tensors: list[Tensor] = parts  # type: ignore[assignment]  # checked just above
        inputs[name], last_ragged = _gather(rule, name, tensors, device, transfer)
        mask_name = f"{name}_mask"
        if mask_name in mask_names:
            mask_dims = next(
                m.dim() for it in items if isinstance(m := it.inputs.get(mask_name), Tensor)
            )
            masks = [
                m
                if isinstance(m := it.inputs.get(mask_name), Tensor)
                else torch.ones(t.shape[:mask_dims], dtype=torch.bool, device=t.device)
                for it, t in zip(items, tensors)
            ]
            inputs[mask_name], _ = _gather(rule, mask_name, masks, device, transfer)
        elif last_ragged:
            # Synthesize the mask over the padded dims: True on each item's own extent.
            masks = [
                torch.ones(t.shape[: last_ragged + 1], dtype=torch.bool, device=t.device)
                for t in tensors
            ]
            inputs[mask_name], _ = _gather(rule, mask_name, masks, device, transfer)
    for it in items:
        if it.cells.dim() != 1 or it.cells.dtype != torch.int64:
            raise UsageError(
                f"rule '{rule}': cells must be an int64 tensor of shape (n,), got "
                f"{it.cells.dtype} {tuple(it.cells.shape)}"
            )
    cells = _concat([it.cells for it in items], device, transfer)
    value_keys: dict[str, int] = {}
    values = [
        value_keys.setdefault(v, rng.key_of(v)) for v in (it.value or it.rule for it in items)
    ]
    keys = RowKeys(
        seed=_row_key([it.seed for it in items], sizes, device),
        value=_row_key(values, sizes, device),
        epoch=_row_key([it.epoch for it in items], sizes, device),
        replica=_row_key([it.replica for it in items], sizes, device),
    )
    return BatchedCall(
        rule=rule,
        model=head.model,
        mask=_merge_masks(items, device, transfer),
        kwargs=head.kwargs,
        vocab=head.vocab,
        dtype=head.dtype,
        group=head.group,
        inputs=inputs,
        cells=cells,
        keys=keys,
        item_ids=tuple(item_ids),
        offsets=tuple(offsets),
        score=head.score,
        score_inputs=head.score_inputs,
    )


def _merge_masks(
    items: Sequence[WorkItem], device: torch.device | None, transfer: Transfer | None
) -> VocabMask | None:
    """The items' masks as one over the call's rows (the items of a call share the sets)."""
    masks = [it.mask for it in items]
    head = masks[0]
    if head is None:
        return None
    if len(masks) == 1:
        if device is None or (
            head.applies.device == device
            and (head.current is None or head.current.device == device)
        ):
            return head  # (already where the call runs: the record as it is)
        return VocabMask(
            head.sets,
            _place(head.applies, device, transfer),
            None if head.current is None else _place(head.current, device, transfer),
        )
    assert all(m is not None for m in masks), "the group key keeps masked items apart"
    applies = _concat([m.applies for m in masks if m is not None], device, transfer)
    current = None
    if any(m is not None and m.current is not None for m in masks):
        current = _concat(
            [
                m.current
                if m is not None and m.current is not None
                else torch.full((it.n,), -1, dtype=torch.int64)
                for m, it in zip(masks, items)
            ],
            device,
            transfer,
        )
    return VocabMask(head.sets, applies, current)


def batch_items(
    items: Sequence[WorkItem],
    *,
    device: torch.device | None = None,
    transfer: Transfer | None = None,
) -> list[BatchedCall]:
    """Group ``items`` into as few model calls as possible, in first-appearance order.

    Items share a call when rule, model (identity), group, vocab, dtype, kwargs and input names agree.
    Inputs are concatenated along dim 0; trailing dims that differ between items are zero-padded to
    the largest and a ``<name>_mask`` (bool, True = real entry) is provided — padded with False when
    items bring their own masks, synthesized over the padded dims otherwise. With ``device``, inputs
    end up there (``transfer`` moves a tensor, e.g. through pinned memory).
    """
    if len(items) == 1:  # one call (no key to work out)
        return [_build_call(items, [0], device, transfer)]
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(_group_key(item), []).append(i)
    return [_build_call([items[i] for i in ids], ids, device, transfer) for ids in groups.values()]


class CellIds(list[int]):
    """The first cell ids a fault concerns, for its message: a list (``where["cells"]``) that
    prints ``[0, 1, 2, 3, …] (8 cells)`` when it names fewer than the ``total``."""

    def __init__(self, ids: list[int], total: int) -> None:
        super().__init__(ids)
        self.total = total

    def __repr__(self) -> str:
        if self.total <= len(self):
            return super().__repr__()
        return "[" + ", ".join(map(str, self)) + f", …] ({self.total:,} cells)"

    __str__ = __repr__


def first_cells(cells: Tensor, rows: Tensor | None = None) -> CellIds:
    """The first few global cell ids (of ``rows`` when given) for an error message."""
    picked = cells if rows is None else cells[rows[:_CELLS_SHOWN].to(cells.device)]
    total = int(cells.shape[0] if rows is None else rows.numel())
    return CellIds([int(c) for c in picked[:_CELLS_SHOWN].cpu()], total)


def _where(
    call: BatchedCall, backend: str, worker: str, rows: Tensor | None = None
) -> dict[str, Any]:
    return {
        "rule": call.rule,
        "cells": first_cells(call.cells, rows),
        "backend": backend,
        "worker": worker,
    }


def _fields(out: Any) -> dict[str, Any] | None:
    if isinstance(out, Mapping):
        return dict(out)
    if isinstance(out, Proposal):
        return {"proposal": out.proposal, "score": out.score, **out.aux}
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        # Not dataclasses.asdict: it deep-copies tensors.
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    if isinstance(out, tuple) and hasattr(out, "_asdict"):
        return dict(out._asdict())
    if isinstance(out, tuple | list) and len(out) == 2 and all(isinstance(t, Tensor) for t in out):
        return {"proposal": out[0], "score": out[1]}
    if hasattr(out, "proposal") or hasattr(out, "logits"):
        return {k: getattr(out, k) for k in ("proposal", "score", "logits") if hasattr(out, k)}
    return None


def _bad_choice(out: Logits) -> str | None:
    """What is wrong with a Logits record's k, pick or temperature (None: nothing)."""
    k, t = out.k, out.temperature
    if type(k) is int and k >= 1 and type(t) is float and 0 < t < math.inf and out.pick in PICKS:
        return None  # (the usual record, told apart without the numbers ABCs' slow checks)
    if isinstance(out.k, bool) or not isinstance(out.k, numbers.Integral) or out.k < 1:
        return f"k={out.k!r}; k is a whole number of tokens, at least 1"
    if out.pick not in PICKS:
        return f"pick={out.pick!r}; picks: {', '.join(PICKS)}"
    t = out.temperature
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t <= 0:
        return f"temperature={t!r}; the temperature is a number above 0"
    return None


def _rows_any(flag: Tensor) -> Tensor:
    """(N, ...) bool -> (N,) bool: any fault in the row."""
    return flag.flatten(1).any(1) if flag.dim() > 1 else flag


def _finite(t: Tensor) -> bool:
    """Every element of ``t`` is finite, as far as the host can tell without waiting for a
    device (False on an accelerator: the caller then works it out on the device). A few
    elements (a row's max, k scores) are read as numbers: cheaper than a reduction."""
    if t.device.type != "cpu":
        return False
    if t.numel() <= _FEW:
        return all(math.isfinite(x) for x in t.reshape(-1).tolist())
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


_FEW = 64  # elements read as Python numbers rather than reduced (_finite)


def _flag(bad: Tensor | None, rows: Tensor, code: int) -> Tensor:
    """The fault bitmask ``bad`` (None: no fault yet) with ``code`` on ``rows`` ((N,) bool)."""
    flags = rows.to(torch.int8) * code
    return flags if bad is None else bad | flags


def _mark_nonfinite(bad: Tensor | None, t: Tensor, code: int) -> Tensor | None:
    """``bad`` with ``code`` on the rows of ``t`` holding NaN or ±inf. On the host, where looking
    costs no device sync, one min/max pass (both NaN when any element is) says whether there are
    any; the rows are only worked out when there are."""
    if t.device.type == "cpu" and t.numel() and not t.is_complex() and _finite(t):
        return bad
    return _flag(bad, _rows_any(~torch.isfinite(t)), code)


def _mark_outside(bad: Tensor | None, proposal: Tensor, vocab: int) -> Tensor | None:
    """``bad`` with ``BAD_TOKEN`` on the rows holding a token outside [0, vocab) (host: one
    min/max pass when every token is inside)."""
    if proposal.device.type == "cpu" and proposal.numel():
        lo, hi = torch.aminmax(proposal)
        if int(lo) >= 0 and int(hi) < vocab:
            return bad
    return _flag(bad, _rows_any((proposal < 0) | (proposal >= vocab)), BAD_TOKEN)


_CLEAN: dict[tuple[int, torch.device], Tensor] = {}  # (N, device) -> the bitmask of no fault


def _clean(n: int, device: torch.device) -> Tensor:
    """The bitmask of a call of ``n`` rows without a fault: int8 zeros, one tensor per (n,
    device), made once and never written (execute makes a new one for a fault, and
    :func:`raise_if_bad` knows this one at sight)."""
    clean = _CLEAN.get((n, device))
    if clean is None:
        clean = _CLEAN[(n, device)] = torch.zeros(n, dtype=torch.int8, device=device)
    return clean


def _host_scores(logp: Tensor, tokens: list[int], columns: int) -> Tensor:
    """(n, columns) float64: row i's log-prob of ``tokens[i]`` in every column (host ``logp``
    (n, V) float32), 0 where it is not finite: what gathering the greedy columns from ``logp``,
    zeroing what is not finite and widening to float64 give, read as numbers (a decode step)."""
    table = logp.numpy()
    rows = []
    for i, t in enumerate(tokens):
        v = table.item(i, t)
        rows.append([v if math.isfinite(v) else 0.0] * columns)
    return torch.from_numpy(np.array(rows, dtype=np.float64))


def execute(call: BatchedCall, *, backend: str, worker: str) -> tuple[GroupResult, Tensor]:
    """Run ``call``'s model once and normalize its output to one proposal/score row per cell.

    Returns the result and the per-row fault bitmask (int8 (N,), on the call's device; nonzero rows
    are faulty — see :func:`raise_if_bad`). Raises ModelError at once when the model raises or its
    output has the wrong type, shape or dtype (host metadata only; this never syncs a device).
    """
    try:
        if torch.is_grad_enabled():
            with torch.no_grad():
                out = call.model(call.inputs, **call.kwargs)
        else:  # (an epoch runs in inference mode: no context to enter)
            out = call.model(call.inputs, **call.kwargs)
    except Exception as e:
        raise ModelError(
            f"the model bound to rule '{call.rule}' raised {type(e).__name__}: {e}{user_frame(e)}",
            where=_where(call, backend, worker),
            code=R_RAISED,
        ) from e
    except KeyboardInterrupt:
        raise  # Ctrl-C: the run stops as interrupted (status "interrupted", exit 130)
    except BaseException as e:  # SystemExit, GeneratorExit...: a model must not end the run
        raise ModelError(
            f"the model bound to rule '{call.rule}' raised {type(e).__name__}({e}){user_frame(e)}, "
            "which would have ended the whole process",
            where=_where(call, backend, worker),
            code=R_EXITED,
            hint="a model reports a fault by raising an Exception, never SystemExit",
        ) from e

    def fail(msg: str, code: str) -> ModelError:
        return ModelError(
            f"the model bound to rule '{call.rule}' {msg}",
            where=_where(call, backend, worker),
            code=code,
        )

    n = int(call.cells.shape[0])
    device = call.cells.device
    chosen: Logits | None = None  # a Logits record: the worker chooses its k tokens
    if isinstance(out, Logits):
        chosen = out
        wrong = _bad_choice(out)
        if wrong:
            raise fail(f"returned a Logits record with {wrong}", R_TYPE)
        proposal, score, logits = None, None, out.logits
        aux: dict[str, Any] = {}
        returned: tuple[tuple[str, Any], ...] = (("logits", logits),)
    else:
        fields: dict[str, Any] | None = (
            {"proposal": out} if isinstance(out, Tensor) else _fields(out)
        )
        if fields is None:
            raise ModelError(
                MSG_OUTPUT_TYPE.format(rule=call.rule, what=f"a {type(out).__name__}"),
                where=_where(call, backend, worker),
                code=R_TYPE,
            )
        proposal = fields.pop("proposal", None)
        score = fields.pop("score", None)
        logits = fields.pop("logits", None)
        aux = fields
        returned = (("proposal", proposal), ("score", score), ("logits", logits), *aux.items())
    for name, t in returned:
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise fail(f"returned a {type(t).__name__} for '{name}'; expected a tensor", R_TYPE)
        if t.dim() == 0 or t.shape[0] != n:
            raise fail(
                f"returned '{name}' of shape {tuple(t.shape)}; expected leading dim {n} "
                "(one row per cell of the batched call)",
                R_RANK if t.dim() == 0 else R_SHAPE,
            )
    for name, t in returned:
        if t is not None and t.device != device:  # host metadata: no device sync
            raise ModelError(
                f"the model bound to rule '{call.rule}' "
                + MSG_DEVICE.format(name=name, got=t.device, want=device),
                where=_where(call, backend, worker),
                code=R_DEVICE,
                hint=HINT_DEVICE,
            )
    bad: Tensor | None = None  # the per-row fault bits, made at the first fault
    scored = False  # the scores are known finite

    if proposal is None and logits is None:
        raise ModelError(
            MSG_OUTPUT_TYPE.format(rule=call.rule, what="neither 'proposal' nor 'logits'"),
            where=_where(call, backend, worker),
            code=R_TYPE,
        )
    if proposal is not None and logits is not None:
        raise fail("returned both 'proposal' and 'logits'; return one of them", R_TYPE)

    if logits is not None:
        if not logits.is_floating_point() or logits.dim() not in (2, 3):
            raise fail(
                f"returned logits {logits.dtype} {tuple(logits.shape)}; expected a float tensor "
                "(n, vocab) or (n, k, vocab)",
                R_DTYPE if logits.dim() in (2, 3) else R_RANK,
            )
        if call.vocab is not None and logits.shape[-1] != call.vocab:
            raise fail(
                f"returned logits over {logits.shape[-1]} tokens; the vocabulary has {call.vocab}",
                R_SHAPE,
            )
        if score is not None:
            raise fail(
                "returned both 'logits' and 'score'; the score of a sampled token is its log-prob",
                R_TYPE,
            )
        keys = call.keys
        finite_max = False  # every row's max logit is known finite
        fast = None  # the greedy choice of a decode step, worked out on the host
        if chosen is not None:
            if logits.dim() != 2:
                raise fail(
                    f"returned a Logits record with logits of shape {tuple(logits.shape)}; "
                    "expected (n, vocab): the worker chooses its k tokens",
                    R_RANK,
                )

            noise: list[Tensor] = []  # drawn once: the masked and the unmasked choice share it

            def gumbel(draws: int) -> Tensor:
                if not noise:
                    noise.append(
                        rng.gumbel(
                            keys.seed,
                            keys.value,
                            call.cells,
                            keys.epoch,
                            call.rule,
                            keys.replica,
                            draws,
                        )
                    )
                return noise[0]

            if chosen.pick == "top" and chosen.k == 1:
                fast = choose.greedy_rows(logits, call.mask)
            if fast is not None:
                proposal = fast.proposal  # (n, 1), masked (n, 2): with the model alone's choice
                finite_max = fast.finite
            elif call.mask is None:
                proposal = choose.choose(
                    logits, chosen.k, chosen.pick, chosen.temperature, gumbel, None
                )  # (n, k)
            else:  # with the model alone's choice, checked and beaten in the trace
                if chosen.pick == "top" and chosen.k == 1:
                    proposal, alone = choose.greedy(logits, call.mask)  # (n, 1), (n,)
                else:
                    proposal = choose.choose(
                        logits, chosen.k, chosen.pick, chosen.temperature, gumbel, call.mask
                    )  # (n, k)
                    first = choose.choose(
                        logits, 1, chosen.pick, chosen.temperature, gumbel, None
                    )  # (n, 1)
                    alone = first[:, 0]
                proposal = choose.alone_column(proposal, alone)  # (n, k + 1)
            temp = float(chosen.temperature)
            # (float32 logits as they are; / 1.0 changes nothing)
            wide = logits if logits.dtype == torch.float32 else logits.float()
            logp = torch.log_softmax(wide / temp if temp != 1.0 else wide, dim=-1)
        else:
            proposal = rng.categorical(
                choose.masked(logits, call.mask),
                seed=keys.seed,
                value=keys.value,
                cells=call.cells,
                epoch=keys.epoch,
                rule=call.rule,
                replica=keys.replica,
            )  # (n,) | (n, k)
            if call.mask is not None and logits.dim() == 2:  # as for Logits: the trace sees it
                alone = rng.categorical(
                    logits,
                    seed=keys.seed,
                    value=keys.value,
                    cells=call.cells,
                    epoch=keys.epoch,
                    rule=call.rule,
                    replica=keys.replica,
                )  # (n,)
                proposal = choose.alone_column(proposal.unsqueeze(1), alone)  # (n, 2)
            logp = torch.log_softmax(logits.float(), dim=-1)
        kept = logits.dim() == 2 and call.mask is not None and call.mask.current is not None
        if kept:
            two = proposal if proposal.dim() == 2 else proposal.unsqueeze(1)
            proposal = choose.keep_column(two, logits, call.mask)  # (n, k + 1)
        if fast is not None and not kept:  # the decode step's scores, read as numbers
            score = _host_scores(logp, fast.tokens, proposal.shape[1])  # (n, 1 | 2) float64
        else:
            if logits.dim() == 2 and proposal.dim() == 2:  # (n, k) tokens of one distribution
                score = logp.gather(1, proposal)
            else:  # (n,) of (n, V), or (n, k) of (n, k, V): one token per distribution
                score = logp.gather(-1, proposal.unsqueeze(-1)).squeeze(-1)
            if not _finite(score):
                score = torch.where(torch.isfinite(score), score, torch.zeros_like(score))
        # a NaN or +inf logit, or every token -inf: the distribution's max is not finite (amax
        # propagates NaN): one reduction instead of three passes over the vocabulary (none
        # where the greedy choice read the maxima already)
        if not finite_max:
            rowmax = logits.amax(dim=-1)  # (n,) | (n, k)
            if not _finite(rowmax):
                bad = _flag(bad, _rows_any(~torch.isfinite(rowmax)), BAD_LOGITS)
        scored = True  # (finite: no need to look again below)
    else:
        assert proposal is not None
        if call.dtype is not None and proposal.dtype != call.dtype:
            raise fail(
                f"returned proposals of dtype {proposal.dtype}; the value holds {call.dtype}",
                R_DTYPE,
            )
        if call.vocab is not None and proposal.dim() > 2:
            # a token cell holds one number: (n,) or (n, k) candidates, nothing per cell beyond
            # (numeric values may hold vectors: the worker checks their cell shape)
            raise fail(
                f"returned proposals of shape {tuple(proposal.shape)} (rank {proposal.dim()}); "
                "expected (n,) or (n, k): one number per cell and candidate",
                R_RANK,
            )
        if call.vocab is not None:
            if (
                proposal.is_floating_point()
                or proposal.is_complex()
                or proposal.dtype == torch.bool
            ):
                raise fail(
                    f"returned proposals of dtype {proposal.dtype}; tokens (vocab={call.vocab}) "
                    "must be an integer dtype",
                    R_DTYPE,
                )
            proposal = proposal.to(torch.int64)
        if score is None:
            score = torch.zeros(proposal.shape[: min(proposal.dim(), 2)], device=proposal.device)
        elif (
            not score.is_floating_point()
            or score.dim() not in (1, 2)
            or (proposal.shape[: score.dim()] != score.shape)
        ):
            raise fail(
                f"returned score {score.dtype} {tuple(score.shape)} for proposals "
                f"{tuple(proposal.shape)}; expected a float tensor of shape (n,) or (n, k) "
                "matching the leading dims of 'proposal'",
                R_DTYPE
                if not score.is_floating_point()
                else R_RANK
                if score.dim() not in (1, 2)
                else R_SHAPE,
            )
        if proposal.is_floating_point() or proposal.is_complex():
            bad = _mark_nonfinite(bad, proposal, BAD_PROPOSAL)
        if call.vocab is not None:
            bad = _mark_outside(bad, proposal, call.vocab)
    if call.score is not None:
        proposal, score = rule_score(call, proposal, backend, worker)
        scored = False
    if not scored:
        bad = _mark_nonfinite(bad, score, BAD_SCORE)
    result = GroupResult(
        rule=call.rule,
        cells=call.cells,
        proposal=proposal,
        score=score,
        aux=aux,
        item_ids=call.item_ids,
        offsets=call.offsets,
    )
    return result, bad if bad is not None else _clean(n, device)


def rule_score(
    call: BatchedCall, proposal: Tensor, backend: str, worker: str
) -> tuple[Tensor, Tensor]:
    """The rule's own score of every proposal: (n, k) proposals and their float64 scores."""
    assert call.score is not None
    prop = proposal.unsqueeze(1) if proposal.dim() == 1 else proposal
    args = {k: call.inputs[k] for k in call.score_inputs if k in call.inputs}
    args["proposal"] = prop.clone()  # a score that writes into it cannot change the proposals
    try:
        with torch.no_grad():
            raw = call.score(args, epoch=call.keys.epoch)
        out = torch.as_tensor(raw)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit too: a score must not end the run
        raise ModelError(
            f"the score of rule '{call.rule}' raised {type(e).__name__}: {e}{user_frame(e)}",
            where=_where(call, backend, worker),
            code="R030",
        ) from e
    if out.device != prop.device:
        raise ModelError(
            f"the score of rule '{call.rule}' "
            + MSG_DEVICE.format(name="score", got=out.device, want=prop.device),
            where=_where(call, backend, worker),
            code=R_DEVICE,
            hint=HINT_DEVICE,
        )
    if out.shape != prop.shape[:2] or not out.is_floating_point():
        # (NaN/inf is a data fault: the per-row bitmask reports it, with no device sync here.)
        raise ModelError(
            f"the score of rule '{call.rule}' must be a float tensor of shape "
            f"{tuple(prop.shape[:2])} (cells, candidates), got {out.dtype} {tuple(out.shape)}",
            where=_where(call, backend, worker),
            code="R031",
        )
    return prop, out if out.dtype == torch.float64 else out.double()


def raise_if_bad(result: GroupResult, bad: Tensor, *, backend: str, worker: str) -> None:
    """Raise ModelError naming the faulty cells when the bitmask ``bad`` (host, (N,)) has a fault."""
    if _CLEAN.get((bad.shape[0], bad.device)) is bad:
        return  # (execute's bitmask of no fault)
    if not (bad.numpy().any() if bad.device.type == "cpu" else bool(bad.any())):
        return  # (on the host NumPy looks: a tensor op costs more between two forwards)
    rows = torch.nonzero(bad).flatten()
    kinds = 0
    for b in bad[rows].tolist():
        kinds |= int(b)
    what = ", ".join(text for bit, text in _BAD_TEXT.items() if kinds & bit)
    cells = result.cells
    raise ModelError(
        f"the model bound to rule '{result.rule}' returned {what} for {rows.numel()} of "
        f"{bad.numel()} cells",
        code=R_VOCAB if kinds == BAD_TOKEN else R_NONFINITE,
        where={
            "rule": result.rule,
            "cells": first_cells(cells, rows),
            "backend": backend,
            "worker": worker,
        },
    )
