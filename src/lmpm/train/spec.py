"""What a training program asks for, as the training runtime reads it (built from the checked IR).

A training program is an LMPM program with a ``Params[Module]`` value: its cells are the parameter
tensors (``shape Tensors()``) or the top-level blocks (``shape Blocks()``) of the bound module. One
rule proposes new parameters with ``minimize(Loss(P, data...), steps=H, ...)``; constraints on the
parameters are ``forbid change(P[...])`` (freeze) and ``require NormAtMost(P[...], R)`` (a norm
bound); the commit policy is ``diloco(outer_lr, momentum)``, ``average`` or
``satisfy(max_constraints_then_score)`` (the best-scoring valid replica).

>>> ParamsSpec("Theta", "ByteLM", "tensors").granularity
'tensors'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lmpm.errors import Span

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True, slots=True)
class ParamsSpec:
    """``value NAME : Params[MODULE] shape Tensors()|Blocks()``."""

    name: str
    module: str  # a module binding (lmpm.train.modules): ByteLM, ...
    granularity: Literal["tensors", "blocks"]
    span: Span | None = None


@dataclass(frozen=True, slots=True)
class DataSpec:
    """A token value a loss reads: rows of ``length`` tokens (``Seq(N)`` is one row; ``Grid2D(L, R)``
    is R rows of L tokens). Workers take disjoint row shards."""

    name: str
    arg: str  # the read's name in the rule (`read {data = Corpus[*]}` → "data")
    length: int
    rows: int
    vocab: int


@dataclass(frozen=True, slots=True)
class MinimizeSpec:
    """``emit proposal P[*] := minimize(LOSS(P, data...), steps=H, batch=B, optimizer="adamw", ...)``
    with an optional ``score LOSS(P, held...)`` (the held-out loss: lower is better)."""

    rule: str
    loss: str  # a loss binding (lmpm.train.modules): NextByteLoss, ...
    data: tuple[DataSpec, ...]  # the loss's data arguments, in order
    steps: int  # H: inner optimizer steps per epoch (outer step)
    batch: int  # rows per inner step per worker
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only
    clip: float | None = None  # global grad-norm clip
    schedule: Literal["constant", "cosine"] = "constant"  # cosine over the run's epochs × steps
    warmup: int = 0  # inner steps of linear warm-up
    seed: int = 0
    eval_loss: str | None = None  # the score's loss binding
    eval_data: tuple[DataSpec, ...] = ()
    span: Span | None = None


@dataclass(frozen=True, slots=True)
class ParamConstraint:
    """``forbid change(P[sel])`` (kind freeze) or ``require NormAtMost(P[sel], bound)`` (kind norm).
    ``select`` holds fnmatch patterns over the cell names; ``("*",)`` is every cell."""

    name: str
    kind: Literal["freeze", "norm"]
    select: tuple[str, ...]
    priority: int
    bound: float | None = None
    span: Span | None = None


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """The commit policy of the Params value."""

    kind: Literal["diloco", "average", "best"]
    outer_lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True


@dataclass(frozen=True, slots=True)
class TrainSpec:
    params: ParamsSpec
    rule: MinimizeSpec
    policy: PolicySpec
    constraints: tuple[ParamConstraint, ...] = field(default=())
    file: str = "<input>"
