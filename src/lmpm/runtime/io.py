"""Inputs and outputs of `lmpm run`.

Inputs (``--input NAME=PATH``): ``.npy`` / ``.pt`` arrays of the value's shape (tokens: ``-1`` means
unset; numbers: NaN means unset), ``.json`` nested lists (``null`` = unset), and any other file as
text for a ``Token[Byte]`` value (one byte per cell along the sequence) or a ``Token[NAME]`` value
whose vocabulary is bound to a tokenizer (``--tokenizer NAME=PATH``, :mod:`lmpm.runtime.vocab`;
encoded with it: a ``Seq`` takes the text, a ``Grid2D(B, N)`` a line per row). A token value's input may be shorter than the value along its last axis (a
prompt): it fills the first cells, and the cells past it stay unset.

Outputs in RUN_DIR: every value as ``NAME.npy`` (unset as above) and, up to 100k cells, ``NAME.json``
(nested lists, ``null`` = unset); a ``Seq`` or ``Grid2D`` value of a tokenizer's vocabulary also as
``NAME.txt`` (its text, one line per row; an unset cell reads ``_``). Files are written beside and
renamed, so a crash never leaves a half-written output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmpm.errors import InputError
from lmpm.npyfile import NpyError, load_npy, npy_header
from lmpm.resolve.plan import ValuePlan
from lmpm.runtime.lock import atomic_write, os_error
from lmpm.runtime.vocab import Vocabulary, output_text

JSON_LIMIT = 100_000  # cells; larger values are written as .npy only


def _expect(vp: ValuePlan) -> str:
    if vp.cell_shape:
        return f"shape {[*vp.dims, *vp.cell_shape]} ({vp.ncells} cells of {list(vp.cell_shape)})"
    return f"shape {list(vp.dims)} ({vp.ncells} cells)"


def load_input(
    path: str | Path, vp: ValuePlan, vocab: Vocabulary | None = None
) -> tuple[Tensor, Tensor]:
    """(payload (N,), committed mask (N,)) for value ``vp`` from a file; ``vocab``: the tokenizer
    of its vocabulary, which encodes a text input."""
    p = Path(path)
    where = {"value": vp.name, "file": str(p)}
    if not p.is_file():
        raise InputError(f"input file for `{vp.name}` not found: {p}", where=where, code="R001")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            head = npy_header(p)  # shape and dtype before a byte of data is read
            _check_shape(head.shape, vp, where)
            arr = _numpy_to_tensor(load_npy(p), vp, where)
        elif suffix == ".pt":
            obj = torch.load(p, map_location="cpu", weights_only=True)
            if not isinstance(obj, Tensor):
                raise InputError(
                    f"{p} holds a {type(obj).__name__}; expected one tensor",
                    where=where,
                    code="R002",
                )
            arr = obj
        elif suffix == ".json":
            return _from_json(json.loads(p.read_text(encoding="utf-8")), vp, where)
        else:
            return _from_text(p.read_bytes(), vp, where, vocab)
    except InputError:
        raise
    except NpyError as e:
        raise InputError(
            f"cannot read {p} as input for `{vp.name}`: {e}", where=where, code="R003"
        ) from None
    except Exception as e:
        raise InputError(
            f"cannot read {p} as input for `{vp.name}`: {type(e).__name__}: {e}",
            where=where,
            code="R003",
        ) from None
    return _from_array(arr, vp, where)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _expect_form(vp: ValuePlan) -> str:
    if vp.vocab is not None:
        return f"integer tokens in [0, {vp.vocab}) or -1 for unset"
    return f"real numbers within ±{FLOAT32_MAX:.3g} (float32) or NaN for unset"


def _bad(vp: ValuePlan, where: dict[str, Any], what: str, code: str) -> InputError:
    return InputError(
        f"input for `{vp.name}` {what}; expected {_expect_form(vp)}, {_expect(vp)}",
        where=where,
        code=code,
    )


def _numpy_to_tensor(a: np.ndarray, vp: ValuePlan, where: dict[str, Any]) -> Tensor:
    """A .npy array as a tensor torch can check: complex, text, dates and objects are refused."""
    if a.dtype.kind == "c":
        raise _bad(vp, where, f"is complex ({a.dtype})", "R013")
    if a.dtype.kind not in "biuf":
        raise _bad(vp, where, f"has dtype {a.dtype} (not numbers)", "R013")
    if a.dtype.kind == "u" and a.size and int(a.max()) >= 2**63:
        i = int(a.argmax())
        raise _bad(vp, where, f"has {int(a.reshape(-1)[i])} at cell {i}", "R015")
    if a.dtype.kind in "iu" or a.dtype.kind == "b":
        return torch.from_numpy(a.astype(np.int64 if a.dtype.kind != "b" else np.bool_))
    return torch.from_numpy(a.astype(np.float64))


def _first(mask: Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _check_shape(shape: tuple[int, ...], vp: ValuePlan, where: dict[str, Any]) -> None:
    """R004 unless ``shape`` is the value's (its dims, one axis of its cells, or for tokens a
    prompt: shorter along the last axis only). Checked on a .npy header before its data."""
    if vp.cell_shape:
        full = (*vp.dims, *vp.cell_shape)
        ok = shape in (full, (vp.ncells, *vp.cell_shape))
    else:
        ok = shape == vp.dims or (len(shape) == 1 and shape[0] == vp.ncells)
        prompt = (
            len(shape) == len(vp.dims)
            and shape[:-1] == vp.dims[:-1]
            and 0 < shape[-1] < vp.dims[-1]
        )
        ok = ok or (vp.vocab is not None and prompt)
    if not ok:
        raise InputError(
            f"input for `{vp.name}` has shape {list(shape)}; expected {_expect(vp)}",
            where=where,
            code="R004",
            hint=None if vp.cell_shape else _shape_hint(vp),
        )


def _from_array(arr: Tensor, vp: ValuePlan, where: dict[str, Any]) -> tuple[Tensor, Tensor]:
    _check_shape(tuple(arr.shape), vp, where)
    if vp.cell_shape:
        if arr.is_complex():
            raise _bad(vp, where, f"is complex ({arr.dtype})", "R013")
        if arr.dtype == torch.bool:
            raise InputError(
                f"input for `{vp.name}` is {arr.dtype}; expected real numbers",
                where=where,
                code="R005",
            )
        if arr.is_floating_point() and bool(torch.isinf(arr).any()):
            raise _bad(vp, where, "holds ±inf (use NaN for an unset cell)", "R014")
        arr = arr.to(torch.float32).reshape(vp.ncells, *vp.cell_shape)
        mask = ~torch.isnan(arr).flatten(1).any(dim=1)  # a cell with any NaN is unset
        return torch.nan_to_num(arr, nan=0.0), mask
    if vp.vocab is not None and _prompt(arr, vp):
        arr = _pad(arr, vp)
    if arr.is_complex():
        raise _bad(vp, where, f"is complex ({arr.dtype})", "R013")
    arr = arr.reshape(-1)
    if arr.is_floating_point():
        arr = arr.to(torch.float64)
        inf = torch.isinf(arr)
        if bool(inf.any()):
            i = _first(inf)
            raise _bad(vp, where, f"has {float(arr[i])} at cell {i}", "R014")
    if vp.vocab is not None:
        if arr.dtype == torch.bool:
            raise _bad(vp, where, "is boolean", "R005")
        if arr.is_floating_point():
            frac = ~torch.isnan(arr) & (arr != arr.round())
            if bool(frac.any()):
                i = _first(frac)
                raise _bad(vp, where, f"has the non-integer {float(arr[i])} at cell {i}", "R005")
            unset = torch.isnan(arr) | (arr == -1)
            arr = torch.where(unset, torch.zeros_like(arr), arr)
        else:
            unset = arr == -1
        low = ~unset & (arr < 0)
        if bool(low.any()):
            i = _first(low)
            raise _bad(
                vp,
                where,
                f"has the negative token {_num(arr[i])} at cell {i} (-1 alone is unset)",
                "R016",
            )
        high = ~unset & (arr >= vp.vocab)
        if bool(high.any()):
            i = _first(high)
            raise InputError(
                f"input for `{vp.name}` has token {_num(arr[i])} at cell {i}, outside "
                f"the vocabulary [0, {vp.vocab}); use -1 (or null) for unset",
                where=where,
                code="R006",
            )
        mask = ~unset
        payload = torch.where(mask, arr, torch.zeros_like(arr)).to(torch.int64)
        return payload, mask
    if arr.dtype == torch.bool:
        raise _bad(vp, where, "is boolean", "R013")
    arr = arr.to(torch.float64)
    big = torch.abs(arr) > FLOAT32_MAX
    if bool(big.any()):
        i = _first(big)
        raise _bad(vp, where, f"has {float(arr[i]):.6g} at cell {i}, beyond float32", "R015")
    mask = ~torch.isnan(arr)
    return torch.nan_to_num(arr, nan=0.0).to(torch.float32), mask


def _prompt(arr: Tensor, vp: ValuePlan) -> bool:
    """A token input shorter than the value along its last axis only (a prompt)."""
    shape = tuple(arr.shape)
    return (
        len(shape) == len(vp.dims)
        and shape[:-1] == vp.dims[:-1]
        and 0 < shape[-1] < vp.dims[-1]
        and not arr.is_complex()
    )


def _pad(arr: Tensor, vp: ValuePlan) -> Tensor:
    """``arr`` filled up to the value's last axis with unset cells (-1, or NaN for floats)."""
    unset = float("nan") if arr.is_floating_point() else -1
    out = torch.full(vp.dims, unset, dtype=arr.dtype)
    out[..., : arr.shape[-1]] = arr
    return out


def _shape_hint(vp: ValuePlan) -> str:
    if vp.vocab is not None:
        return (
            f"an input shorter along the last axis (a prompt of up to {vp.dims[-1]} tokens) fills "
            "the first cells; -1 (or null) marks any other unset cell"
        )
    return "give every cell; NaN (or null) marks an unset one"


def _num(x: Tensor) -> str:
    v = float(x) if x.is_floating_point() else int(x)
    return f"{v:.6g}" if isinstance(v, float) and abs(v) >= 1e15 else str(int(v))


def _from_json(data: Any, vp: ValuePlan, where: dict[str, Any]) -> tuple[Tensor, Tensor]:
    flat: list[Any] = []

    def walk(x: Any, depth: int, path: str) -> None:
        if depth == len(vp.dims):
            if x is not None and (isinstance(x, bool) or not isinstance(x, int | float)):
                raise InputError(
                    f"input for `{vp.name}` has {json.dumps(x)[:40]} at {path}; expected a "
                    "number or null",
                    where=where,
                    code="R007",
                )
            flat.append(x)
            return
        last = depth == len(vp.dims) - 1
        if isinstance(x, list) and last and vp.vocab is not None and 0 < len(x) < vp.dims[depth]:
            x = [*x, *[None] * (vp.dims[depth] - len(x))]  # a prompt: the rest stays unset
        if not isinstance(x, list) or len(x) != vp.dims[depth]:
            got = f"a list of {len(x)}" if isinstance(x, list) else type(x).__name__
            raise InputError(
                f"input for `{vp.name}` has {got} at {path or 'the top level'}; expected "
                f"{vp.dims[depth]} entries ({_expect(vp)})",
                where=where,
                code="R004",
                hint=_shape_hint(vp),
            )
        for i, y in enumerate(x):
            walk(y, depth + 1, f"{path}[{i}]")

    walk(data, 0, "")
    try:
        nums = [float("nan") if x is None else float(x) for x in flat]
    except OverflowError:
        i = next(i for i, x in enumerate(flat) if isinstance(x, int) and abs(x) > 1e308)
        raise _bad(
            vp, where, f"has a {len(str(flat[i]))}-digit integer at cell {i}", "R015"
        ) from None
    arr = torch.tensor(nums, dtype=torch.float64)
    return _from_array(arr, vp, where)


def _from_text(
    data: bytes, vp: ValuePlan, where: dict[str, Any], vocab: Vocabulary | None
) -> tuple[Tensor, Tensor]:
    """Bytes for a Token[Byte] Seq; a tokenizer's tokens for a Seq (the text) or a Grid2D(B, N)
    (a line per row) of its vocabulary. Cells past the text stay unset."""
    grid = vocab is not None and len(vp.dims) == 2
    if not (len(vp.dims) == 1 or grid) or vp.vocab is None or (vocab is None and vp.vocab != 256):
        hint = "use .npy, .pt or .json"
        if vp.vocab is not None and vocab is None:
            hint = (
                "bind its vocabulary to a tokenizer: --tokenizer NAME=tokenizer.json, where NAME "
                "is the vocabulary of `Token[NAME]` (Python: tokenizers={'NAME': path}), or " + hint
            )
        raise InputError(
            f"text input needs a Token[Byte] Seq value, or a Seq or Grid2D(B, N) value whose "
            f"vocabulary is bound to a tokenizer; `{vp.name}` is neither",
            where=where,
            code="R008",
            hint=hint,
        )
    if vocab is None:
        rows, unit = [list(data)], "bytes"
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"text for `{vp.name}` is not UTF-8 (byte {e.start})", where=where, code="R003"
            ) from None
        if text.endswith("\n"):  # the newline that ends a text file is not part of the prompt
            text = text[:-1]
        lines = text.split("\n") if grid else [text]
        if len(lines) > vp.dims[0] and grid:
            raise InputError(
                f"text for `{vp.name}` has {len(lines)} lines; the value holds {vp.dims[0]} rows",
                where=where,
                code="R009",
                hint="give a line per row (a prompt each), at most as many as the value's rows",
            )
        rows, unit = [vocab.encode(line) for line in lines], f"tokens of {vocab.name}"
    width = vp.dims[-1] if grid else vp.ncells
    payload = torch.zeros(vp.ncells, dtype=torch.int64)
    mask = torch.zeros(vp.ncells, dtype=torch.bool)
    for r, ids in enumerate(rows):
        if len(ids) > width:
            line = f"line {r + 1} of the text" if grid else "text"
            raise InputError(
                f"{line} for `{vp.name}` is {len(ids)} {unit}; the value holds {width}"
                + (" per row" if grid else ""),
                where=where,
                code="R009",
                hint=f"shorten it or --set the length ≥ {len(ids)}",
            )
        payload[r * width : r * width + len(ids)] = torch.tensor(ids, dtype=torch.int64)
        mask[r * width : r * width + len(ids)] = True
    return payload, mask


def output_array(vp: ValuePlan, payload: Tensor, committed: Tensor) -> np.ndarray:
    if vp.vocab is not None:
        out = torch.where(committed, payload, torch.full_like(payload, -1))
        return out.reshape(vp.dims).numpy().astype(np.int64)
    mask = committed.reshape(-1, *([1] * len(vp.cell_shape)))
    out = torch.where(mask, payload.float(), torch.full_like(payload.float(), float("nan")))
    return out.reshape(*vp.dims, *vp.cell_shape).numpy()


def write_outputs(
    run_dir: str | Path,
    values: dict[str, ValuePlan],
    payloads: dict[str, Tensor],
    committed: dict[str, Tensor],
    vocabs: Mapping[str, Vocabulary] | None = None,
) -> list[Path]:
    """Write every value as .npy (+ .json when small; + .txt for a value of a tokenizer's
    vocabulary, ``vocabs``: value name -> its tokenizer). Returns the files written."""
    import io as _io

    d = Path(run_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, "create the run directory", d) from None
    written: list[Path] = []
    for name, vp in values.items():
        arr = output_array(vp, payloads[name], committed[name])
        buf = _io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        atomic_write(d / f"{name}.npy", buf.getvalue())
        written.append(d / f"{name}.npy")
        if vp.ncells <= JSON_LIMIT:
            unset = (arr < 0) if vp.vocab is not None else np.isnan(arr)
            nested = arr.astype(object)
            nested[unset] = None
            nested = nested.tolist()
            atomic_write(d / f"{name}.json", json.dumps(nested, separators=(",", ":")).encode())
            written.append(d / f"{name}.json")
        vocab = (vocabs or {}).get(name)
        if vocab is not None and arr.ndim in (1, 2):
            atomic_write(d / f"{name}.txt", output_text(arr, vocab).encode("utf-8"))
            written.append(d / f"{name}.txt")
    return written
