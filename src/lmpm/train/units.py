"""The one unit a training run's loss is shown in: bits per token (a byte for the byte model).

The workers compute cross-entropy in nats (``torch.nn.functional.cross_entropy``) and the log
stores nats; every view of a loss — `lmpm run`'s progress and summary, `lmpm top`, `lmpm trace`,
`lmpm render`'s loss.png — converts with :func:`bits`, so the same run reads the same everywhere.

>>> round(bits(math.log(2)), 6)
1.0
"""

from __future__ import annotations

import math

UNIT = "bits/token"  # the label the views print beside a loss


def bits(nats: float) -> float:
    """A loss in nats per token as bits per token."""
    return nats / math.log(2)


def fmt(nats: float | None) -> str:
    """A loss for people: bits per token, 4 decimals ("-" when there is none)."""
    return "-" if nats is None else f"{bits(nats):.4f}"
