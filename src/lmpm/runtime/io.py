"""Inputs and outputs of `lmpm run`.

Inputs (``--input NAME=PATH``): ``.npy`` / ``.pt`` arrays of the value's shape (tokens: ``-1`` means
unset; numbers: NaN means unset), ``.json`` nested lists (``null`` = unset), and any other file as
text for ``Token[Byte]`` values (one byte per cell along the sequence; cells past the text stay unset).

Outputs in RUN_DIR: every value as ``NAME.npy`` (unset as above) and, up to 100k cells, ``NAME.json``
(nested lists, ``null`` = unset). Files are written beside and renamed, so a crash never leaves a
half-written output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmpm.errors import InputError
from lmpm.resolve.plan import ValuePlan
from lmpm.runtime.lock import atomic_write, os_error

JSON_LIMIT = 100_000  # cells; larger values are written as .npy only


def _expect(vp: ValuePlan) -> str:
    return f"shape {list(vp.dims)} ({vp.ncells} cells)"


def load_input(path: str | Path, vp: ValuePlan) -> tuple[Tensor, Tensor]:
    """(payload (N,), committed mask (N,)) for value ``vp`` from a file."""
    p = Path(path)
    where = {"value": vp.name, "file": str(p)}
    if not p.is_file():
        raise InputError(f"input file for `{vp.name}` not found: {p}", where=where, code="R001")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            arr = torch.from_numpy(np.load(p, allow_pickle=False))
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
            return _from_text(p.read_bytes(), vp, where)
    except InputError:
        raise
    except Exception as e:
        raise InputError(
            f"cannot read {p} as input for `{vp.name}`: {type(e).__name__}: {e}",
            where=where,
            code="R003",
        ) from None
    return _from_array(arr, vp, where)


def _from_array(arr: Tensor, vp: ValuePlan, where: dict[str, Any]) -> tuple[Tensor, Tensor]:
    if tuple(arr.shape) != vp.dims and not (arr.dim() == 1 and arr.numel() == vp.ncells):
        raise InputError(
            f"input for `{vp.name}` has shape {list(arr.shape)}; expected {_expect(vp)}",
            where=where,
            code="R004",
        )
    arr = arr.reshape(-1)
    if vp.vocab is not None:
        if arr.is_floating_point():
            if bool((~torch.isnan(arr) & (arr != arr.round())).any()):
                raise InputError(
                    f"input for `{vp.name}` holds non-integer numbers; tokens are integers",
                    where=where,
                    code="R005",
                )
            mask = ~torch.isnan(arr)
            arr = torch.nan_to_num(arr, nan=-1.0)
        elif arr.dtype == torch.bool:
            raise InputError(
                f"input for `{vp.name}` is boolean; expected integer tokens",
                where=where,
                code="R005",
            )
        else:
            mask = arr >= 0
        payload = arr.to(torch.int64)
        bad = mask & (payload >= vp.vocab)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise InputError(
                f"input for `{vp.name}` has token {int(payload[i])} at cell {i}, outside "
                f"the vocabulary [0, {vp.vocab}); use -1 (or null) for unset",
                where=where,
                code="R006",
            )
        return torch.where(mask, payload, torch.zeros_like(payload)), mask
    arr = arr.to(torch.float32)
    mask = ~torch.isnan(arr)
    return torch.nan_to_num(arr, nan=0.0), mask


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
        if not isinstance(x, list) or len(x) != vp.dims[depth]:
            got = f"a list of {len(x)}" if isinstance(x, list) else type(x).__name__
            raise InputError(
                f"input for `{vp.name}` has {got} at {path or 'the top level'}; expected "
                f"{vp.dims[depth]} entries ({_expect(vp)})",
                where=where,
                code="R004",
            )
        for i, y in enumerate(x):
            walk(y, depth + 1, f"{path}[{i}]")

    walk(data, 0, "")
    arr = torch.tensor([float("nan") if x is None else float(x) for x in flat], dtype=torch.float64)
    return _from_array(arr, vp, where)


def _from_text(data: bytes, vp: ValuePlan, where: dict[str, Any]) -> tuple[Tensor, Tensor]:
    if vp.vocab != 256 or len(vp.dims) != 1:
        raise InputError(
            f"text input needs a Token[Byte] Seq value; `{vp.name}` is not one",
            where=where,
            code="R008",
            hint="use .npy, .pt or .json",
        )
    if len(data) > vp.ncells:
        raise InputError(
            f"text for `{vp.name}` is {len(data)} bytes; the value holds {vp.ncells}",
            where=where,
            code="R009",
            hint=f"shorten it or --set the length ≥ {len(data)}",
        )
    payload = torch.zeros(vp.ncells, dtype=torch.int64)
    payload[: len(data)] = torch.tensor(list(data), dtype=torch.int64)
    mask = torch.zeros(vp.ncells, dtype=torch.bool)
    mask[: len(data)] = True
    return payload, mask


def output_array(vp: ValuePlan, payload: Tensor, committed: Tensor) -> np.ndarray:
    if vp.vocab is not None:
        out = torch.where(committed, payload, torch.full_like(payload, -1))
        return out.reshape(vp.dims).numpy().astype(np.int64)
    out = torch.where(committed, payload.float(), torch.full_like(payload.float(), float("nan")))
    return out.reshape(vp.dims).numpy()


def write_outputs(
    run_dir: str | Path,
    values: dict[str, ValuePlan],
    payloads: dict[str, Tensor],
    committed: dict[str, Tensor],
) -> list[Path]:
    """Write every value as .npy (+ .json when small). Returns the files written."""
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
    return written
