"""`lmpm.compile`: one object for a program bound to parameters — its IR, masks, and runs.

>>> import lmpm
>>> prog = lmpm.compile("value Txt : Token[Byte] shape Seq(N)\\nvisible Txt[t] <- Txt[0..t-1] when t > 0\\n", N=4)
>>> prog.masks(layout="raster").dense().int().tolist()
[[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmpm.ir import Frontend, compile_file, compile_source
from lmpm.ir.nodes import Program

if TYPE_CHECKING:
    from lmpm.runtime.session import Run
    from lmpm.visibility import Masks


@dataclass(frozen=True)
class Compiled:
    """A checked program with its parameter bindings (``--set``)."""

    front: Frontend
    params: dict[str, int] = field(default_factory=dict)

    @property
    def ir(self) -> Program:
        return self.front.ir

    def masks(self, layout: str = "auto") -> Masks:
        """Attention masks, BlockMasks and gather tables compiled from the `visible` clauses."""
        from lmpm.visibility import masks

        return masks(self.ir, self.params, layout)

    def runner(self, **kw: Any) -> Run:
        """A :class:`lmpm.runtime.session.Run` (``bindings=``, ``inputs=``, ``seed=``...)."""
        from lmpm.runtime.session import Run

        return Run(self.front, params=self.params, **kw)


def compile(src: str | Path, **params: int) -> Compiled:
    """Compile a program (source text, or a path to a ``.lmpm`` file) with parameters bound."""
    text = str(src)
    is_path = isinstance(src, Path) or ("\n" not in text and text.endswith(".lmpm"))
    front = (
        compile_file(text, overrides=params) if is_path else compile_source(text, overrides=params)
    )
    return Compiled(front, dict(params))
