"""Shapes and bounds: the parameters bind, every dimension is exact (E203) and in range (E209),
a vocabulary named but never sized is a warning (W209), and a clause's index that can leave its
source without a guard is a warning (W202)."""

from __future__ import annotations

from lmpm.errors import LmpmError
from lmpm.ir import memo
from lmpm.ir.check.facts import Facts, probe_env
from lmpm.ir.eval import EvalError, evaluate, names_in
from lmpm.ir.nodes import AxisKind, Expr, Op, Stencil, Value
from lmpm.ir.printer import expr_str
from lmpm.ir.probe import Compiled, probe_cells
from lmpm.lang import ast

MAX_DIM = 2**48  # larger dimensions are an error (E209): no machine holds such a value

# (source axis, index, size, probe cell, variables used) per clause structure, shared by every
# check in the process (see lmpm.ir.probe)
_OOB = list[tuple[int, int, int, tuple[int, ...], set[str]]]
_BOUNDS: dict[tuple[object, ...], _OOB] = memo.cache()


def check_shapes(f: Facts) -> bool:
    """Bind the parameters and evaluate every value's dims into ``f``; False: stop checking."""
    try:
        f.env = probe_env(f.p, f.overrides)
    except LmpmError as e:  # BindError: report as a diagnostic at the program level
        f.sink.error(e.code, e.message, e.span, e.hint)
        return False
    ok = True
    implicit = {p.name for p in f.p.params if not p.declared}
    for v in f.p.values:
        ok &= _dims(f, v)
        if v.vocab_name in implicit and v.vocab_name not in f.overrides:
            f.sink.warning(
                "W209",
                f"the vocabulary `{v.vocab_name}` of `{v.name}` has no size: a run needs one",
                v.span,
                f"bind it to a tokenizer (lmpm run/check --tokenizer {v.vocab_name}="
                f"tokenizer.json), or give its size (--set {v.vocab_name}=V, or "
                f"`param {v.vocab_name} = V`)",
            )
        if v.vocab is not None:
            try:
                if evaluate(v.vocab, f.env) < 1:
                    f.sink.error("E209", f"vocabulary of `{v.name}` must be at least 1", v.span)
            except EvalError:
                pass
    return ok


def _dims(f: Facts, v: Value) -> bool:
    dims: list[int] = []
    srcs = f.ast_dims.get(v.name, ())
    ok = True
    for k, d in enumerate(v.dims):
        dspan = srcs[k].span if k < len(srcs) else v.span
        ok &= _divisible(f, v, d, srcs[k] if k < len(srcs) else None)
        try:
            n = evaluate(d, f.env)
        except EvalError as e:
            f.sink.error("E203", f"dimension {k + 1} of `{v.name}` cannot be evaluated: {e}", dspan)
            ok = False
            continue
        if n < 1 or n > MAX_DIM:
            f.sink.error(
                "E209",
                f"dimension {k + 1} of `{v.name}` ({_short(expr_str(d))}) is {_num(n)}; "
                f"dimensions must be between 1 and {MAX_DIM}",
                dspan,
                "check the parameters it uses (`--set`)",
            )
            ok = False
        dims.append(n)
    f.dims[v.name] = tuple(dims)
    return ok


def _divisible(f: Facts, v: Value, d: Expr, src: ast.Expr | None = None) -> bool:
    ok = True
    stack: list[tuple[Expr, ast.Expr | None]] = [(d, src)]
    while stack:
        x, node = stack.pop()
        kids = ast.operands(node)
        if len(kids) == len(x.args):
            stack.extend(zip(x.args, kids))
        else:
            stack.extend((arg, None) for arg in x.args)
        if x.op != Op.DIV:
            continue
        try:
            a, b = evaluate(x.args[0], f.env), evaluate(x.args[1], f.env)
        except EvalError:
            continue
        if b != 0 and a % b != 0:
            bound = {n for op, n in names_in(x.args[0]) if op == Op.PARAM}
            shown = ", ".join(f"{n} = {f.env[n]}" for n in sorted(bound)) or expr_str(x.args[0])
            f.sink.error(
                "E203",
                f"`{expr_str(x)}` in the shape of `{v.name}` is not exact: "
                f"{shown} is not divisible by {b}",
                node.span if node is not None else v.span,
                f"choose a value divisible by {b} (e.g. --set with a multiple of {b})",
            )
            ok = False
    return ok


def check_bounds(f: Facts, s: Stencil) -> None:
    """Warn when an index (not a neighbourhood offset) can leave the source without a guard."""
    c = f.stencil(s)
    if c is None:
        return
    tgt = f.dims[s.target]
    key = (c.shape, tgt)
    found = _BOUNDS.get(key)
    if found is None:
        found = _BOUNDS[key] = _bounds(c, tgt)
    for k, i, n, cell, used in found:
        _oob_warning(f, s, k, i, cell, used, tgt, n)


def _oob_warning(
    f: Facts,
    s: Stencil,
    k: int,
    i: int,
    cell: tuple[int, ...],
    used: set[str],
    tgt: tuple[int, ...],
    n: int,
) -> None:
    src_v = f.p.value(s.source)
    axis = src_v.axis_names[k] if k < len(src_v.axis_names) else f"axis {k}"
    at = ", ".join(f"{v} = {c}" for v, c in zip(s.vars, cell) if v in used) or "some cells"
    var = next((v for v in s.vars if v in used), None)
    hint = _guard_hint(f, s, k, var, cell, tgt, n) if var is not None else None
    side = "-1" if i < 0 else f"{i} (past the end)"
    f.sink.warning(
        "W202",
        f"`{s.source}[...]` can read {axis} = {side} at {at}; out-of-bounds cells are dropped",
        s.span,
        hint or "add a `when` guard that keeps the index inside the value",
    )


def _guard_hint(
    f: Facts, s: Stencil, k: int, var: str, cell: tuple[int, ...], tgt: tuple[int, ...], n: int
) -> str | None:
    """The guard on ``var`` that keeps source axis ``k`` in bounds over all of var's values."""
    j = s.vars.index(var)
    bad = []
    for val in range(tgt[j] if tgt[j] <= 4096 else 0):  # huge axes: no specific hint
        env = f.target_env(s.vars, tuple(val if q == j else c for q, c in enumerate(cell)))
        try:
            assert s.axes[k].lo is not None
            idx = evaluate(s.axes[k].lo, env)  # type: ignore[arg-type]
        except EvalError:
            break
        if not 0 <= idx < n:
            bad.append(val)
    if bad and max(bad) < tgt[j] // 2 + 1 and bad == list(range(len(bad))):
        return f"add `when {var} > {len(bad) - 1}`"
    if bad and bad == list(range(tgt[j] - len(bad), tgt[j])):
        d = f.p.value(s.target).dims[j]
        bound = str(tgt[j] - len(bad)) if d.op == Op.CONST else f"{expr_str(d)}-{len(bad)}"
        return f"add `when {var} < {bound}`"
    return None


def _bounds(c: Compiled, tgt: tuple[int, ...]) -> _OOB:
    """(source axis, index, size, probe cell, variables used) of the first out-of-bounds index
    found on each source axis; indices that use binder variables are clipped silently."""
    out: _OOB = []
    reported: set[int] = set()
    pad = (0,) * (len(c.order) - len(c.shape.vars))
    dims = c.shape.dims
    for cell in probe_cells(tgt, frozenset(c.relevant_axes())):
        if c.target_guard is not None:
            try:
                if not c.target_guard(*cell):
                    continue
            except EvalError:
                pass
        k = 0
        for (kind, lo, _hi, width), ax in zip(c.axes, c.shape.axes):
            if kind != AxisKind.AT or k in reported:
                k += width
                continue
            assert lo is not None
            used = {n for op, n in names_in(ax.lo) if op == Op.VAR}
            if used & c.binder_vars:
                k += 1
                continue
            try:
                i = lo(*cell, *pad)
            except EvalError:
                k += 1
                continue
            n = dims[k]
            if not 0 <= i < n:
                reported.add(k)
                out.append((k, i, n, cell, used))
            k += 1
    return out


def _num(n: int) -> str:
    digits = len(str(abs(n))) if abs(n) < 10**4000 else 4000
    return str(n) if digits <= 30 else f"a number with {digits}+ digits"


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."
