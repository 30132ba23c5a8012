"""The generated ``mask_mod`` as Python source, written the way a careful user writes one.

:func:`lmpm.visibility.maskmod.build_mask_mod` decides *what* a program's ``visible`` clauses test
by walking them (an interpreter over the clauses, their plans and the value space). Handing that
walker itself to FlexAttention costs twice on a GPU, although it computes the same thing as a
hand-written mask_mod, op for op (measured on an H200, docs/gpu.md):

- **guards**: ``torch.compile`` guards on everything the walker reads (the space's dicts, the
  clauses, the plans), checked on every call: about 12 µs per forward, 15% of an 8k-token
  sliding-window forward;
- **register pressure**: the kernel evaluates the mask_mod on a whole 128×128 tile, so every live
  intermediate is a tile of registers. The walker's order (each clause's tests built apart, then
  AND-ed; ``x != 0`` tests on differences that stay live) kept more tiles alive than the
  hand-written order, and the video forward ran 1.7× slower with identical blocks and op counts.

So the walker runs once, traced by ``make_fx`` into an aten graph, and this module prints that
graph as a plain Python function: integer constants as literals (no closure, nothing to guard but
the code), associative ``&``/``|`` chains flattened and folded left to right, each intermediate
computed just before its first use, and ``(a - b) != 0`` written ``a != b``. The layout table of a
tiled or Morton layout is the one captured tensor (a global of the generated function).
"""

from __future__ import annotations

import itertools
import linecache
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

aten = torch.ops.aten

# aten ops written as Python's operators on tensors
_BINARY = {
    aten.add.Tensor: "+",
    aten.sub.Tensor: "-",
    aten.mul.Tensor: "*",
    aten.floor_divide.default: "//",
    aten.remainder.Scalar: "%",
    aten.remainder.Tensor: "%",
    aten.eq.Tensor: "==",
    aten.eq.Scalar: "==",
    aten.ne.Tensor: "!=",
    aten.ne.Scalar: "!=",
    aten.lt.Tensor: "<",
    aten.lt.Scalar: "<",
    aten.le.Tensor: "<=",
    aten.le.Scalar: "<=",
    aten.gt.Tensor: ">",
    aten.gt.Scalar: ">",
    aten.ge.Tensor: ">=",
    aten.ge.Scalar: ">=",
    aten.bitwise_and.Tensor: "&",
    aten.bitwise_or.Tensor: "|",
}
_CHAIN = {aten.bitwise_and.Tensor, aten.bitwise_or.Tensor}
_ZERO_TESTS = {aten.eq.Scalar, aten.ne.Scalar}

_counter = itertools.count()


def emit_mask_mod(
    core: Callable[[Tensor, Tensor], Any], table: Tensor | None, *, name: str = "mask_mod"
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """``mask_mod(b, h, q_idx, kv_idx)`` computing ``core(q, kv)`` on the canonical positions
    (``table[q_idx]``, ``table[kv_idx]`` where a layout table is given), as generated source.
    ``core`` is traced once on 0-d int32 indices; it must not branch on their values. Its result
    may be a Python bool (every pair, or none)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    traced: list[Any] = []

    def probe(q: Tensor, kv: Tensor) -> Tensor:
        out = core(q, kv)
        traced.append(out)
        return out if isinstance(out, Tensor) else q  # a placeholder result for a constant

    # two tensors: make_fx tells its inputs apart by identity
    gm = make_fx(probe)(torch.zeros((), dtype=torch.int32), torch.zeros((), dtype=torch.int32))
    gm.graph.eliminate_dead_code()
    lines = [f"def {name}(b, h, q_idx, kv_idx):"]
    if table is not None:
        lines += ["    q = _table[q_idx]", "    kv = _table[kv_idx]"]
    else:
        lines += ["    q = q_idx", "    kv = kv_idx"]
    if not isinstance(traced[0], Tensor):  # constant: still a tensor shaped like the indices
        lines.append(f"    return q_idx {'>=' if traced[0] else '<'} 0")
    else:
        lines += _Printer(gm).body()
    src = "\n".join(lines) + "\n"
    filename = f"<lmpm mask_mod {next(_counter)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict[str, Any] = {"torch": torch, "aten": aten, "_table": table}
    exec(compile(src, filename, "exec"), namespace)  # our own generated source
    fn = namespace[name]
    fn.lmpm_source = src  # the source FlexAttention compiles, for readers and tests
    return fn  # type: ignore[no-any-return]


class _Printer:
    """One traced graph as statements: chains flattened, values emitted at first use."""

    def __init__(self, gm: GraphModule) -> None:
        nodes = list(gm.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        self.names: dict[Node, str] = dict(zip(placeholders, ("q", "kv")))
        self.users: dict[Node, int] = {n: len(n.users) for n in nodes}
        self.out = next(n for n in nodes if n.op == "output").args[0]
        self.lines: list[str] = []
        self.fresh = itertools.count()

    def body(self) -> list[str]:
        self.lines.append(f"    return {self.value(self.out)}")
        return self.lines

    def value(self, n: Any) -> str:
        """The expression of argument ``n``: a name (emitted now if first needed) or a literal."""
        if isinstance(n, list | tuple):
            return f"[{', '.join(self.value(x) for x in n)}]"
        if not isinstance(n, Node):
            return _literal(n)
        if n not in self.names:
            self.names[n] = self.emit(n)
        return self.names[n]

    def emit(self, n: Node) -> str:
        if n.op != "call_function":
            raise ValueError(f"mask_mod trace: unexpected {n.op} node {n.name}")
        if n.target in _CHAIN:
            return self.chain(n)
        expr = self.expression(n)
        var = f"t{next(self.fresh)}"
        self.lines.append(f"    {var} = {expr}")
        return var

    def expression(self, n: Node) -> str:
        target, args = n.target, n.args
        if target in _ZERO_TESTS and args[1] == 0 and _is_sub(args[0]):
            # (a - b) != 0 is a != b: the difference need not stay live for this test
            a, b = args[0].args  # type: ignore[union-attr]
            return f"{self.value(a)} {_BINARY[target]} {self.value(b)}"  # type: ignore[index]
        if target in _BINARY and not n.kwargs:
            return f"{self.value(args[0])} {_BINARY[target]} {self.value(args[1])}"  # type: ignore[index]
        if target is aten.abs.default:
            return f"{self.value(args[0])}.abs()"
        if target is aten.index.Tensor and len(args[1]) == 1:  # type: ignore[arg-type]
            return f"{self.value(args[0])}[{self.value(args[1][0])}]"  # type: ignore[index]
        call = ", ".join(
            [self.value(a) for a in args] + [f"{k}={self.kwarg(k, v)}" for k, v in n.kwargs.items()]
        )
        return f"aten.{target.__name__}({call})"  # type: ignore[union-attr]

    def kwarg(self, key: str, v: Any) -> str:
        if key == "device":
            return "q_idx.device"  # constants made in the trace: on the indices' device
        return self.value(v)

    def chain(self, n: Node) -> str:
        """``a & b & c ...`` (or ``|``) flattened over single-use links, folded left to right:
        one running tile, each operand computed just before it joins."""
        op = _BINARY[n.target]  # type: ignore[index]
        var = f"t{next(self.fresh)}"
        first, *rest = self.operands(n, n.target)
        acc = self.value(first)
        for x in rest:
            self.lines.append(f"    {var} = {acc} {op} {self.value(x)}")
            acc = var
        return acc

    def operands(self, n: Node, target: Any) -> list[Any]:
        out: list[Any] = []
        for a in n.args:
            if isinstance(a, Node) and a.target is target and self.users[a] == 1:
                out += self.operands(a, target)
            else:
                out.append(a)
        return out


def _is_sub(a: Any) -> bool:
    return isinstance(a, Node) and a.target is aten.sub.Tensor


def _literal(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"  # inf, -inf, nan: repr is not Python source
    if isinstance(v, bool | int | float) or v is None:
        return repr(v)
    if isinstance(v, torch.dtype | torch.layout | torch.memory_format):
        return str(v)  # torch.int64, torch.strided, ...
    raise ValueError(f"mask_mod trace: unexpected constant {v!r}")
