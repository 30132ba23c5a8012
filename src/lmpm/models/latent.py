"""Models and predicates of the latent-vector example (``examples/latent.lmpm``): ``Tensor[D]``
cells, one D-dimensional latent vector each.

- ``Amplify(nb, k=K)``: K candidates per cell, the mean of its committed neighbours scaled by
  1, 1.5, 2, ... plus a little counter-based noise. The score is the candidate's norm: left alone
  the model prefers ever larger vectors; a norm constraint is what keeps them bounded.
- ``NormAtMost(Z[x, y], R)``: the predicate "the candidate's Euclidean norm is at most R".
- ``Copy(own)``: the read cell's vector, one candidate.
- ``BoxMean(around)``: the mean of the committed vectors read, one candidate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lmpm.workers import rng

if TYPE_CHECKING:
    from lmpm.runtime.records import PredicateInput


def _mean(data: Tensor, mask: Tensor) -> Tensor:
    """(n, K, D) vectors, (n, K) mask -> (n, D) mean of the masked ones (0 where none)."""
    w = mask.to(data.dtype).unsqueeze(2)
    return (data * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)


def amplify(
    inputs: dict[str, Tensor], *, k: int = 4, seed: int = 0, epoch: int = 0, **_: Any
) -> dict[str, Tensor]:
    data = next(v for n, v in inputs.items() if v.dim() == 3 and not n.endswith("_index"))
    name = next(n for n, v in inputs.items() if v is data)
    mean = _mean(data, inputs[f"{name}_mask"])  # (n, D)
    n, d = mean.shape
    scale = 1.0 + 0.5 * torch.arange(int(k), dtype=mean.dtype, device=mean.device)  # (k,)
    u = rng.uniform(seed, "latent", inputs["cells"], epoch, "Amplify", draws=int(k) * d)
    noise = (u.to(mean.dtype).reshape(n, int(k), d) - 0.5) * 0.1
    prop = mean.unsqueeze(1) * scale[None, :, None] + noise  # (n, k, D)
    return {"proposal": prop, "score": prop.norm(dim=2).double()}


def norm_at_most(ctx: PredicateInput) -> Tensor:
    bound = float(ctx.args[0]) if ctx.args else 1.0
    return ctx.candidates.norm(dim=2) <= bound  # (n, C)


def copy(inputs: dict[str, Tensor], **_: Any) -> dict[str, Tensor]:
    own = inputs["own"][:, 0]  # (n, D)
    score = torch.zeros(own.shape[0], dtype=torch.float64, device=own.device)
    return {"proposal": own.clone(), "score": score}


def box_mean(inputs: dict[str, Tensor], **_: Any) -> dict[str, Tensor]:
    mean = _mean(inputs["around"], inputs["around_mask"])
    score = torch.zeros(mean.shape[0], dtype=torch.float64, device=mean.device)
    return {"proposal": mean, "score": score}
