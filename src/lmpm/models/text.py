"""ByteLM: a byte-level causal transformer whose attention mask is compiled from the program.

The mask comes from LMPM's own visibility compiler, applied to the clause every causal text program
states (``examples/gpt.lmpm``, ``examples/text.lmpm``)::

    visible Txt[t] <- Txt[0..t-1] when t > 0

How the model uses it. Slot ``t`` of the sequence is *cell* ``Txt[t]``; its input is the newest byte
the cell may see, ``Txt[t-1]`` (a BOS embedding for ``t = 0``), plus a position embedding. Slot ``t``
attends to the slots of the cells it can see (``mask[t, s]``: ``s < t``, each of which summarizes
only bytes ``t`` may read) **and to its own slot** (the diagonal). Its output is the distribution of
``Txt[t]`` given ``Txt[0..t-1]``; nothing invisible ever flows in. Row ``t = 0`` of the program's
mask is empty (``Txt[0]`` sees nothing — ``lmpm mask`` reports it as degenerate); with the diagonal
it attends to its BOS slot only, so no softmax row is empty and nothing is NaN.

Attention runs through SDPA with the dense mask (fast on CPU), or FlexAttention with the compiled
``mask_mod`` (``attention="flex"``; eager on CPU, which materializes scores — same numbers).

Bound names: ``ByteLM`` (proposals: ``k`` samples per cell from the worker's counter-based RNG) and
``TextScore`` (the log-prob of each candidate, from the same forward pass). Both opt in to
``--compile``: the forward and the log-softmax of the read slots then run as explicit inductor
graphs (:class:`CompiledLogp`), the Python around them stays eager (docs/models.md, "Compiled
models").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmpm.bindings import COMPILE_ATTR
from lmpm.models import weights
from lmpm.models.compile import ModuleGraphs, bucket

BYTES = 256
BOS = 256  # the input of slot 0
UNK = 257  # a visible cell that is not committed (unset)
VISIBILITY = """\
param N = 64
value Txt : Token[Byte] shape Seq(N) clock Lamport
visible Txt[t] <- Txt[0..t-1] when t > 0
"""


def program_mask(n: int, device: torch.device | str | None = None) -> Tensor:
    """(n, n) bool: the program's dense visibility mask plus the diagonal (see the module doc),
    on ``device`` (default: the CPU).

    Compiled once per power-of-two size and sliced: a cell's visible set depends only on its own
    index here, so the mask of a prefix is the prefix of the mask (generation grows n every epoch).
    Moved to each device once (cached), never per call.
    """
    size = max(64, 1 << max(n - 1, 0).bit_length())
    dev = torch.device("cpu" if device is None else device)
    mask: Tensor = weights.table(f"bytelm-mask-{size}", lambda: _program_mask(size), dev)
    return mask[:n, :n]


@lru_cache(maxsize=8)
def _program_mask(n: int) -> Tensor:
    from lmpm.visibility import compile_masks

    m = compile_masks(VISIBILITY, N=n)
    return m.dense() | torch.eye(n, dtype=torch.bool)


def program_mask_mod(n: int) -> Any:
    from lmpm.visibility import compile_masks

    base = compile_masks(VISIBILITY, N=n).mask_mod

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return base(b, h, q, kv) | (q == kv)

    return mask_mod


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor, mask: Tensor, block_mask: Any = None) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if block_mask is not None:
            from torch.nn.attention.flex_attention import flex_attention

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
                a = flex_attention(q, k, v, block_mask=block_mask)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert isinstance(a, Tensor)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.ff(self.ln2(x))


class ByteLM(nn.Module):
    def __init__(self, d: int = 96, layers: int = 3, heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(BYTES + 2, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, BYTES)

    def forward(
        self, tokens: Tensor, attention: str = "sdpa", mask: Tensor | None = None
    ) -> Tensor:
        """tokens (B, L) bytes (-1: unset) → logits (B, L, 256); row t = p(Txt[t] | Txt[0..t-1]).
        ``mask`` is ``program_mask(L)`` when not given (a compiled graph takes it as an input)."""
        b, n = tokens.shape
        if n > self.max_len:
            raise ValueError(f"ByteLM sees at most {self.max_len} bytes, got {n}")
        bos = torch.full((b, 1), BOS, dtype=torch.long, device=tokens.device)
        prev = torch.cat([bos, tokens[:, :-1].long()], 1)
        prev = torch.where(prev < 0, torch.full_like(prev, UNK), prev)
        x = self.tok(prev) + self.pos.weight[:n]
        if mask is None:
            mask = program_mask(n, tokens.device)
        block_mask = None
        if attention == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            block_mask = create_block_mask(
                program_mask_mod(n), 1, 1, n, n, device=tokens.device, BLOCK_SIZE=max(n, 1)
            )
        for blk in self.blocks:
            x = blk(x, mask, block_mask)
        out: Tensor = self.head(self.norm(x))
        return out


def load(device: torch.device | str | None = None) -> ByteLM:
    """The shipped ByteLM on ``device`` (default: the CPU), loaded and moved once per device."""
    return weights.load("bytelm", ByteLM, device)


def _contexts(inputs: dict[str, Tensor], max_len: int) -> tuple[Tensor, Tensor]:
    """(n, L) sequences of what each open cell sees (-1 elsewhere), and each cell's slot."""
    cells = inputs["cells"].long()
    ctx, mask = inputs["context"], inputs["context_mask"]
    n, dev = cells.shape[0], cells.device
    # A score call gets no `_index`: the read `Txt[0..t-1]` lists positions 0, 1, ... in order.
    index = inputs.get("context_index")
    if index is None:
        index = torch.arange(ctx.shape[1], device=dev).expand(n, -1)
    start = (cells - (max_len - 1)).clamp(min=0)  # a sliding window past max_len
    slot = cells - start
    length = int(slot.max()) + 1 if n else 1
    rel = index.long() - start[:, None]
    ok = mask & (rel >= 0) & (rel < slot[:, None])
    # Scattered with a fixed shape (no boolean-mask indexing, whose size the host would wait
    # for on a GPU): what a row does not read goes to an extra column, dropped after.
    seq = torch.full((n, length + 1), -1, dtype=torch.long, device=dev)
    seq.scatter_(1, torch.where(ok, rel, length), torch.where(ok, ctx.long(), -1))
    return seq[:, :length].contiguous(), slot


class LastCall:
    """The log-probs of the last call, so a score over the same inputs needs no second forward."""

    def __init__(self) -> None:
        self.key: tuple[Tensor, ...] = ()
        self.logp: Tensor | None = None

    def get(self, key: tuple[Tensor, ...]) -> Tensor | None:
        if self.logp is not None and len(key) == len(self.key):
            if all(a is b for a, b in zip(key, self.key)):
                return self.logp
        return None

    def put(self, key: tuple[Tensor, ...], logp: Tensor) -> None:
        self.key, self.logp = key, logp


_LAST = LastCall()


def _last_logp(forward: Callable[..., Tensor], seq: Tensor, slot: Tensor, mask: Tensor) -> Tensor:
    """(n, 256) log-probs of each row's slot: the part of a call :class:`CompiledLogp` compiles."""
    logits = forward(seq, mask=mask)
    rows = torch.arange(seq.shape[0], device=seq.device)
    return torch.log_softmax(logits[rows, slot].float(), -1)


def next_byte_logp(
    inputs: dict[str, Tensor], step: Callable[[ByteLM, Tensor, Tensor], Tensor] | None = None
) -> Tensor:
    """(n, 256) log p(Txt[t] | what t sees) for every open cell; ``step(model, seq, slot)`` computes
    them instead of the eager forward (the compiled ``ByteLM``, :class:`CompiledLogp`)."""
    key = (inputs["context"], inputs["context_mask"], inputs["cells"])
    hit = _LAST.get(key)
    if hit is not None:
        return hit
    model = load(inputs["cells"].device)
    seq, slot = _contexts(inputs, model.max_len)
    if step is not None:
        logp = step(model, seq, slot)
    else:
        with torch.no_grad():
            logp = _last_logp(model, seq, slot, program_mask(seq.shape[1], seq.device))
    _LAST.put(key, logp)
    return logp


# Compiled shapes: contexts padded to 16, 32 or 64 bytes (-1, past every slot a row reads: the
# causal mask hides the padding), rows to a power of two (padding rows read nothing).
MIN_LEN = 16


class CompiledLogp:
    """``step(model, seq, slot)`` of :func:`next_byte_logp` as explicit inductor graphs, one per
    (rows, context) bucket: what ``ByteLM`` and ``TextScore`` run under ``--compile``."""

    def __init__(self) -> None:
        self.graphs: ModuleGraphs | None = None

    def __call__(self, model: ByteLM, seq: Tensor, slot: Tensor) -> Tensor:
        if self.graphs is None or self.graphs.module is not model:
            self.graphs = ModuleGraphs(model, _last_logp)
        n, length = seq.shape
        rows, cols = bucket(n), max(min(bucket(length, MIN_LEN), model.max_len), length)
        if (rows, cols) != (n, length):
            seq = F.pad(seq, (0, cols - length, 0, rows - n), value=-1)
            slot = F.pad(slot, (0, rows - n))
        with torch.no_grad():
            return self.graphs(seq, slot, program_mask(cols, seq.device))[:n]


_COMPILED = CompiledLogp()


PICKS = ("sample", "top")


def byte_lm(
    inputs: dict[str, Tensor],
    *,
    vocab: int | None = None,
    k: int = 1,
    temperature: float = 1.0,
    pick: str = "sample",
    **_: Any,
) -> dict[str, Tensor]:
    """`ByteLM(context, k=..., temperature=..., pick=...)`: each open cell's next-byte candidates.

    ``pick="sample"`` (default): logits, and the worker draws ``k`` candidates per cell with the
    counter-based RNG. ``pick="top"``: the ``k`` most likely *distinct* bytes (greedy decoding
    with the runner-ups kept), so a constraint that rejects the favourite always finds the best
    byte it allows among the others."""
    return _byte_lm(inputs, None, vocab=vocab, k=k, temperature=temperature, pick=pick)


def _byte_lm(
    inputs: dict[str, Tensor],
    step: Any,
    *,
    vocab: int | None = None,
    k: int = 1,
    temperature: float = 1.0,
    pick: str = "sample",
    **_: Any,
) -> dict[str, Tensor]:
    """:func:`byte_lm` with ``step`` computing the log-probs (None: the eager forward)."""
    if vocab is not None and vocab != BYTES:
        raise ValueError(f"ByteLM proposes bytes (vocab 256); the value has {vocab} tokens")
    if pick not in PICKS:
        raise ValueError(f"ByteLM: unknown pick {pick!r}; picks: {', '.join(PICKS)}")
    logp = next_byte_logp(inputs, step)
    if pick == "top":
        return {"proposal": logp.topk(max(int(k), 1), dim=-1).indices}
    logp = logp / max(float(temperature), 1e-3)
    if int(k) > 1:
        return {"logits": logp[:, None, :].expand(-1, int(k), -1).contiguous()}
    return {"logits": logp}


def text_score(inputs: dict[str, Tensor], **_: Any) -> Tensor:
    """`TextScore(...)`: log p of each candidate byte, (n, k)."""
    return _text_score(inputs, None)


def _text_score(inputs: dict[str, Tensor], step: Any) -> Tensor:
    logp = next_byte_logp(inputs, step)
    prop = inputs["proposal"].long().clamp(0, BYTES - 1)
    return logp.gather(1, prop).double()


def compiled_byte_lm() -> Callable[..., dict[str, Tensor]]:
    """`ByteLM` over the compiled forward (:class:`CompiledLogp`)."""

    def byte_lm_compiled(inputs: dict[str, Tensor], **kwargs: Any) -> dict[str, Tensor]:
        return _byte_lm(inputs, _COMPILED, **kwargs)

    return byte_lm_compiled


def compiled_text_score() -> Callable[..., Tensor]:
    """`TextScore` over the compiled forward (:class:`CompiledLogp`)."""

    def text_score_compiled(inputs: dict[str, Tensor], **_: Any) -> Tensor:
        return _text_score(inputs, _COMPILED)

    return text_score_compiled


def bits_per_byte(model: ByteLM, seqs: Tensor) -> float:
    """Mean bits per byte of ``seqs`` (B, L) under the model (every position, BOS-started)."""
    with torch.no_grad():
        logits = model(seqs)
    nll = F.cross_entropy(logits.reshape(-1, BYTES), seqs.reshape(-1).long())
    return float(nll) / math.log(2)


# Under --compile the worker calls the compiled versions (docs/models.md, "Compiled models": in
# examples/text.lmpm the models take ~1.3x less time per epoch, and commit the same bytes).
setattr(byte_lm, COMPILE_ATTR, compiled_byte_lm)
setattr(text_score, COMPILE_ATTR, compiled_text_score)
