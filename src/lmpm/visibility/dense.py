"""Dense masks (small sizes, tests, pictures) and the SDPA fallback that never emits NaN.

``dense_mask`` builds the (cells, cells) bool matrix straight from the clause boxes: per box, a
per-axis membership test ``lo <= k <= hi`` of every source coordinate, combined by an outer AND
over the axes — O(cells²) memory, which is the point of a dense mask, so callers keep it small.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lmpm.visibility._stencil import Boxes, Space
from lmpm.visibility.layout import Layout


def box_rows(boxes: Boxes, source_dims: tuple[int, ...]) -> Tensor:
    """(target_cells, source_cells) bool: the union of ``boxes`` as dense rows (canonical order)."""
    n = boxes.ok.shape[1]
    s = math.prod(source_dims)
    out = torch.zeros((n, s), dtype=torch.bool)
    for b in range(boxes.count):
        rows = boxes.ok[b].clone()  # (n,)
        member: Tensor | None = None  # (n, d0, d1, ...) built one axis at a time
        for a, size in enumerate(source_dims):
            k = torch.arange(size)
            m_a = (boxes.lo[b, :, a, None] <= k) & (k <= boxes.hi[b, :, a, None])  # (n, d_a)
            if member is None:
                member = m_a
            else:
                member = member.unsqueeze(-1) & m_a.view(n, *([1] * (member.dim() - 1)), size)
        if member is None:
            continue
        out |= member.reshape(n, s) & rows.unsqueeze(1)
    return out


def dense_mask(sp: Space, boxes: list[Boxes], layout: Layout | None = None) -> Tensor:
    """(cells, cells) bool; ``mask[q, k]`` iff cell k is visible to cell q. Canonical order unless
    a ``layout`` is given (then rows and columns are layout positions)."""
    mask = torch.zeros((sp.cells, sp.cells), dtype=torch.bool)
    for bx in boxes:
        t0, s0 = sp.base[bx.target], sp.base[bx.source]
        nt, ns = sp.size(bx.target), sp.size(bx.source)
        mask[t0 : t0 + nt, s0 : s0 + ns] |= box_rows(bx, sp.dims[bx.source])
    if layout is not None and layout.to_canon is not None:
        # mask_layout[p, r] = mask_canon[to_canon[p], to_canon[r]]
        mask = mask[layout.to_canon][:, layout.to_canon]
    return mask


def sdpa(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, **kwargs: object) -> Tensor:
    """``scaled_dot_product_attention`` with a bool ``mask`` (True = may attend).

    A query row whose mask is all False returns **zeros** (not NaN), like FlexAttention does for a
    fully masked row: such rows are computed against an all-True mask (so softmax is finite) and
    then zeroed. ``mask`` broadcasts like SDPA's ``attn_mask``: (..., L, S).

    >>> q = k = v = torch.ones(1, 1, 2, 4)
    >>> sdpa(q, k, v, torch.tensor([[False, False], [True, False]]))[0, 0].tolist()
    [[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    """
    empty = ~mask.any(-1, keepdim=True)  # (..., L, 1)
    safe = mask | empty
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=safe, **kwargs)  # type: ignore[arg-type]
    return out.masked_fill(empty, 0.0)
