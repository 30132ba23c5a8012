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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lmpm.bindings import Bindings
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
    ) -> None:
        self.front = front
        self.params = dict(params or {})
        self.bindings = Bindings(bind, dict(bindings or {}))
        self.plan: Plan = resolve(front.ir, self.params, self.bindings, epochs=epochs)
        self.engine = Engine(self.plan, backend=backend, seed=seed, observers=observers)
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
            self.engine.set_input(name, payload, mask)

    @classmethod
    def from_source(cls, text: str, file: str = "<input>", **kw: Any) -> Run:
        return cls(compile_source(text, file, overrides=kw.get("params")), **kw)

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> Run:
        return cls(compile_file(path, overrides=kw.get("params")), **kw)

    def run(self, epochs: int | None = None, *, until_stable: bool = False, **kw: Any) -> RunResult:
        return self.engine.run(epochs, until_stable=until_stable, **kw)

    def outputs(self) -> dict[str, Any]:
        """Committed values as numpy arrays (unset: -1 for tokens, NaN for numbers)."""
        return {
            name: output_array(vp, self.engine.payload(name), self.engine.state[name].committed)
            for name, vp in self.plan.values.items()
        }

    def payloads(self) -> dict[str, Tensor]:
        return {name: self.engine.payload(name) for name in self.plan.values}

    def write(self, run_dir: str | Path) -> list[Path]:
        return write_outputs(
            run_dir,
            self.plan.values,
            self.payloads(),
            {n: s.committed for n, s in self.engine.state.items()},
        )
