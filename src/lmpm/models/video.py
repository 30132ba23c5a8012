"""The video models of examples/video.lmpm: the LocalGen proposer, its score, and CoarseGen.

``Model(neighbors, prev, txt, coarse)`` — the seed's ``LocalGen`` rule — proposes a token for each
open ``Vid[t,x,y]`` from exactly what the rule reads, as the runtime gathers it through the plan's
gather tables (``docs/runtime.md``):

- ``neighbors`` (n, 8): the N8 neighbours in the same frame (+ ``neighbors_mask``: visible and
  committed);
- ``prev_frame`` (n, 1): ``Vid[t-1, x, y]`` (invisible at ``t = 0``);
- ``txt`` (n, N): the caption bytes ``Txt[*]``;
- ``coarse`` (n, 1): ``Coarse[t, x/8, y/8]`` (optional: unset until proposed);
- plus the cell's own ``coords`` (t, x, y): one learned embedding per frame, column and row (the
  world's stage is fixed, so where a cell is says what the caption puts there).

A cell never sees its own token. The network: one embedding per (slot, token-or-unset) summed — the
first layer of an MLP over the one-hot inputs — plus a caption vector (byte embeddings → a 1-D
convolution → max-pool over the committed bytes; computed once per distinct caption), the
position, and the object's *path*: one embedding per (frame, column) and per (frame, row), each
multiplied by a projection of the caption (a moving object's columns depend on t and x together,
which a sum of per-axis embeddings cannot say); then two GELU layers to logits over the 16-token
palette. It is trained MaskGIT-style (``scripts/train_video.py``): every training video hides a
random share of its cells (0 to 100%), so it proposes from any partial context, and the cells it
learns from are drawn mostly where an object passes. The worker samples the proposals from the
logits with the counter-based RNG; ``ModelScore(...)`` is the log-prob of each candidate under the
same forward pass (cached: no second forward).

``CoarseGen(txt)`` proposes ``Coarse[t, i, j]`` (the mode token of a 8×8 block) from the caption and
the block's position (frame, column, row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmpm.models import weights
from lmpm.models.compile import ModuleGraphs, bucket
from lmpm.models.text import LastCall
from lmpm.models.world import K

UNSET = K  # token id of "not visible / not committed" in the embeddings
SLOTS = 8 + 1 + 1  # N8 neighbours, previous frame, coarse
POS = 64  # position embeddings per axis (x, y clamp to 0..63)
FRAMES = 16  # frame embeddings (t clamps to 0..15)


class CaptionEncoder(nn.Module):
    def __init__(self, out: int = 32, emb: int = 32, channels: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(257, emb)  # 256 bytes + unset
        self.conv = nn.Conv1d(emb, channels, 5, padding=2)
        self.proj = nn.Linear(channels, out)

    def forward(self, txt: Tensor, mask: Tensor) -> Tensor:
        """(n, L) bytes + mask → (n, out). Distinct rows are encoded once."""
        if txt.shape[0] > 1 and txt.stride(0) == 0 and mask.stride(0) == 0:
            return self._encode(txt[:1], mask[:1]).expand(txt.shape[0], -1)
        if txt.shape[0] > 1:
            key = torch.where(mask, txt.long(), torch.full_like(txt.long(), 256))
            uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
            if uniq.shape[0] < txt.shape[0]:
                return self._encode(uniq, uniq < 256)[inverse]
        return self._encode(txt, mask)

    def _encode(self, txt: Tensor, mask: Tensor) -> Tensor:
        tok = torch.where(mask, txt.long(), torch.full_like(txt.long(), 256))
        h = F.relu(self.conv(self.emb(tok).transpose(1, 2)))  # (n, C, L)
        h = h.masked_fill(~mask[:, None, :], 0.0).amax(-1)
        out: Tensor = self.proj(h)
        return out


class LocalGen(nn.Module):
    offsets: Tensor

    def __init__(self, hidden: int = 192, caption: int = 32) -> None:
        super().__init__()
        self.cap = CaptionEncoder(caption)
        self.slots = nn.Embedding(SLOTS * (K + 1), hidden)
        self.cap_in = nn.Linear(caption, hidden)
        # the cell's position on the stage: one embedding per column, row and frame (clamped)
        self.pos_x = nn.Embedding(POS, hidden)
        self.pos_y = nn.Embedding(POS, hidden)
        self.pos_t = nn.Embedding(FRAMES, hidden)
        # where the caption's object is in frame t: a shape moving along its path occupies columns
        # that depend on (t, x) and rows on (t, y), so one embedding per (frame, column) and per
        # (frame, row), each gated by the caption (which says how the object moves)
        self.path_x = nn.Embedding(FRAMES * POS, hidden)
        self.path_y = nn.Embedding(FRAMES * POS, hidden)
        nn.init.normal_(self.path_x.weight, std=0.5)
        nn.init.normal_(self.path_y.weight, std=0.5)
        self.cap_x = nn.Linear(caption, hidden)
        self.cap_y = nn.Linear(caption, hidden)
        self.mlp = nn.Sequential(
            nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, K)
        )
        self.register_buffer("offsets", torch.arange(SLOTS) * (K + 1), persistent=False)

    def forward(self, tokens: Tensor, visible: Tensor, caption: Tensor, coords: Tensor) -> Tensor:
        """tokens/visible (n, 10): N8 + prev + coarse; caption (n, C); coords (n, 3) → (n, 16)."""
        tok = torch.where(visible, tokens.long().clamp(0, K - 1), torch.full_like(tokens, UNSET))
        h = self.slots(tok + self.offsets).sum(1)
        c = coords.long()
        t = c[:, 0].clamp(0, FRAMES - 1)
        x = c[:, 1].clamp(0, POS - 1)
        y = c[:, 2].clamp(0, POS - 1)
        pos = self.pos_t(t) + self.pos_x(x) + self.pos_y(y)
        path = self.cap_x(caption) * self.path_x(t * POS + x)
        path = path + self.cap_y(caption) * self.path_y(t * POS + y)
        h = h + self.cap_in(caption) + pos + path
        out: Tensor = self.mlp(h)
        return out


class CoarseGen(nn.Module):
    def __init__(self, hidden: int = 128, caption: int = 32, rows: int = 8) -> None:
        super().__init__()
        self.rows = rows
        self.cap = CaptionEncoder(caption)
        self.row = nn.Embedding(rows, hidden)
        self.col = nn.Embedding(rows, hidden)
        self.frame = nn.Embedding(FRAMES, hidden)
        self.cap_in = nn.Linear(caption, hidden)
        self.mlp = nn.Sequential(
            nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, K)
        )

    def forward(self, caption: Tensor, coords: Tensor) -> Tensor:
        """caption (n, C), coords (n, 3) of Coarse[t, i, j] → (n, 16)."""
        c = coords.long()
        h = (
            self.row(c[:, 2].clamp(0, self.rows - 1))
            + self.col(c[:, 1].clamp(0, self.rows - 1))
            + self.frame(c[:, 0].clamp(0, FRAMES - 1))
            + self.cap_in(caption)
        )
        out: Tensor = self.mlp(h)
        return out


def load_local(device: torch.device | str | None = None) -> LocalGen:
    """The shipped LocalGen on ``device`` (default: the CPU), moved once per device."""
    return weights.load("localgen", LocalGen, device)


def load_coarse(device: torch.device | str | None = None) -> CoarseGen:
    """The shipped CoarseGen on ``device`` (default: the CPU), moved once per device."""
    return weights.load("coarsegen", CoarseGen, device)


def local_features(inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(tokens, visible), each (n, 10): the N8 neighbours, the previous frame, the coarse cell."""
    n, dev = inputs["cells"].shape[0], inputs["cells"].device
    parts, masks = [], []
    for name, width in (("neighbors", 8), ("prev_frame", 1), ("coarse", 1)):
        if name in inputs:
            v, m = inputs[name], inputs[f"{name}_mask"]
            if v.shape[1] != width:  # a border cell's read padded differently: fit to the slots
                v = F.pad(v, (0, max(width - v.shape[1], 0)))[:, :width]
                m = F.pad(m, (0, max(width - m.shape[1], 0)))[:, :width]
        else:
            v = torch.zeros(n, width, dtype=torch.long, device=dev)
            m = torch.zeros(n, width, dtype=torch.bool, device=dev)
        parts.append(v.long())
        masks.append(m.bool())
    return torch.cat(parts, 1), torch.cat(masks, 1)


_LAST = LastCall()


def _logp(forward: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """Log-probs of a forward's logits: the part of a call :class:`CompiledHead` compiles."""
    return torch.log_softmax(forward(*args).float(), -1)


class CompiledHead:
    """``_logp(model, *args)`` of one module (``LocalGen`` or ``CoarseGen``: all but the caption
    encoder, whose ``torch.unique`` has a data-dependent shape) as explicit inductor graphs, one
    per power-of-two count of cells (padding rows: zeros, nothing visible)."""

    def __init__(self) -> None:
        self.graphs: ModuleGraphs | None = None

    def __call__(self, model: nn.Module, *args: Tensor) -> Tensor:
        if self.graphs is None or self.graphs.module is not model:
            self.graphs = ModuleGraphs(model, _logp)
        n = args[0].shape[0]
        rows = bucket(n)
        if rows != n:
            args = tuple(F.pad(a, (0, 0, 0, rows - n)) for a in args)
        with torch.no_grad():
            return self.graphs(*(a.contiguous() for a in args))[:n]


_LOCAL = CompiledHead()
_COARSE = CompiledHead()


def local_logp(inputs: dict[str, Tensor], compiled: bool = False) -> Tensor:
    """(n, 16) log-probs of every open Vid cell's token (``compiled``: :class:`CompiledHead`)."""
    key = tuple(inputs[k] for k in ("cells", "neighbors", "neighbors_mask", "txt") if k in inputs)
    hit = _LAST.get(key)
    if hit is not None:
        return hit
    model = load_local(inputs["cells"].device)
    tokens, visible = local_features(inputs)
    with torch.no_grad():
        cap = model.cap(inputs["txt"], inputs["txt_mask"])
        args = (tokens, visible, cap, inputs["coords"])
        logp = _LOCAL(model, *args) if compiled else _logp(model, *args)
    _LAST.put(key, logp)
    return logp


def local_gen(
    inputs: dict[str, Tensor],
    *,
    vocab: int | None = None,
    k: int = 1,
    temperature: float = 1.0,
    **_: Any,
) -> dict[str, Tensor]:
    """`Model(neighbors, prev, txt, coarse)`: logits over the palette for every open Vid cell."""
    return _local_gen(inputs, False, vocab, k, temperature)


def _local_gen(
    inputs: dict[str, Tensor], compiled: bool, vocab: int | None, k: int, temperature: float
) -> dict[str, Tensor]:
    if vocab is not None and vocab != K:
        raise ValueError(f"the video model proposes {K} palette tokens; the value has {vocab}")
    logits = local_logp(inputs, compiled) / max(float(temperature), 1e-3)
    if int(k) > 1:
        return {"logits": logits[:, None, :].expand(-1, int(k), -1).contiguous()}
    return {"logits": logits}


def model_score(inputs: dict[str, Tensor], **_: Any) -> Tensor:
    """`ModelScore(...)`: the log-prob of each candidate under the LocalGen model, (n, k)."""
    return _model_score(inputs, False)


def _model_score(inputs: dict[str, Tensor], compiled: bool) -> Tensor:
    logp = local_logp(inputs, compiled)
    prop = inputs["proposal"].long().clamp(0, K - 1)
    return logp.gather(1, prop).double()


def coarse_gen(
    inputs: dict[str, Tensor], *, vocab: int | None = None, k: int = 1, **_: Any
) -> dict[str, Tensor]:
    """`CoarseGen(txt)`: logits of each open Coarse cell's mode token."""
    return _coarse_gen(inputs, False, vocab, k)


def _coarse_gen(
    inputs: dict[str, Tensor], compiled: bool, vocab: int | None, k: int
) -> dict[str, Tensor]:
    if vocab is not None and vocab != K:
        raise ValueError(f"CoarseGen proposes {K} palette tokens; the value has {vocab}")
    model = load_coarse(inputs["coords"].device)
    with torch.no_grad():
        cap = model.cap(inputs["txt"], inputs["txt_mask"])
        args = (cap, inputs["coords"])
        logits = _COARSE(model, *args) if compiled else _logp(model, *args)
    if int(k) > 1:
        return {"logits": logits[:, None, :].expand(-1, int(k), -1).contiguous()}
    return {"logits": logits}


# ---- compiled versions (lmpm_compile factories; docs/models.md, "Compiled models") ---------------
# Not set on the bound functions: in examples/video.lmpm the compiled LocalGen takes about 2x the
# eager time per epoch (inductor's fused embedding sums over 2,048 cells lose to ATen's kernels);
# benchmarks/model_compile.py --example video measures them.


def compiled_local_gen() -> Callable[..., dict[str, Tensor]]:
    """`Model` over the compiled ``LocalGen`` (:class:`CompiledHead`)."""

    def local_gen_compiled(
        inputs: dict[str, Tensor],
        *,
        vocab: int | None = None,
        k: int = 1,
        temperature: float = 1.0,
        **_: Any,
    ) -> dict[str, Tensor]:
        return _local_gen(inputs, True, vocab, k, temperature)

    return local_gen_compiled


def compiled_model_score() -> Callable[..., Tensor]:
    """`ModelScore` over the compiled ``LocalGen``."""

    def model_score_compiled(inputs: dict[str, Tensor], **_: Any) -> Tensor:
        return _model_score(inputs, True)

    return model_score_compiled


def compiled_coarse_gen() -> Callable[..., dict[str, Tensor]]:
    """`CoarseGen` over the compiled ``CoarseGen`` module."""

    def coarse_gen_compiled(
        inputs: dict[str, Tensor], *, vocab: int | None = None, k: int = 1, **_: Any
    ) -> dict[str, Tensor]:
        return _coarse_gen(inputs, True, vocab, k)

    return coarse_gen_compiled
