"""IR expressions over tensors of coordinates, for the runtime (triggers, constraint cell masks).

The evaluator itself is the visibility compiler's (:mod:`lmpm.visibility.expr`): one tensor
evaluator for stencils, ``mask_mod`` and the runtime, so guards mean the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lmpm.ir.nodes import Expr
from lmpm.visibility.expr import Val
from lmpm.visibility.expr import evaluate as eval_tensor

__all__ = ["coords", "eval_tensor", "mask_of"]


def mask_of(e: Expr, env: Mapping[str, Val], n: int) -> Tensor:
    """A bool mask of shape (n,) from a guard (broadcasting scalars)."""
    out = eval_tensor(e, env)
    if not isinstance(out, Tensor):
        return torch.full((n,), bool(out), dtype=torch.bool)
    out = out.bool()
    return out.expand(n).clone() if out.dim() == 0 else out


def coords(dims: tuple[int, ...]) -> Tensor:
    """Row-major coordinates of every cell, shape (cells, rank), int64."""
    if not dims:
        return torch.zeros(1, 0, dtype=torch.int64)
    grids = torch.meshgrid(*(torch.arange(d, dtype=torch.int64) for d in dims), indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], dim=1)
