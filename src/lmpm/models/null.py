"""Null models: proposals that ignore their inputs (benchmarks, tests, smoke runs).

``Uniform`` returns flat logits, so the worker draws every token with equal probability from the
counter-based RNG: the proposals are a pure function of (seed, value, cell, epoch, rule, replica).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def uniform_logits(
    inputs: dict[str, Tensor], *, vocab: int | None = None, k: int = 1, **_: Any
) -> dict[str, Tensor]:
    """Flat logits over the vocabulary: ``k`` uniformly random proposals per cell."""
    if vocab is None:
        raise ValueError("Uniform needs a token value (a vocabulary)")
    n = inputs["cells"].shape[0]
    shape = (n, vocab) if int(k) == 1 else (n, int(k), vocab)
    return {"logits": torch.zeros(shape, device=inputs["cells"].device)}


def zero_score(inputs: dict[str, Tensor], **_: Any) -> Tensor:
    """Score every candidate 0 (ties then break by candidate order)."""
    prop = inputs["proposal"]
    return torch.zeros(prop.shape[:2], dtype=torch.float64, device=prop.device)


def random_tokens(
    inputs: dict[str, Tensor],
    *,
    vocab: int | None = None,
    k: int = 1,
    seed: int = 0,
    epoch: int = 0,
    **_: Any,
) -> dict[str, Tensor]:
    """``k`` uniformly random tokens per cell straight from the counter-based RNG, score 0.

    The cheapest possible proposer: what benchmarks use to measure the control plane alone.
    """
    from lmpm.workers import rng

    if vocab is None:
        raise ValueError("RandomTokens needs a token value (a vocabulary)")
    cells = inputs["cells"]
    bits = rng.bits(seed, "null", cells, epoch, "RandomTokens", draws=int(k))  # (n, k) int64
    prop = torch.remainder(bits, vocab)
    return {
        "proposal": prop,
        "score": torch.zeros(prop.shape, dtype=torch.float64, device=prop.device),
    }
