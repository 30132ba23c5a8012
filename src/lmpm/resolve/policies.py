"""Commit policies: how the candidates of a cell agree on a winner. An extensible registry.

Every policy sees all candidates of all open cells at once (tensors), never a Python loop per cell.
Column 0 of every candidate tensor is *keep current* (the committed payload, or unset). Ties break
deterministically by the lowest candidate column, so keep-current wins every tie.

Policies run on the control plane, which holds metadata only: a policy sees each candidate's score,
validity, constraint verdicts and a payload *checksum* (equal payloads have equal checksums), never
the payload itself. A policy that aggregates payload (``average``) says so with per-column weights in
its :class:`Decision`; the worker holding the payload computes the aggregate.

Add a policy::

    from lmpm.resolve.policies import register, Agree, Decision

    @register("my_policy")
    def my_policy(a: Agree, *args) -> Decision:
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import BindError
from lmpm.ir.link import Of


@dataclass(slots=True)
class Agree:
    """The candidates of ``n`` open cells. C = 1 (keep) + all proposals; K = constraints."""

    checksum: Tensor  # (n, C) int64 payload checksum: equal payloads, equal checksums
    valid: Tensor  # (n, C) bool: the candidate exists (padding is False; keep is always True)
    score: Tensor  # (n, C) float64; keep's score is the committed score (-inf when unset)
    violated: Tensor  # (n, C, K) bool
    levels: Levels  # the constraints' priorities (host values, built once per value)
    rule: Tensor  # (C,) int64 rule index of each column; -1 for keep
    replica: Tensor  # (C,) int64 quorum replica of each column; -1 for keep
    slot: Tensor  # (C,) int64 proposal slot within its rule (replicas share slots); -1 for keep
    numeric: bool = False  # the value's payload is numeric (Float, Tensor[D]): it can be averaged


@dataclass(frozen=True, slots=True)
class Levels:
    """The priorities of a value's K constraints, as the policies read them: host values built
    once per value (:func:`levels`), never read from a tensor per call, so a policy traces
    under fake tensors (the compiled step, :mod:`lmpm.runtime.data.compiled`, calls the policies
    themselves)."""

    priority: tuple[int, ...]  # per constraint
    # (K,) float64 on the candidates' device: minus the weight of one violation of each
    # constraint in a packed key (:func:`_packed_weights`); None when K < 2 or it does not fit
    key: Tensor | None


def levels(priority: tuple[int, ...], device: torch.device) -> Levels:
    """``priority``'s :class:`Levels` with a fresh key on ``device`` (what a traced step builds
    inside its graph). Eager callers use :func:`levels_of`."""
    key = _packed_weights(priority) if len(priority) > 1 else None
    if key is None:
        return Levels(priority, None)
    return Levels(priority, host_tensor(key, torch.float64, device))


def host_tensor(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A (len(values),) tensor of host values built by factory operations (one ``full`` each,
    stacked), not copied from a host list: traced, it is computed inside the graph rather than
    held as a tensor constant (a compiled step's graph is called with its inputs alone)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values])


@lru_cache(maxsize=256)
def levels_of(priority: tuple[int, ...], device: torch.device) -> Levels:
    """:func:`levels`, built once per priorities and device (shared between calls: never
    written)."""
    return levels(priority, device)


@dataclass(slots=True)
class Decision:
    """A policy's verdict. ``winner`` 0 keeps the cell; with ``weights`` (aggregating policies) a
    cell whose winner is not 0 commits ``sum_c w[c] * candidate[c] / sum_c w[c]``, which the worker
    computes (the control plane never sees payload)."""

    winner: Tensor  # (n,) int64 column index; 0 = keep current
    weights: Tensor | None = None  # (n, C) float64 aggregation weights, or None: take the winner


Policy = Callable[..., Decision]
POLICIES: dict[str, Policy] = {}


def register(name: str) -> Callable[[Policy], Policy]:
    def deco(fn: Policy) -> Policy:
        POLICIES[name] = fn
        return fn

    return deco


# Policies run every epoch on tensors that may be tiny (one open cell), where each operation's fixed
# cost dominates: they use the cheapest equivalent forms (gather, amax, a uint8 view of a bool).


def best_by_score(score: Tensor, eligible: Tensor) -> Tensor:
    """Column with the highest score among eligible ones; ties → lowest column; 0 when none is
    eligible. (n,) int64. Scores are never NaN (the workers reject a NaN score); an eligible
    -inf (keep-current of an unset cell) ranks as the lowest finite number, above every
    ineligible column."""
    s = torch.where(eligible, score.clamp(min=torch.finfo(score.dtype).min), -torch.inf)
    return s.argmax(dim=1)  # the first of equal maxima: the lowest column among the tied best


def lexicographic(a: Agree, eligible: Tensor) -> Tensor:
    """Narrow ``eligible`` level by level: most constraints satisfied at the highest priority first."""
    k = a.violated.shape[2]
    if k == 0:
        return eligible
    if k == 1:
        ok = eligible > a.violated.squeeze(2)  # eligible and not violated (bools: a > b is a & ~b)
        return torch.where(ok.any(dim=1, keepdim=True), ok, eligible)
    if a.levels.key is not None:
        # one key per candidate, ordered as the levels order them: keep the eligible maxima
        # (exact: a sum of distinct powers of two below 2**53, in any order)
        key = torch.where(a.violated, a.levels.key, 0.0).sum(dim=2)  # (n, C)
        key = torch.where(eligible, key, -torch.inf)
        return eligible & (key == key.amax(dim=1, keepdim=True))
    sat = ~a.violated  # (n, C, K)
    priority = a.levels.priority
    for prio in sorted(set(priority), reverse=True):
        ks = [j for j, p in enumerate(priority) if p == prio]
        if len(ks) == 1:
            # One constraint: the eligible candidates satisfying it, if a cell has any.
            ok = eligible & sat.select(2, ks[0])
            eligible = torch.where(ok.any(dim=1, keepdim=True), ok, eligible)
            continue
        count = torch.where(eligible, sat[:, :, ks].sum(dim=2), -1)  # (n, C) satisfied
        # amax: an integer amin is many times slower in torch's CPU kernels
        eligible = eligible & (count == count.amax(dim=1, keepdim=True))
    return eligible


def _packed_weights(priority: tuple[int, ...]) -> tuple[float, ...] | None:
    """Per constraint, minus the weight of one violation of it in a packed key.

    Each priority level owns a bit field wide enough for its count of violations, the highest
    level in the top bits, so the integer order of ``sum violated * -weight`` is the lexicographic
    order of (violations at the highest level, ..., at the lowest), reversed: the largest key has
    the fewest. Exact in float64 while the fields fit in 53 bits (None otherwise: loop the levels)."""
    shift: dict[int, int] = {}
    bits = 0
    for prio in sorted(set(priority)):  # the lowest level in the lowest bits
        shift[prio] = bits
        bits += priority.count(prio).bit_length()
    if bits > 53:
        return None
    return tuple(-float(1 << shift[p]) for p in priority)


@register("satisfy")
def satisfy(a: Agree, mode: str = "max_constraints_then_score", *_: Any) -> Decision:
    """Lexicographic: satisfied constraints from the highest priority down, then score, then column."""
    if mode not in ("max_constraints_then_score",):
        raise BindError(
            f"satisfy({mode}) is not a known mode; use satisfy(max_constraints_then_score)",
            code="B030",
        )
    eligible = lexicographic(a, a.valid)  # never written in place
    return Decision(best_by_score(a.score, eligible))


@register("winner_takes_all")
def winner_takes_all(a: Agree, *_: Any) -> Decision:
    """The highest-scoring proposal wins whatever the constraints say (they are still traced)."""
    proposals = a.valid.clone()
    proposals.select(1, 0).fill_(False)  # (a scalar fill: no tensor constant when traced)
    any_prop = proposals.any(dim=1)
    winner = best_by_score(a.score, proposals)
    winner = torch.where(any_prop, winner, torch.zeros_like(winner))
    return Decision(winner)


@register("average")
def average(a: Agree, *_: Any) -> Decision:
    """Numeric values: the mean of the valid proposals (keep when a cell has none). The mean is
    computed by the worker from the weights (1 per valid proposal)."""
    if not a.numeric:
        raise BindError(
            "average() needs a numeric value (Float, Tensor[D]); this value holds tokens",
            code="B031",
            hint="use satisfy(max_constraints_then_score) for tokens",
        )
    proposals = a.valid.clone()
    proposals.select(1, 0).fill_(False)  # (a scalar fill: no tensor constant when traced)
    has = proposals.any(dim=1)
    # the first valid proposal names the winning rule (provenance); the payload is the mean
    winner = torch.where(has, proposals.view(torch.uint8).argmax(dim=1), 0)
    return Decision(winner, proposals.to(torch.float64))


@register("quorum")
def quorum(a: Agree, k: int | Of = 2, inner: Any = "satisfy", *inner_args: Any) -> Decision:
    """A proposal is eligible only if ≥ k replicas of its rule proposed the same payload (checksum).
    ``quorum(k, ...)`` runs k replicas; ``quorum(k of n, ...)`` (``k`` an :class:`Of`) runs n
    replicas, on n different workers when the run has that many (lmpm.resolve.topology)."""
    if isinstance(k, Of):
        k = k.k
    eligible = quorum_eligible(a.checksum, a.valid, a.rule, a.slot, int(k))
    inner_name, args = inner, inner_args
    if isinstance(inner, tuple):  # a nested call: (name, args)
        inner_name, args = inner[0], tuple(inner[1])
    fn = get_policy(str(inner_name))
    narrowed = Agree(
        a.checksum, eligible, a.score, a.violated, a.levels, a.rule, a.replica, a.slot, a.numeric
    )
    return fn(narrowed, *args)


def quorum_eligible(checksum: Tensor, valid: Tensor, rule: Tensor, slot: Tensor, k: int) -> Tensor:
    """(n, C) bool: the valid candidates whose payload (checksum) ``k`` or more replicas of the
    same rule proposed in the same slot, and keep-current (rule -1). ``checksum``/``valid``
    (n, C); ``rule``/``slot`` (C,)."""
    same = checksum[:, :, None] == checksum[:, None, :]  # (n, C, C)
    same &= (rule[:, None] == rule[None, :]) & (slot[:, None] == slot[None, :])
    same &= valid[:, None, :]
    votes = same.sum(dim=2)  # (n, C)
    return valid & ((votes >= k) | (rule == -1)[None, :])


def quorum_lost(checksum: Tensor, valid: Tensor, rule: Tensor, slot: Tensor, k: int) -> Tensor:
    """(n,) bool: the cells where some replica proposed but no proposed payload had its ``k``
    votes (:func:`quorum_eligible`'s arguments): why such a cell stays unset (NO_QUORUM)."""
    agreed = quorum_eligible(checksum, valid, rule, slot, k)
    return valid[:, 1:].any(dim=1) & ~agreed[:, 1:].any(dim=1)


def quorum_k(policy: Policy, args: tuple[Any, ...]) -> int | None:
    """The votes a payload needs under ``policy(args)``: k of ``quorum(k ...)``, else None."""
    if policy is not quorum:
        return None
    k = args[0] if args else 2
    return k.k if isinstance(k, Of) else int(k)


# Policies whose payload is an aggregate of the proposals (the worker computes it from weights):
# a proposal equal to the committed payload is a proposal like any other for them, not folded
# into keep-current.
AGGREGATING: set[str] = {"average"}


def aggregates(policy: Policy, args: tuple[Any, ...]) -> bool:
    """Does ``policy(args)`` aggregate payload (average, or quorum over average)?"""
    name = next((n for n, f in POLICIES.items() if f is policy), None)
    if name in AGGREGATING:
        return True
    if name == "quorum" and len(args) > 1:
        inner = args[1][0] if isinstance(args[1], tuple) else args[1]
        return str(inner) in AGGREGATING
    return False


def replicas(policy: Policy, args: tuple[Any, ...]) -> int:
    """Replicas per rule of a value committed by ``policy(args)``: k for ``quorum(k)``, n for
    ``quorum(k of n)``, else 1."""
    if policy is not quorum:
        return 1
    k = args[0] if args else 2
    return max(k.n if isinstance(k, Of) else int(k), 1)


def spread(policy: Policy, args: tuple[Any, ...]) -> int:
    """Workers a value's replicas want, one replica each: n for ``quorum(k of n)`` (n > 1), else
    1 (``quorum(k)`` keeps its k replicas on the worker that owns the cell)."""
    if policy is not quorum or not args or not isinstance(args[0], Of):
        return 1
    return max(args[0].n, 1)


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise BindError(
            f"unknown commit policy `{name}`",
            code="B032",
            hint="policies: " + ", ".join(sorted(POLICIES)),
        ) from None


# Names bound in bindings.BUILTINS point here.
__all__ = [
    "AGGREGATING",
    "POLICIES",
    "Agree",
    "Decision",
    "Levels",
    "Of",
    "aggregates",
    "average",
    "get_policy",
    "host_tensor",
    "levels",
    "levels_of",
    "quorum",
    "register",
    "replicas",
    "satisfy",
    "spread",
    "winner_takes_all",
]
