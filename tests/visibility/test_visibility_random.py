"""Differential tests on random small programs.

Each example is generated as plain Python data (values, clauses with expression trees), rendered
to LMPM source, and compiled through the real front end. The reference below evaluates the *data*
with plain loops over every (target cell, binder combination), straight from docs/design.md §3 — it
shares no code with lmpm.visibility or lmpm.ir.eval.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from blockmask_checks import assert_same_blocks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from lmpm.ir import compile_source
from lmpm.visibility import Masks, masks

# ---- the reference ---------------------------------------------------------------------------
# Neighbourhood offsets written out independently of lmpm.ir.nodes.NEIGHBORHOODS.
HOODS: dict[str, list[tuple[int, ...]]] = {
    "N2": [(-1,), (1,)],
    "N4": [(-1, 0), (1, 0), (0, -1), (0, 1)],
    "N8": [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1) if (a, b) != (0, 0)],
    "N6": [(-1, 0, 0), (1, 0, 0), (0, -1, 0), (0, 1, 0), (0, 0, -1), (0, 0, 1)],
    "N26": [p for p in itertools.product((-1, 0, 1), repeat=3) if p != (0, 0, 0)],
}
SHAPES = {1: "Seq", 2: "Grid2D", 3: "Grid3D"}

Expr = tuple[Any, ...]  # ("var", name) | ("const", c) | (op, a, b) | ("not", g)


def ev(e: Expr, env: dict[str, int]) -> int:
    op = e[0]
    if op == "var":
        return env[e[1]]
    if op == "const":
        return e[1]
    if op == "not":
        return int(not ev(e[1], env))
    a, b = ev(e[1], env), ev(e[2], env)
    return {
        "+": lambda: a + b,
        "-": lambda: a - b,
        "*": lambda: a * b,
        "/": lambda: a // b,
        "%": lambda: a % b,
        "<": lambda: int(a < b),
        "<=": lambda: int(a <= b),
        ">": lambda: int(a > b),
        ">=": lambda: int(a >= b),
        "==": lambda: int(a == b),
        "!=": lambda: int(a != b),
        "and": lambda: int(bool(a) and bool(b)),
        "or": lambda: int(bool(a) or bool(b)),
    }[op]()


def show(e: Expr) -> str:
    op = e[0]
    if op == "var":
        return e[1]
    if op == "const":
        return f"({e[1]})" if e[1] < 0 else str(e[1])
    if op == "not":
        return f"not ({show(e[1])})"
    return f"({show(e[1])} {op} {show(e[2])})"


def reference(spec: dict[str, Any]) -> tuple[torch.Tensor, list[list[list[int]]]]:
    """Dense canonical mask and, per clause, each target cell's sorted visible source cells."""
    values = spec["values"]
    base, total = {}, 0
    for name, dims in values:
        base[name] = total
        total += math.prod(dims)
    dims_of = dict(values)
    dense = torch.zeros((total, total), dtype=torch.bool)
    per_clause: list[list[list[int]]] = []
    for cl in spec["clauses"]:
        tdims, sdims = dims_of[cl["target"]], dims_of[cl["source"]]
        rows: list[list[int]] = []
        for tcell in itertools.product(*[range(d) for d in tdims]):
            env = dict(spec["params"])
            env.update(zip(cl["vars"], tcell))
            seen: set[int] = set()
            binder_opts = []
            for bvars, dom in cl["binders"]:
                if isinstance(dom, str):
                    binder_opts.append([dict(zip(bvars, off)) for off in HOODS[dom]])
                else:
                    lo, hi = ev(dom[0], env), ev(dom[1], env)
                    binder_opts.append([{bvars[0]: d} for d in range(lo, hi + 1)])
            for combo in itertools.product(*binder_opts):
                local = dict(env)
                for c in combo:
                    local.update(c)
                if cl["guard"] is not None and not ev(cl["guard"], local):
                    continue
                per_axis = []
                for kind, lo_e, hi_e, size in zip(
                    [a[0] for a in cl["axes"]],
                    [a[1] for a in cl["axes"]],
                    [a[2] for a in cl["axes"]],
                    sdims,
                ):
                    if kind in ("all", "region"):
                        per_axis.append(range(size))
                    elif kind == "at":
                        i = ev(lo_e, local)
                        per_axis.append([i] if 0 <= i < size else [])
                    else:
                        lo, hi = ev(lo_e, local), ev(hi_e, local)
                        per_axis.append(range(max(lo, 0), min(hi, size - 1) + 1))
                for scell in itertools.product(*per_axis):
                    flat = 0
                    for i, d in zip(scell, sdims):
                        flat = flat * d + i
                    seen.add(flat)
            rows.append(sorted(seen))
            q = base[cl["target"]] + sum(i * math.prod(tdims[k + 1 :]) for k, i in enumerate(tcell))
            for s in seen:
                dense[q, base[cl["source"]] + s] = True
        per_clause.append(rows)
    return dense, per_clause


def render(spec: dict[str, Any]) -> str:
    lines = [f"param {k} = {v}" for k, v in spec["params"].items()]
    for name, dims in spec["values"]:
        lines.append(
            f"value {name} : Token[Byte] shape {SHAPES[len(dims)]}({', '.join(map(str, dims))})"
        )
    lines.append("value Log : Event shape Set()")  # Set values have no cells: excluded
    for cl in spec["clauses"]:
        axes = []
        for kind, lo, hi in cl["axes"]:
            if kind == "all":
                axes.append("*")
            elif kind == "region":
                axes.append('region("sky")')
            elif kind == "at":
                assert lo is not None
                axes.append(show(lo))
            else:
                assert lo is not None and hi is not None
                axes.append(f"{show(lo)}..{show(hi)}")
        # region("sky") covers every axis not given explicitly: only emitted as the whole access.
        if cl["axes"] and all(a[0] == "region" for a in cl["axes"]):
            axes = ['region("sky")']
        terms = []
        for bvars, dom in cl["binders"]:
            lhs = f"({', '.join(bvars)})" if len(bvars) > 1 else bvars[0]
            rhs = dom if isinstance(dom, str) else f"{show(dom[0])}..{show(dom[1])}"
            terms.append(f"{lhs} in {rhs}")
        if cl["guard"] is not None:
            terms.append(show(cl["guard"]))
        when = f" when {' and '.join(terms)}" if terms else ""
        lines.append(
            f"visible {cl['target']}[{', '.join(cl['vars'])}] <- "
            f"{cl['source']}[{', '.join(axes)}]{when}"
        )
    return "\n".join(lines) + "\n"


# ---- the generator ---------------------------------------------------------------------------
@st.composite
def index_expr(draw: st.DrawFn, names: list[str]) -> Expr:
    leaf = st.one_of(
        st.sampled_from([("var", n) for n in names]) if names else st.nothing(),
        st.integers(-2, 4).map(lambda c: ("const", c)),
    )
    e = draw(leaf)
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["+", "-", "*", "/", "%"]))
        if op in ("/", "%"):
            e = (op, e, ("const", draw(st.integers(1, 3))))
        elif op == "*":
            e = (op, e, ("const", draw(st.integers(-1, 2))))
        else:
            e = (op, e, draw(leaf))
    return e


@st.composite
def guard_expr(draw: st.DrawFn, names: list[str]) -> Expr:
    cmp = draw(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]))
    g: Expr = (cmp, draw(index_expr(names)), draw(index_expr(names)))
    if draw(st.booleans()):
        g = (draw(st.sampled_from(["and", "or"])), g, draw(guard_expr(names)))
    if draw(st.integers(0, 4)) == 0:
        g = ("not", g)
    return g


def _params_and_values(draw: st.DrawFn) -> tuple[dict[str, int], list[tuple[str, tuple[int, ...]]]]:
    """A param P and 1-3 values of rank 1-3 (small: every cell pair is checked)."""
    params = {"P": draw(st.integers(0, 3))}
    values = []
    for k in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(1, 3))
        cap = {1: 9, 2: 5, 3: 3}[rank]
        values.append((f"V{k}", tuple(draw(st.integers(1, cap)) for _ in range(rank))))
    return params, values


@st.composite
def programs(draw: st.DrawFn) -> dict[str, Any]:
    params, values = _params_and_values(draw)
    clauses = []
    for c in range(draw(st.integers(1, 4))):
        (tname, tdims), (sname, sdims) = (
            draw(st.sampled_from(values)),
            draw(st.sampled_from(values)),
        )
        tvars = [f"a{c}{k}" for k in range(len(tdims))]
        binders: list[tuple[list[str], Any]] = []
        bvars: list[str] = []
        kind = draw(st.sampled_from(["none", "none", "hood", "range"]))
        if kind == "hood":
            hood = draw(st.sampled_from(["N2", "N4", "N8", "N6", "N26"]))
            names = [f"d{c}{k}" for k in range(len(HOODS[hood][0]))]
            binders.append((names, hood))
            bvars += names
        elif kind == "range":
            lo = draw(st.integers(-2, 1))
            hi: Expr = ("const", lo + draw(st.integers(0, 3)))
            if draw(st.booleans()):
                hi = ("var", tvars[0])  # per-cell bounds
            binders.append(([f"e{c}"], (("const", lo), hi)))
            bvars.append(f"e{c}")
        names = tvars + bvars + ["P"]
        axes: list[tuple[str, Expr | None, Expr | None]] = []
        if draw(st.integers(0, 9)) == 0:
            axes = [("region", None, None)] * len(sdims)
        else:
            for _ in sdims:
                ak = draw(st.sampled_from(["at", "at", "range", "all"]))
                if ak == "at":
                    axes.append(("at", draw(index_expr(names)), None))
                elif ak == "range":
                    axes.append(("range", draw(index_expr(names)), draw(index_expr(names))))
                else:
                    axes.append(("all", None, None))
        guard = draw(guard_expr(names)) if draw(st.booleans()) else None
        clauses.append(
            {
                "target": tname,
                "source": sname,
                "vars": tvars,
                "binders": binders,
                "axes": axes,
                "guard": guard,
            }
        )
    return {"params": params, "values": values, "clauses": clauses}


def build(spec: dict[str, Any], layout: str, tile: tuple[int, int] = (2, 3)) -> Masks:
    front = compile_source(render(spec))
    from lmpm.ir.eval import bind_params

    return Masks(front.ir, bind_params(front.ir), layout, tile)


SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("VIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- the properties --------------------------------------------------------------------------
@SETTINGS
@given(programs(), st.sampled_from(["raster", "tiled", "morton"]))
def test_dense_and_gather_match_reference(spec: dict[str, Any], layout: str) -> None:
    m = build(spec, layout)
    dense, per_clause = reference(spec)
    assert torch.equal(m.dense(), dense), render(spec)
    for k, cl in enumerate(spec["clauses"]):
        table = m.gather(cl["target"])[f"{cl['target']}<-{cl['source']}#{k}"]
        got = [row[ok].tolist() for row, ok in zip(table.index, table.valid)]
        assert got == per_clause[k], render(spec)
        assert max((len(r) for r in per_clause[k]), default=0) == table.K
        assert not bool(table.index[~table.valid].any())  # padding is 0


@SETTINGS
@given(programs())
def test_runtime_gather_entry_points_match_reference(spec: dict[str, Any]) -> None:
    """``gather_table`` (one clause) and ``visible_union`` / ``"T<-S"`` (the union of a source's
    clauses), the tables the runtime reads through, against the reference."""
    from lmpm.ir.eval import bind_params
    from lmpm.visibility import gather_table, visible_union

    front = compile_source(render(spec))
    prog, env = front.ir, bind_params(front.ir)
    m = Masks(prog, env, "raster")
    _, per_clause = reference(spec)

    def rows(t: Any) -> list[list[int]]:
        assert t.index.dtype == torch.long and t.valid.dtype == torch.bool
        assert t.index.is_contiguous() and t.valid.is_contiguous()
        assert not bool(t.index[~t.valid].any())  # padding is 0
        got = [row[ok].tolist() for row, ok in zip(t.index, t.valid)]
        assert max((len(r) for r in got), default=0) == t.K
        return got

    unions: dict[tuple[str, str], list[set[int]]] = {}
    for k, (cl, st_) in enumerate(zip(spec["clauses"], prog.stencils)):
        g = gather_table(
            prog, env, st_.target, st_.source, st_.axes, st_.binders, st_.guard, st_.vars
        )
        assert rows(g) == per_clause[k], render(spec)
        acc = unions.setdefault((cl["target"], cl["source"]), [set() for _ in per_clause[k]])
        for a, r in zip(acc, per_clause[k]):
            a.update(r)
    for (target, source), acc in unions.items():
        want = [sorted(a) for a in acc]
        assert rows(visible_union(prog, env, target, source)) == want, render(spec)
        assert rows(m.gather(target)[f"{target}<-{source}"]) == want, render(spec)


@SETTINGS
@given(programs(), st.sampled_from(["raster", "tiled", "morton"]), st.integers(1, 3), st.data())
def test_mask_mod_and_block_mask_match(
    spec: dict[str, Any], layout: str, seed: int, data: st.DataObject
) -> None:
    m = build(spec, layout, tile=(seed, seed + 1))
    dense = m.dense(canonical=False)
    # The layout is a permutation of the canonical order, value by value.
    lay = m.layout_of()
    if lay.to_canon is not None:
        assert torch.equal(torch.sort(lay.to_canon).values, torch.arange(m.cells))
        assert torch.equal(dense, m.dense()[lay.to_canon][:, lay.to_canon])
    assert torch.equal(create_mask(m.mask_mod, 1, 1, m.cells, m.cells, "cpu")[0, 0], dense)
    block = data.draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16, 128]))
    ours = m.block_mask(block)
    ref = create_block_mask(m.mask_mod, 1, 1, m.cells, m.cells, "cpu", BLOCK_SIZE=block)
    assert_same_blocks(ours, ref, render(spec))


@settings(max_examples=25, deadline=None)
@given(programs())
def test_auto_picks_the_sparsest_layout(spec: dict[str, Any]) -> None:
    front = compile_source(render(spec))
    m = masks(front.ir)
    assert m.sparsity[m.layout] == max(m.sparsity.values())


# ---- stencil-shaped programs: what the generated mask_mod simplifies --------------------------
@st.composite
def stencil_programs(draw: st.DrawFn) -> dict[str, Any]:
    """Programs shaped like real stencils — ``x ± c`` points, ``x-a..x+b`` and ``0..t`` ranges,
    neighbourhood and range binders used as ``x + dx``, simple guards like ``t > 0`` — where the
    mask_mod generator folds offsets, drops membership tests and implied guard bounds."""
    params, values = _params_and_values(draw)
    clauses = []
    for c in range(draw(st.integers(1, 4))):
        (tname, tdims), (sname, sdims) = (
            draw(st.sampled_from(values)),
            draw(st.sampled_from(values)),
        )
        tvars = [f"a{c}{k}" for k in range(len(tdims))]
        binders: list[tuple[list[str], Any]] = []
        offsets: list[str] = []
        kind = draw(st.sampled_from(["none", "hood", "range"]))
        if kind == "hood":
            fits = [h for h in HOODS if len(HOODS[h][0]) <= len(sdims)]
            hood = draw(st.sampled_from(fits))
            names = [f"d{c}{k}" for k in range(len(HOODS[hood][0]))]
            binders.append((names, hood))
            offsets = names
        elif kind == "range":
            lo = draw(st.integers(-2, 1))
            binders.append(([f"e{c}"], (("const", lo), ("const", lo + draw(st.integers(0, 2))))))
            offsets = [f"e{c}"]
        axes: list[tuple[str, Expr | None, Expr | None]] = []
        free = list(offsets)  # binder variables not placed yet (a leftover one is unused)
        for a in range(len(sdims)):
            var: Expr = ("var", tvars[min(a, len(tvars) - 1)])
            shift: Expr = ("const", draw(st.integers(-1, 1)))
            form = draw(st.sampled_from(["point", "point", "range", "prefix", "all"]))
            if free and draw(st.booleans()):
                sign = draw(st.sampled_from(["+", "-"]))
                axes.append(("at", (sign, var, ("var", free.pop(0))), None))
            elif form == "point":
                axes.append(("at", ("+", var, shift), None))
            elif form == "range":
                lo_c, hi_c = draw(st.integers(-2, 1)), draw(st.integers(-1, 2))
                axes.append(("range", ("+", var, ("const", lo_c)), ("+", var, ("const", hi_c))))
            elif form == "prefix":
                axes.append(("range", ("const", 0), ("+", var, shift)))
            else:
                axes.append(("all", None, None))
        guard = None
        if draw(st.booleans()):
            cmp = draw(st.sampled_from([">", ">=", "<", "<="]))
            guard = (
                cmp,
                ("var", draw(st.sampled_from(tvars))),
                ("const", draw(st.integers(-1, 3))),
            )
        clauses.append(
            {
                "target": tname,
                "source": sname,
                "vars": tvars,
                "binders": binders,
                "axes": axes,
                "guard": guard,
            }
        )
    return {"params": params, "values": values, "clauses": clauses}


@SETTINGS
@given(stencil_programs(), st.sampled_from(["raster", "tiled", "morton"]))
def test_generated_mask_mod_matches_reference_on_stencils(
    spec: dict[str, Any], layout: str
) -> None:
    """The simplified mask_mod (folded offsets, dropped membership and guard tests) is exactly the
    reference mask, everywhere — not only in the blocks FlexAttention evaluates it in."""
    m = build(spec, layout)
    dense, _ = reference(spec)
    lay = m.layout_of()
    want = dense if lay.to_canon is None else dense[lay.to_canon][:, lay.to_canon]
    got = create_mask(m.mask_mod, 1, 1, m.cells, m.cells, "cpu")[0, 0]
    assert torch.equal(got, want), render(spec)
