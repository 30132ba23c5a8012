"""A Hugging Face ``transformers`` causal LM as a rule's model, with a KV cache reused by clocks.

:class:`HFCausalLM` wraps any causal LM (``AutoModelForCausalLM``: GPT-2, Llama, ...) and its
tokenizer. Bound to a rule that reads a prefix (``read {context = Txt[0..t-1]}``), it asks the worker
for the read's dense layout and write clocks (``lmpm_reads``, :mod:`lmpm.runtime.data.reads`) and
keeps one KV cache per set of rows: a row whose prefix is unchanged since the last call (same
cells, same clocks, same worker generation) feeds only its new tokens; a changed cell trims the
cache to the first changed column (``DynamicCache.crop``) and feeds the rest again. Many rows at
once (``Grid2D(B, N)``, rows at different lengths) run as one batch, left-padded, with an attention
mask and per-row position ids: the tokens equal Hugging Face ``generate``'s.

It returns each open cell's next-token logits ``(n, V)`` as a :class:`lmpm.workers.Logits` record:
the worker masks them with the constraints the resolver lowered (docs/runtime.md, "Constraints
before choosing"), then takes the ``k`` most likely (``pick="top"``) or draws ``k`` with its
counter-based RNG (``pick="sample"``), as the call's keywords say::

    # mybind.py, then: lmpm run prog.lmpm --bind mybind.py --input Txt=prompt.npy
    import lmpm
    from lmpm.models.hf import HFCausalLM

    lmpm.bind("GPT")(HFCausalLM.from_pretrained("path/to/local/model"))

    # prog.lmpm: emit proposal Txt[t] := GPT(context, k=1, pick="top")

``transformers`` is the optional extra ``lmpm[hf]``; without it, importing this module raises
:class:`lmpm.errors.BindError` B101 naming the extra.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmpm.errors import BindError
from lmpm.workers.base import PICKS, Logits

try:
    import transformers
    from transformers import DynamicCache
except ImportError as exc:  # the optional extra is missing
    raise BindError(
        "lmpm.models.hf needs the `transformers` package, which is not installed",
        code="B101",
        hint="install LMPM's Hugging Face extra: pip install 'lmpm[hf]'",
    ) from exc

__all__ = ["HFCausalLM"]


@dataclass(slots=True)
class _Rows:
    """A KV cache of a set of rows (one per open cell's prefix), as the model last saw them.

    The decode step's room to grow: ``mask``'s first ``end`` columns are the attention mask (all
    ones past them: the columns to come), ``columns``' first Lc the cache column of each position
    (zeros past them); a step that outgrows them doubles them, so it allocates nothing of width N
    and narrows neither (:attr:`attention` and :attr:`column` are the views)."""

    cache: Any  # transformers DynamicCache: (rows, heads, end, head_dim) per layer
    mask: Tensor  # (rows, >= end) on the model's device: 1 where a column holds a token
    end: int  # the cache's columns
    index: Tensor  # (rows, Lc) host int64: the cell of each cached position (dense order)
    clock: Tensor  # (rows, Lc) host int64: its write clock when fed
    columns: Tensor  # (rows, >= Lc) host int64: the cache column holding each position
    length: Tensor  # (rows,) host int64: cached positions per row
    lengths: list[int]  # the same as numbers (the decode step's checks: no tensor op)
    full: bool = False  # every column of ``attention`` holds a token (no padding)
    # ``columns`` as the NumPy array it wraps, where a decode step of one row wrote into it
    # (``Tensor.numpy`` costs ~15 µs cold after a forward; NumPy's write a fraction)
    host_columns: np.ndarray | None = None
    # ``index`` and ``clock`` as NumPy arrays, kept by a decode step of one row for the next
    # one's check (their bytes compared: no ``Tensor.numpy`` of the cached rows)
    host_index: np.ndarray | None = None
    host_clock: np.ndarray | None = None

    @property
    def attention(self) -> Tensor:
        """(rows, end) 1 where a cache column holds a token."""
        m = self.mask
        return m if m.shape[1] == self.end else m.narrow(1, 0, self.end)

    @property
    def column(self) -> Tensor:
        """(rows, Lc) the cache column holding each cached position."""
        c, lc = self.columns, self.index.shape[1]
        return c if c.shape[1] == lc else c.narrow(1, 0, lc)


class HFCausalLM:
    """A ``transformers`` causal LM bound as a rule's model (see the module doc).

    ``read``: the rule's read holding the prefix (default: its only one); ``max_cached``: how many
    row sets keep a KV cache (least recently used dropped first).
    """

    lmpm_reads = frozenset({"clocks", "dense"})

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        read: str | None = None,
        max_cached: int = 32,
    ) -> None:
        if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "forward", None)):
            raise BindError(
                f"HFCausalLM wraps a transformers causal LM (an nn.Module), got "
                f"{type(model).__name__}",
                code="B102",
                hint="e.g. HFCausalLM(AutoModelForCausalLM.from_pretrained(path))",
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.read = read
        self.max_cached = int(max_cached)
        self._rows: OrderedDict[tuple[Any, ...], _Rows] = OrderedDict()
        self._names: dict[int, _ReadNames] = {}  # the read's input names, by the inputs' count
        self.fed = 0  # tokens fed through the model so far (cache reuse: tests, benchmarks)
        # one of its parameters: where the model is (a module's ``to`` moves its parameters in
        # place, so this one's device follows the model's without a walk over them every call)
        self._param = next(self.model.parameters(), None)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> HFCausalLM:
        """Load model and tokenizer from a local directory (never downloads)."""
        where = Path(path)
        if not where.is_dir():
            raise BindError(
                f"HFCausalLM.from_pretrained: {where} is not a directory",
                code="B103",
                hint="save a model with model.save_pretrained(DIR) (and its tokenizer's "
                "save_pretrained) and pass DIR; LMPM never downloads models",
            )
        model = transformers.AutoModelForCausalLM.from_pretrained(
            where, local_files_only=True, dtype=dtype
        )
        if device is not None:
            torch.nn.Module.to(model, device)  # (in place)
        tokenizer = None
        if any((where / f).exists() for f in ("tokenizer.json", "vocab.json", "tokenizer.model")):
            tokenizer = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
        return cls(model, tokenizer, **kwargs)

    def to(self, device: torch.device | str) -> HFCausalLM:
        self.model.to(device)
        self._param = next(self.model.parameters(), None)
        self._rows.clear()
        return self

    # ---- the model call --------------------------------------------------------------------------
    def __call__(
        self,
        inputs: dict[str, Tensor],
        *,
        k: int = 1,
        pick: str = "sample",
        temperature: float = 1.0,
        generation: int = 0,
        **_: Any,
    ) -> Logits:
        if pick not in PICKS:
            raise ValueError(f"pick={pick!r}; expected one of {PICKS}")
        names = self._names.get(len(inputs))
        if names is None or names.dense not in inputs:  # (the same names every call of a rule)
            names = self._names[len(inputs)] = _ReadNames.of(self._read_name(inputs))
        ids = inputs[names.dense]  # (n, L)
        device = ids.device
        if self._param is not None and self._param.device != device:
            self.to(device)
        index, clock = inputs[names.index], inputs[names.clock]
        if device.type != "cpu":  # one copy to the host for the bookkeeping
            index, clock = torch.stack([index, clock]).cpu()  # (n, L) each
        # (on the host they are this call's own tensors: kept as they are, never written)
        length = inputs[names.length]
        if device.type != "cpu":
            length = length.cpu()
        lengths = length.tolist()
        if min(lengths, default=1) < 1:
            raise ValueError(
                f"a cell's read `{names.read}` holds no token yet; a causal LM needs at least one "
                "(give the prompt's first cells as input)"
            )
        logits = self._forward(ids, index, clock, length, lengths, generation)  # (n, V)
        # the worker masks the lowered constraints, then takes the top k or draws k (Logits)
        return Logits(logits, k=int(k), pick=pick, temperature=float(temperature))

    def _read_name(self, inputs: dict[str, Tensor]) -> str:
        if self.read is not None:
            if f"{self.read}_dense" not in inputs:
                raise ValueError(f"the rule has no read `{self.read}`")
            return self.read
        names = [k.removesuffix("_dense") for k in inputs if k.endswith("_dense")]
        if len(names) != 1:
            raise ValueError(
                f"HFCausalLM reads one prefix; this rule has {len(names)} reads ({names}): "
                "name it with HFCausalLM(..., read=NAME)"
            )
        return names[0]

    def _forward(
        self,
        ids: Tensor,
        index: Tensor,
        clock: Tensor,
        length: Tensor,
        lengths: list[int],
        generation: int,
    ) -> Tensor:
        """Next-token logits of every row: feed what its cache lacks, reuse the rest."""
        n, width = ids.shape
        host_index, host_clock = index.numpy(), clock.numpy()  # (n, L) each
        key = (generation, *host_index[:, 0].tolist())  # the rows: their first cells
        rows = self._rows.pop(key, None)
        if rows is None:
            rows = self._subset(key)
        elif self._appends(rows, index, lengths, host_index, host_clock):  # a decode step
            return self._append(
                key, rows, ids, (index, clock, length), lengths, host_index, host_clock
            )
        start_col, keep = self._reuse(rows, index, clock, length)
        # per row, the first position to feed: those in columns before start_col stay cached
        first = keep  # (n,)
        count = length - first  # (n,) >= 1
        block = int(count.max())
        pos = torch.arange(block).unsqueeze(0) - (block - count).unsqueeze(1) + first.unsqueeze(1)
        real = pos >= first.unsqueeze(1)  # (n, block): left-padded within the block
        pos = torch.where(real, pos, 0)  # (n, block) position ids (0 on padding)
        dev = ids.device
        feed = ids.gather(1, pos.to(dev)) * real.to(dev)  # (n, block)
        block_mask = real.to(device=dev, dtype=torch.int64)  # (n, block)
        if rows is None:
            cache: Any = DynamicCache()
            attention = block_mask
        else:
            cache = rows.cache
            if start_col < rows.end:  # drop the columns from start_col on
                cache.crop(start_col - rows.end)  # (5.24+: minus how many)
            attention = torch.cat([rows.attention[:, :start_col], block_mask], dim=1)
        out = self.model(
            input_ids=feed,
            attention_mask=attention,  # (kept on the device: one block copied per call)
            position_ids=pos.to(dev),
            cache=cache,  # (transformers 5.24+; filled in place)
            use_cache=True,
            logits_to_keep=1,
        )
        self.fed += int(count.sum())
        col_new = start_col + torch.arange(block).unsqueeze(0).expand(n, -1)  # (n, block)
        column = torch.zeros(n, width + 1, dtype=torch.int64)  # (the last: padding's sink)
        if rows is not None:
            old = rows.column[:, : min(width, rows.column.shape[1])]
            column[:, : old.shape[1]] = old
            column[torch.arange(width + 1).unsqueeze(0) >= first.unsqueeze(1)] = 0
        column.scatter_(1, torch.where(real, pos, width), col_new)
        column = column[:, :width]
        full = bool(attention.all())
        end = attention.shape[1]
        self._rows[key] = _Rows(cache, attention, end, index, clock, column, length, lengths, full)
        while len(self._rows) > self.max_cached:
            self._rows.popitem(last=False)
        return out.logits.select(1, -1)  # (n, V)

    @staticmethod
    def _appends(
        rows: _Rows,
        index: Tensor,
        lengths: list[int],
        host_index: np.ndarray,
        host_clock: np.ndarray,
    ) -> bool:
        """Every row holds its cached positions unchanged (same cells, same clocks) and one
        more after them: the step of a decode, one token per row (``host_index``,
        ``host_clock``: the call's index and clocks as NumPy)."""
        lc = rows.index.shape[1]
        if index.shape[1] < lc or lengths != [m + 1 for m in rows.lengths]:
            return False
        if len(lengths) == 1:  # one row, its positions filling the cached width: their bytes
            cached = rows.host_index if rows.host_index is not None else rows.index.numpy()
            if cached.tobytes() != host_index[:, :lc].tobytes():
                return False
            held = rows.host_clock if rows.host_clock is not None else rows.clock.numpy()
            return held.tobytes() == host_clock[:, :lc].tobytes()
        now_index = index.narrow(1, 0, lc)
        now_clock = torch.from_numpy(host_clock).narrow(1, 0, lc)  # (the call's clock tensor)
        if min(rows.lengths) < lc:  # rows of several lengths: a row's new token lies
            # within the cached width, where its cached entries are 0 (the dense read's rest)
            cached_t = torch.arange(lc) < rows.length.unsqueeze(1)
            now_index, now_clock = now_index * cached_t, now_clock * cached_t
        return torch.equal(rows.index, now_index) and torch.equal(rows.clock, now_clock)

    def _append(
        self,
        key: tuple[Any, ...],
        rows: _Rows,
        ids: Tensor,
        read: tuple[Tensor, Tensor, Tensor],
        lengths: list[int],
        host_index: np.ndarray,
        host_clock: np.ndarray,
    ) -> Tensor:
        """Feed each row its one new token (the last of its prefix) after its cache: the decode
        step of :meth:`_forward` without its general bookkeeping."""
        index, clock, length = read  # (n, L), (n, L), (n,) on the host
        n, width = ids.shape
        dev = ids.device
        last = rows.length.unsqueeze(1)  # (n, 1) the new token's position in each row
        end = rows.end  # the cache column it goes to
        pos = last if dev.type == "cpu" else last.to(dev)
        mask, columns = _room(rows, end + 1, width)
        # (one row: ``columns`` as NumPy, where its new position's column goes)
        host: np.ndarray | None = None
        # (one row: its new token is a view of its prefix; a model never writes its input ids)
        fed = ids.narrow(1, lengths[0] - 1, 1) if n == 1 else ids.gather(1, pos)
        out = self.model(
            input_ids=fed,
            # no padding: the mask is all ones, which transformers would look over only to drop
            # it (one query a row, no padding: SDPA needs no mask); else the new column is 1
            attention_mask=None if rows.full else mask.narrow(1, 0, end + 1),
            position_ids=pos,
            cache=rows.cache,  # (filled in place)
            use_cache=True,
            logits_to_keep=1,
        )
        self.fed += n
        # the new position's column; those after a row's length stay 0 (as _forward keeps them)
        if n == 1:  # (on the host, as a number)
            host = rows.host_columns if columns is rows.columns else None
            if host is None:
                host = columns.numpy()
            host[0, lengths[0] - 1] = end
        else:
            columns.narrow(1, 0, width).scatter_(1, last, end)
        self._rows[key] = _Rows(
            rows.cache,
            mask,
            end + 1,
            index,
            clock,
            columns,
            length,
            lengths,
            full=rows.full,
            host_columns=host,
            host_index=host_index,
            host_clock=host_clock,
        )
        while len(self._rows) > self.max_cached:
            self._rows.popitem(last=False)
        return out.logits.select(1, -1)  # (n, V)

    def _subset(self, key: tuple[Any, ...]) -> _Rows | None:
        """The cached rows of ``key`` taken out of a larger cached set holding them all (a
        ``frontier`` schedule's rows finish at different epochs: the rest go on with their
        caches), or None."""
        want = key[1:]
        for held in reversed(self._rows):  # the most recent first
            if held[0] != key[0] or len(held) <= len(key):
                continue
            place = {first: i for i, first in enumerate(held[1:])}
            if not all(first in place for first in want):
                continue
            rows = self._rows.pop(held)
            pick = torch.tensor([place[first] for first in want], dtype=torch.int64)
            rows.cache.batch_select_indices(pick.to(rows.mask.device))  # (in place)
            return _Rows(
                rows.cache,
                rows.mask.index_select(0, pick.to(rows.mask.device)),
                rows.end,
                rows.index.index_select(0, pick),
                rows.clock.index_select(0, pick),
                rows.columns.index_select(0, pick),
                rows.length.index_select(0, pick),
                [rows.lengths[i] for i in pick.tolist()],
            )
        return None

    @staticmethod
    def _reuse(
        rows: _Rows | None, index: Tensor, clock: Tensor, length: Tensor
    ) -> tuple[int, Tensor]:
        """The cache column to keep up to, and per row the first position to feed again."""
        n, width = index.shape
        if rows is None:
            return 0, torch.zeros(n, dtype=torch.int64)
        lc = rows.index.shape[1]
        if (
            width >= lc
            and torch.equal(rows.index, index[:, :lc])
            and torch.equal(rows.clock, clock[:, :lc])
            and bool((length > rows.length).all())
        ):  # every cached position unchanged, new ones after it (one token an epoch): keep all
            return rows.end, rows.length
        w = min(width, lc)
        posr = torch.arange(w).unsqueeze(0)
        same = (rows.index[:, :w] == index[:, :w]) & (rows.clock[:, :w] == clock[:, :w])
        same &= posr < torch.minimum(rows.length, length - 1).unsqueeze(1)
        # matched: leading equal positions per row (at most length - 1: the last is fed again)
        matched = torch.cumprod(same.to(torch.int64), dim=1).sum(1)  # (n,)
        end = rows.end
        at = rows.column.gather(1, matched.clamp(max=max(lc - 1, 0)).unsqueeze(1)).squeeze(1)
        col = torch.where(matched < rows.length, at, end)  # first column to drop, per row
        start = int(col.min())
        # positions kept per row: those cached in columns before ``start``
        cached = torch.arange(lc).unsqueeze(0) < rows.length.unsqueeze(1)
        keep = ((rows.column < start) & cached).sum(1)
        return start, torch.minimum(keep, matched)


@dataclass(frozen=True, slots=True)
class _ReadNames:
    """The input names of the read holding the prefix (``read``: its name in the rule)."""

    read: str
    dense: str
    index: str
    clock: str
    length: str

    @staticmethod
    def of(read: str) -> _ReadNames:
        return _ReadNames(
            read, f"{read}_dense", f"{read}_dense_index", f"{read}_dense_clock", f"{read}_length"
        )


def _room(rows: _Rows, width: int, columns: int) -> tuple[Tensor, Tensor]:
    """``rows``' growing buffers holding at least ``width`` attention columns (all ones past the
    cached ones) and ``columns`` position columns (zeros past the cached ones), doubled (with
    the cached entries copied) when too small: a decode step of width N copies nothing of it."""
    mask, cols = rows.mask, rows.columns
    n = mask.shape[0]
    if mask.shape[1] < width:
        mask = mask.new_ones(n, max(2 * width, 64))
        mask[:, : rows.end] = rows.attention
    if cols.shape[1] < columns:
        cols = torch.zeros(n, max(2 * columns, 64), dtype=torch.int64)
        lc = rows.index.shape[1]
        cols[:, :lc] = rows.column
    return mask, cols
