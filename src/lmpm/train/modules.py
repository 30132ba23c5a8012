"""Module and loss bindings for ``Params`` values, and how a module's parameters become cells.

``value Theta : Params[ByteLM] shape Tensors()`` builds the module bound as ``ByteLM``; its cells
are the parameter tensors in ``named_parameters()`` order (``Tensors()``) or its blocks
(``Blocks()``: the top-level children, a ``ModuleList``/``Sequential`` counted per element).
A loss binding is ``loss(module, *data) -> (mean loss, tokens)``; ``data`` are (batch, length)
long tensors, one per data argument of the ``minimize`` call.

>>> m = MODULES["ByteLM"]()
>>> [name for name, _ in cells(m, "blocks")]
['tok', 'pos', 'blocks.0', 'blocks.1', 'norm', 'head']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

# The shipped byte model's architecture (scripts/train_text.py writes weights of this shape).
BYTELM_CONFIG: dict[str, Any] = {"d": 64, "layers": 2, "heads": 4, "max_len": 64}


def _bytelm() -> nn.Module:
    from lmpm.models.text import ByteLM

    return ByteLM(**BYTELM_CONFIG)


def next_byte_loss(module: nn.Module, data: Tensor) -> tuple[Tensor, int]:
    """Cross-entropy (nats per byte) of predicting each byte of ``data`` (B, L) from the ones
    before it."""
    from lmpm.models.text import BYTES

    logits = module(data)
    return F.cross_entropy(logits.reshape(-1, BYTES), data.reshape(-1)), int(data.numel())


MODULES: dict[str, Callable[[], nn.Module]] = {"ByteLM": _bytelm}
LOSSES: dict[str, Callable[..., tuple[Tensor, int]]] = {"NextByteLoss": next_byte_loss}


def cells(m: nn.Module, granularity: str) -> list[tuple[str, list[int]]]:
    """(cell name, indices into ``list(m.parameters())``) for each cell, in parameter order."""
    names = [n for n, _ in m.named_parameters()]
    if granularity == "tensors":
        return [(n, [i]) for i, n in enumerate(names)]
    seq = {n for n, c in m.named_children() if isinstance(c, nn.ModuleList | nn.Sequential)}
    out: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        parts = n.split(".")
        key = ".".join(parts[:2]) if parts[0] in seq and len(parts) > 2 else parts[0]
        out.setdefault(key, []).append(i)
    return list(out.items())
