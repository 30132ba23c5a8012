"""Choosing tokens from a model's logits: the vocabulary mask, the top k, the draws.

A model that returns logits leaves the choice of tokens to the worker (docs/backends.md, "What the
model returns"). Before it chooses, the worker narrows each row's tokens with the value's static
set constraints, lowered by the resolver into a :class:`~lmpm.workers.base.VocabMask`
(:mod:`lmpm.resolve.masks`): of the tokens the model allows (finite logits) it keeps those the
commit policy ``satisfy(max_constraints_then_score)`` would rank first. The greedy choice (``top``,
k=1) among them is then the candidate that policy would commit out of all V tokens, so one
candidate decides what V would.

Example:
    >>> import torch
    >>> from lmpm.workers.base import MaskSets, VocabMask
    >>> sets = MaskSets(torch.tensor([[True, False, True]]), levels=((0,),))
    >>> mask = VocabMask(sets, applies=torch.tensor([[True], [False]]))
    >>> allowed(torch.zeros(2, 3), mask).tolist()
    [[True, False, True], [True, True, True]]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lmpm.workers.base import VocabMask

__all__ = [
    "allowed",
    "alone_column",
    "argmax_rows",
    "choose",
    "greedy",
    "greedy_rows",
    "keep_column",
    "masked",
]


def allowed(logits: Tensor, mask: VocabMask) -> Tensor:
    """(n, V) bool: the tokens of each row the mask keeps (rows of ``logits`` are the mask's rows).

    Only tokens the model allows (a logit above ``-inf``) count. The hard constraints go first: a
    token that violates one is never eligible (when every token does, no proposal can win and
    the row is left as it is). Then each priority level, highest first, keeps the tokens that
    satisfy the most of its constraints: exactly the ranking of ``satisfy``'s lexicographic
    policy, so the tokens left are those it would rank first (a level no token of a row satisfies
    leaves that row as it is: the policy would not narrow it either)."""
    sets = mask.sets
    keep = logits > -torch.inf  # (n, V); NaN is not allowed either
    ok = sets.ok.to(logits.device)
    applies = mask.applies
    if sets.hard:
        eligible = keep.clone()
        for s in sets.hard:
            eligible &= ok[s] | ~applies[:, s : s + 1]
        keep = torch.where(eligible.any(dim=1, keepdim=True), eligible, keep)
    for level in sets.levels:
        if len(level) == 1:
            s = level[0]
            sat = keep & (ok[s] | ~applies[:, s : s + 1])
            keep = torch.where(sat.any(dim=1, keepdim=True), sat, keep)
            continue
        count = torch.zeros(keep.shape, dtype=torch.int16, device=keep.device)
        for s in level:
            count += ok[s] | ~applies[:, s : s + 1]
        count = torch.where(keep, count, -1)
        keep = keep & (count == count.amax(dim=1, keepdim=True))
    return keep


def masked(logits: Tensor, mask: VocabMask | None) -> Tensor:
    """``logits`` with ``-inf`` where the mask drops a token: ``(n, V)`` or ``(n, k, V)`` (the k
    distributions of a cell share its mask)."""
    if mask is None:
        return logits
    if logits.dim() == 2 and logits.device.type == "cpu" and bool(mask.applies.all()):
        # Where a row's allowed tokens include one that satisfies every constraint, each step of
        # ``allowed`` narrows to those tokens: the mask is one fill of the tokens some constraint
        # refuses. (A NaN left in such a row makes its max NaN: the general path then runs.)
        # Host tensors only: on an accelerator the check below would wait for the device.
        # (Adding 0 / -inf: a +inf logit on a refused token turns NaN, which also falls back.)
        fast = logits + mask.sets.bias.to(logits.dtype)
        if bool((fast.amax(dim=1) > -torch.inf).all()):
            return fast
    if logits.dim() == 3:
        n, k, v = logits.shape
        rows = VocabMask(
            mask.sets, mask.applies.repeat_interleave(k, dim=0), None
        )  # one row per (cell, distribution)
        keep = allowed(logits.reshape(n * k, v), rows).reshape(n, k, v)
    else:
        keep = allowed(logits, mask)
    return torch.where(keep, logits, -torch.inf)


def choose(
    logits: Tensor,
    k: int,
    pick: str,
    temperature: float,
    gumbel: Callable[[int], Tensor],
    mask: VocabMask | None,
) -> Tensor:
    """(n, k) int64: the tokens chosen from ``logits`` (n, V) after the mask, best first.

    ``top``: the k highest logits, ties to the lower token id. ``sample``: Gumbel-top-k, the k
    highest of ``logits / temperature`` plus the Gumbel noise ``gumbel(V)`` (n, V) (draw j is token
    j's noise, so k=1 is the plain Gumbel-max draw of the same key). ``-inf`` logits are never
    chosen; a row with fewer than k tokens left repeats its first choice."""
    vocab = logits.shape[-1]
    key = masked(logits, mask)
    if pick == "sample":  # (float64: the noise is added at full precision)
        key = key.to(torch.float64) / float(temperature) + gumbel(vocab)  # -inf stays -inf
    k = min(int(k), vocab)
    if k == 1:
        return argmax_rows(key).unsqueeze(1)  # the first of equal maxima: the lower id
    # a stable sort keeps equal keys in token order (topk does not promise any order for ties)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    left = (key > -torch.inf).sum(dim=1, keepdim=True)  # (n, 1) tokens that can be chosen
    slot = torch.arange(k, device=key.device)
    return torch.where(slot < left, order, order[:, :1])


_FEW = 64  # rows whose greedy choice is checked as Python numbers rather than tensor ops
_NUMPY_ARGMAX = (torch.float32, torch.float64, torch.float16)


def argmax_rows(t: Tensor) -> Tensor:
    """(n,) int64: the first of the highest entries of each row of ``t`` (n, V); a NaN counts as
    the highest (the first NaN), as ``torch.argmax`` does. On the host NumPy's vectorised argmax
    takes it (torch's on CPU compares one element at a time: ~10x slower at V = 50257)."""
    if t.device.type == "cpu" and t.dtype in _NUMPY_ARGMAX and t.dim() == 2 and t.shape[1]:
        return torch.from_numpy(t.detach().numpy().argmax(axis=1).astype(np.int64, copy=False))
    return t.argmax(dim=1)


def greedy(logits: Tensor, mask: VocabMask) -> tuple[Tensor, Tensor]:
    """``(choose(logits, 1, "top", ..., mask), the model alone's favourite (n,))``: the greedy
    choice under the mask and without it, as the worker needs both (:func:`alone_column`).

    Where a row's favourite (the first of its highest logits) satisfies every constraint, it is
    also the first of the highest logits the mask keeps (the mask keeps it, and keeps nothing
    higher): the row needs no mask. Only when some row's favourite is refused does the mask run.
    """
    alone = argmax_rows(logits)  # (n,) the first of each row's maxima
    if logits.device.type == "cpu":  # (on an accelerator the check would wait for the device)
        best = logits.gather(1, alone.unsqueeze(1)).squeeze(1)  # NaN fails the tests below
        if alone.numel() <= _FEW:  # a few rows: looked up as numbers
            drop = mask.sets.drop_host
            kept = all(
                b > -math.inf and not drop[i]
                for b, i in zip(best.tolist(), alone.tolist(), strict=True)
            )
        else:
            kept = bool(((best > -torch.inf) & ~mask.sets.drop[alone]).all())
        if kept:
            return alone.unsqueeze(1), alone

    def no_noise(vocab: int) -> Tensor:
        raise AssertionError("the greedy choice draws no noise")

    return choose(logits, 1, "top", 1.0, no_noise, mask), alone


class Greedy(NamedTuple):
    """The worker's greedy choice of each row (:func:`greedy_rows`)."""

    proposal: Tensor  # (n, 1) int64, or with a mask (n, 2): the choice, then the model alone's
    finite: bool  # every row's highest logit is finite (as ``logits.amax(-1)`` would say)
    tokens: list[int]  # each row's choice as a number (every column of its row holds it)


def greedy_rows(logits: Tensor, mask: VocabMask | None) -> Greedy | None:
    """``choose(logits, 1, "top", ...)``, and with a mask :func:`greedy` then
    :func:`alone_column`, in one step for a few rows of float logits on the host whose
    favourites the mask keeps (the decode step of a language model): the argmax and the look-ups
    in NumPy, no tensor op besides. None where that does not hold (the caller then takes the
    general path).

    The favourite's logit is the row's max (a NaN one: NumPy's argmax, like torch's, picks the
    first NaN), so it also says whether every row's max is finite, as the worker's check of the
    logits asks (one pass over the vocabulary less)."""
    n = logits.shape[0]
    if not (
        logits.device.type == "cpu"
        and logits.dtype in _NUMPY_ROWS
        and logits.dim() == 2
        and logits.shape[1]
        and n <= _FEW
    ):
        return None
    table = (logits.detach() if logits.requires_grad else logits).numpy()  # (n, V), a view
    if n == 1:  # one row (the decode step): its flat argmax, read as numbers
        t = int(table.argmax())
        b = table.item(t)
        if mask is not None and not (b > -math.inf and not mask.sets.drop_host[t]):
            return None
        top = np.array([[t] if mask is None else [t, t]], dtype=np.int64)
        return Greedy(torch.from_numpy(top), math.isfinite(b), [t])
    alone = table.argmax(axis=1)  # (n,) the first of each row's maxima
    tokens = alone.tolist()
    best = table[np.arange(n), alone].tolist()
    if mask is not None:
        drop = mask.sets.drop_host
        if not all(b > -math.inf and not drop[i] for b, i in zip(best, tokens, strict=True)):
            return None
    # (n, 1), or (n, 2) beside the model alone's choice, which is the same token
    top = np.array([[t, t] if mask is not None else [t] for t in tokens], dtype=np.int64)
    finite = all(math.isfinite(b) for b in best)
    return Greedy(torch.from_numpy(top), finite, tokens)


_NUMPY_ROWS = (torch.float32, torch.float64)


def keep_column(proposal: Tensor, logits: Tensor, mask: VocabMask | None) -> Tensor:
    """``proposal`` (n, k) with one more column when the mask carries committed tokens: the row's
    committed token where the model allows it (it folds into keep-current, which is then scored
    afresh, as when all V tokens are candidates), else the row's first choice again (a duplicate
    never changes a winner)."""
    if mask is None or mask.current is None:
        return proposal
    cur = mask.current
    allows = logits.gather(1, cur.clamp(min=0).unsqueeze(1)).squeeze(1) > -torch.inf
    extra = torch.where((cur >= 0) & allows, cur, proposal[:, 0])
    return torch.cat((proposal, extra.unsqueeze(1)), dim=1)


def alone_column(proposal: Tensor, alone: Tensor) -> Tensor:
    """``proposal`` (n, k) with one more column: ``alone`` (n,), the token the model would have
    chosen without the mask, where it differs from the first choice, else the first choice again.

    The lowered constraints stay visible in the trace: a favourite the mask kept out is checked
    like any candidate, violates the constraints that excluded it and loses to the first choice,
    so the trace attributes the decision to them as it does for k = V. It never changes a winner:
    the first choice is what the policy commits out of all V tokens, the favourite among them."""
    # (where the favourite is the first choice, the extra column is that choice again: in both
    # cases it is the favourite)
    return torch.cat((proposal, alone.unsqueeze(1)), dim=1)
