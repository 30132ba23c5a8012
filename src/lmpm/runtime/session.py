"""One run of a program: front end → plan → engine → outputs. The Python API behind `lmpm run`.

>>> import lmpm.runtime.session as s
>>> src = '''
... param N = 6
... value Txt : Token[Byte] shape Seq(N)
... visible Txt[t] <- Txt[0..t-1] when t > 0
... rule Gen:
...   on Txt[t]
...   read {ctx = Txt[0..t-1]}
...   emit proposal Txt[t] := Uniform(ctx)
... constraint Lower: require Txt[t] in Set(97..122) priority 10
... '''
>>> run = s.Run.from_source(src, seed=1)
>>> res = run.run(epochs=20)
>>> text = run.outputs()["Txt"]
>>> all(97 <= int(b) <= 122 for b in text) and len(text) == 6
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lmpm.bindings import Bindings
from lmpm.errors import InputError
from lmpm.ir import Frontend, compile_file, compile_source
from lmpm.resolve.plan import Plan, resolve
from lmpm.runtime.engine import Engine, Observer, RunResult
from lmpm.runtime.io import load_input, output_array, write_outputs


class Run:
    """A program bound to parameters, bindings, inputs and a seed, ready to run epochs."""

    def __init__(
        self,
        front: Frontend,
        *,
        params: Mapping[str, int] | None = None,
        bind: Sequence[str] = (),
        bindings: Mapping[str, Any] | None = None,
        inputs: Mapping[str, str | Path] | None = None,
        seed: int = 0,
        backend: str = "cpu",
        epochs: int | None = None,
        observers: Sequence[Observer] = (),
        guard: bool = False,
    ) -> None:
        self.front = front
        self.params = dict(params or {})
        self.bindings = Bindings(bind, dict(bindings or {}))
        self.plan: Plan = resolve(front.ir, self.params, self.bindings, epochs=epochs)
        self.engine = Engine(
            self.plan, backend=backend, seed=seed, observers=observers, guard=guard
        )
        self.dataplane = self.engine.dataplane
        for name, path in (inputs or {}).items():
            vp = self.plan.values.get(name)
            if vp is None:
                from lmpm.errors import UsageError

                raise UsageError(
                    f"--input {name}=...: the program has no value `{name}` with cells",
                    hint="values: " + ", ".join(self.plan.values),
                    code="U020",
                )
            payload, mask = load_input(path, vp)
            self.set_input(name, payload, mask)

    @classmethod
    def from_source(cls, text: str, file: str = "<input>", **kw: Any) -> Run:
        return cls(compile_source(text, file, overrides=kw.get("params")), **kw)

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> Run:
        return cls(compile_file(path, overrides=kw.get("params")), **kw)

    def run(self, epochs: int | None = None, *, until_stable: bool = False, **kw: Any) -> RunResult:
        return self.engine.run(epochs, until_stable=until_stable, **kw)

    def set_input(self, value: str, payload: Tensor, mask: Tensor) -> None:
        """Commit ``payload[mask]`` of ``value`` as given input: the payload goes to the worker,
        the control plane records which cells are committed (provenance INPUT, clock 1)."""
        vp = self.plan.values.get(value)
        if vp is None:
            raise InputError(
                f"there is no value `{value}` with cells to take input",
                code="R010",
                hint="values: " + ", ".join(self.plan.values),
            )
        if payload.numel() != vp.ncells * math.prod(vp.cell_shape):
            raise InputError(
                f"input for `{value}` has {payload.numel()} elements; `{value}` has shape "
                f"{vp.dims} = {vp.ncells} cells"
                + (f" of {vp.cell_shape}" if vp.cell_shape else ""),
                where={"value": value},
                code="R011",
            )
        cells = self.dataplane.set_input(value, payload, mask)
        self.engine.mark_input(value, cells)

    def payload(self, value: str) -> Tensor:
        """The committed payload of ``value`` ((ncells, *cell), fetched from the worker; unset
        cells hold 0)."""
        return self.dataplane.read(value)[0]

    def outputs(self) -> dict[str, Any]:
        """Committed values as numpy arrays (unset: -1 for tokens, NaN for numbers)."""
        out = {}
        for name, vp in self.plan.values.items():
            payload, committed = self.dataplane.read(name)
            out[name] = output_array(vp, payload, committed)
        return out

    def payloads(self) -> dict[str, Tensor]:
        return {name: self.payload(name) for name in self.plan.values}

    def write(self, run_dir: str | Path) -> list[Path]:
        reads = {name: self.dataplane.read(name) for name in self.plan.values}
        return write_outputs(
            run_dir,
            self.plan.values,
            {n: r[0] for n, r in reads.items()},
            {n: r[1] for n, r in reads.items()},
        )
