"""A FlexAttention ``mask_mod`` generated from the program's ``visible`` clauses.

``mask_mod(b, h, q_idx, kv_idx)`` is True iff the cell at sequence position ``kv_idx`` is visible
to the cell at ``q_idx`` (positions in the chosen :class:`~lmpm.visibility.layout.Layout`). It is
built only from torch ops on the index tensors — a table lookup for non-raster layouts, integer
arithmetic for coordinates, comparisons for each clause — so it works under ``vmap`` in
``create_block_mask``, inside ``flex_attention`` and under ``torch.compile``.

The kernel evaluates it at every (q, kv) pair of every partial block, so it is generated with the
fewest ops a careful hand-written mask_mod has (``benchmarks/masks.py --ops`` counts them):

- **shared decoding**: each value's coordinates are decoded once per index, whatever the number
  of clauses; the first axis needs no ``%`` and the last no ``//``;
- **membership by layout**: values are consecutive ranges of positions, so the first value needs
  no ``idx >= base`` and the last no ``idx < end``; and a source's membership is dropped where the
  clause's test on the source's first axis already confines that coordinate to the axis (``Vid[t,
  …]`` with ``0 <= t < T``: a position outside ``Vid`` decodes to a first coordinate outside
  ``0..T-1``);
- **folded offsets**: binder offsets used as ``x + dx`` in point axes (``(dx, dy) in N8``, ``d in
  -2..2``) become one test on the differences ``kx - x`` — a box (``|kx - x| <= 1``), a box without
  its centre, or an L1 shell (``|kx - x| + |ky - y| == 1``) — instead of one equality per offset;
- **bounds that cannot fail are not tested**: ``Txt[0..t]`` tests only ``k <= t``; ``k <= t - 1``
  is ``k < t``; ``|k - x| <= 2`` for ``x-2..x+2``; a guard bound implied by the clause's own tests
  (``when t > 0`` for ``Txt[0..t-1]``) is dropped.

Per clause ``T[vars] <- S[axes] when guard``: q must be a cell of T, kv a cell of S, and for some
binder combination the guard holds and every axis of kv matches (``AT``: equal; ``RANGE``: inside;
``*``/region: any). Bounds need no check: kv is a real cell, so a clipped index can never match it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from torch import Tensor

from lmpm.ir.nodes import Axis, AxisKind, Binder, Expr, Op, Program
from lmpm.visibility._emit import emit_mask_mod
from lmpm.visibility._stencil import DimSpec, Space, binder_combos, cell_coords, dim_specs, strides
from lmpm.visibility.expr import Val, all_defined, and_, evaluate, or_
from lmpm.visibility.layout import Layout

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
Range = tuple[int, int]  # inclusive bounds of an integer expression


# ---- static analysis of index expressions (build time, python ints only) -------------------
def _vars(e: Expr) -> Iterator[str]:
    if e.op == Op.VAR:
        assert isinstance(e.value, str)
        yield e.value
    for a in e.args:
        yield from _vars(a)


def _const(e: Expr, params: Mapping[str, int]) -> int | None:
    """The value of ``e`` when it reads no variable (params only), else None."""
    if any(True for _ in _vars(e)):
        return None
    try:
        v = evaluate(e, params)
    except Exception:  # an unbound param or a division by zero: leave it to the evaluator
        return None
    return None if isinstance(v, Tensor) else int(v)


def _affine(e: Expr, params: Mapping[str, int]) -> tuple[Expr | None, int]:
    """``e`` as ``rest + c`` with ``c`` an int (``rest`` None when ``e`` is constant)."""
    c = _const(e, params)
    if c is not None:
        return None, c
    if e.op in (Op.ADD, Op.SUB):
        right = _const(e.args[1], params)
        if right is not None:
            rest, c0 = _affine(e.args[0], params)
            return rest, c0 + (right if e.op == Op.ADD else -right)
        left = _const(e.args[0], params)
        if left is not None and e.op == Op.ADD:
            rest, c0 = _affine(e.args[1], params)
            return rest, c0 + left
    return e, 0


def _bounds(e: Expr, ranges: Mapping[str, Range], params: Mapping[str, int]) -> Range | None:
    """Interval of ``e`` over the variables' ``ranges`` (None: unknown)."""
    c = _const(e, params)
    if c is not None:
        return c, c
    if e.op == Op.VAR:
        return ranges.get(str(e.value))
    if e.op == Op.NEG:
        a = _bounds(e.args[0], ranges, params)
        return None if a is None else (-a[1], -a[0])
    if e.op not in (Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MOD):
        return None
    a = _bounds(e.args[0], ranges, params)
    b = _bounds(e.args[1], ranges, params)
    if a is None or b is None:
        return None
    if e.op == Op.ADD:
        return a[0] + b[0], a[1] + b[1]
    if e.op == Op.SUB:
        return a[0] - b[1], a[1] - b[0]
    if b[0] != b[1]:
        return None
    k = b[0]
    if e.op == Op.MUL:
        return (a[0] * k, a[1] * k) if k >= 0 else (a[1] * k, a[0] * k)
    if k <= 0:
        return None
    if e.op == Op.DIV:
        return a[0] // k, a[1] // k
    return 0, k - 1  # MOD by a positive constant


def _conjuncts(e: Expr | None) -> list[Expr]:
    if e is None:
        return []
    if e.op == Op.AND:
        return _conjuncts(e.args[0]) + _conjuncts(e.args[1])
    return [e]


_FLIP = {Op.LT: Op.GT, Op.LE: Op.GE, Op.GT: Op.LT, Op.GE: Op.LE, Op.EQ: Op.EQ, Op.NE: Op.NE}


def _var_bound(g: Expr, params: Mapping[str, int]) -> tuple[str, Range] | None:
    """A guard conjunct ``x op c`` (or ``c op x``) as the interval it confines ``x`` to."""
    if g.op not in _FLIP or len(g.args) != 2:
        return None
    op, (a, b) = g.op, g.args
    if a.op != Op.VAR:
        a, b, op = b, a, _FLIP[op]
    c = _const(b, params)
    if a.op != Op.VAR or c is None or op == Op.NE:
        return None
    lo, hi = -(1 << 62), 1 << 62
    bound = {
        Op.LT: (lo, c - 1),
        Op.LE: (lo, c),
        Op.GT: (c + 1, hi),
        Op.GE: (c, hi),
        Op.EQ: (c, c),
    }[op]
    return str(a.value), bound


def _meet(ranges: Mapping[str, Range], var: str, r: Range) -> dict[str, Range]:
    out = dict(ranges)
    old = out.get(var, (-(1 << 62), 1 << 62))
    out[var] = (max(old[0], r[0]), min(old[1], r[1]))
    return out


# ---- folded binder offsets ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Offsets:
    """The binders of a clause folded into one test on ``D[a] = k[a] - base[a]`` for the axes
    ``axes`` (each an ``AT`` axis ``base ± binder var``): ``D`` must lie in ``points``."""

    axes: tuple[int, ...]
    bases: tuple[Expr | None, ...]  # None: the base is 0
    points: frozenset[tuple[int, ...]]

    @property
    def hull(self) -> tuple[Range, ...]:
        return tuple(
            (min(p[i] for p in self.points), max(p[i] for p in self.points))
            for i in range(len(self.axes))
        )


def _split_var(e: Expr, names: set[str]) -> tuple[str, int, Expr | None] | None:
    """``e`` as ``base + sign * v`` with ``v`` one of ``names`` (None: not of that form)."""
    if e.op == Op.VAR and e.value in names:
        return str(e.value), 1, None
    if e.op in (Op.ADD, Op.SUB):
        a, b = e.args
        if b.op == Op.VAR and b.value in names and not set(_vars(a)) & names:
            return str(b.value), 1 if e.op == Op.ADD else -1, a
        if e.op == Op.ADD and a.op == Op.VAR and a.value in names and not set(_vars(b)) & names:
            return str(a.value), 1, b
    return None


def _fold(
    specs: tuple[DimSpec, ...],
    binders: tuple[Binder, ...],
    guard: Expr | None,
    combos: tuple[Mapping[str, int], ...],
    ranged: tuple[tuple[str, Expr, Expr], ...],
) -> _Offsets | None:
    """The binders as one offset test, when every binder variable appears exactly once, as
    ``base ± v`` in a point axis, and nowhere else (guard, ranges, per-cell binder bounds)."""
    names = {v for b in binders for v in b.vars}
    if not names or ranged or (guard is not None and set(_vars(guard)) & names):
        return None
    axes: list[int] = []
    bases: list[Expr | None] = []
    signs: list[tuple[str, int]] = []
    for a, spec in enumerate(specs):
        exprs = [x for x in (spec.lo, spec.hi) if x is not None]
        used = {v for x in exprs for v in _vars(x)} & names
        if not used:
            continue
        if spec.kind != AxisKind.AT or spec.lo is None:
            return None
        split = _split_var(spec.lo, names)
        if split is None:
            return None
        var, sign, base = split
        axes.append(a)
        bases.append(base)
        signs.append((var, sign))
    if sorted(v for v, _ in signs) != sorted(names):
        return None  # a binder variable used twice, or not at all
    points = frozenset(tuple(s * c[v] for v, s in signs) for c in combos)
    return _Offsets(tuple(axes), tuple(bases), points) if points else None


def _offset_test(off: _Offsets, d: list[Tensor]) -> Val:
    """``D in off.points`` with the fewest ops: a box, a box without its centre, an L1 shell, or
    (otherwise) one equality per point."""
    l1 = [sum(abs(c) for c in p) for p in off.points]
    lo1, hi1 = min(l1), max(l1)
    # Every offset at L1 distance lo1..hi1, and no other (N2, N4, N6): the distance decides.
    shell = {p for p in _grid(((-hi1, hi1),) * len(d)) if lo1 <= sum(abs(c) for c in p) <= hi1}
    if shell == off.points:
        total = d[0].abs()
        for x in d[1:]:
            total = total + x.abs()
        return total <= hi1 if lo1 == 0 else _in_range(total, lo1, hi1)
    hull = off.hull
    size = 1
    for lo, hi in hull:
        size *= hi - lo + 1
    zero = tuple(0 for _ in hull)
    box = len(off.points) == size
    holed = (
        len(off.points) == size - 1
        and zero not in off.points
        and all(lo <= 0 <= hi for lo, hi in hull)
    )
    if box or holed:  # N8, N26, a range binder
        inside: Val = True
        for (lo, hi), x in zip(hull, d):
            inside = and_(inside, _in_range(x, lo, hi))
        if holed:
            nonzero: Val = False
            for x in d:
                nonzero = or_(nonzero, x != 0)
            inside = and_(inside, nonzero)
        return inside
    out: Val = False
    for p in sorted(off.points):
        hit: Val = True
        for c, x in zip(p, d):
            hit = and_(hit, x == c)
        out = or_(out, hit)
    return out


def _grid(hull: tuple[Range, ...]) -> Iterator[tuple[int, ...]]:
    if not hull:
        yield ()
        return
    (lo, hi), rest = hull[0], hull[1:]
    for c in range(lo, hi + 1):
        for tail in _grid(rest):
            yield (c, *tail)


def _in_range(x: Val, lo: int, hi: int) -> Val:
    """``lo <= x <= hi``: one equality, ``|x| <= hi`` when symmetric, else two comparisons."""
    if lo == hi:
        return x == lo
    if lo == -hi and isinstance(x, Tensor):
        return x.abs() <= hi
    return and_(x >= lo, x <= hi)


# ---- clauses ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Clause:
    specs: tuple[DimSpec, ...]
    combos: tuple[Mapping[str, int], ...]  # binder offsets, unrolled (unless folded)
    ranged: tuple[tuple[str, Expr, Expr], ...]  # range binders whose bounds depend on the cell
    guard: Expr | None
    vars: tuple[str, ...]
    folded: _Offsets | None  # the binders as one offset test
    tdims: tuple[int, ...]
    sdims: tuple[int, ...]


def _clause(
    env: Mapping[str, int],
    sp: Space,
    target: str,
    vars_: tuple[str, ...],
    source: str,
    axes: tuple[Axis, ...],
    binders: tuple[Binder, ...],
    guard: Expr | None,
) -> _Clause:
    # Offsets come from the same enumeration the stencil expansion uses (over all target cells),
    # so a per-cell range binder contributes the union of its ranges plus a per-cell bound check.
    full_env: dict[str, Val] = dict(env)
    if any(b.neighborhood is None for b in binders):  # only a range's bounds read the cell
        full_env.update(zip(vars_, cell_coords(sp.dims[target])))
    combos = tuple(c.values for c in binder_combos(binders, full_env))
    ranged = tuple(
        (b.vars[0], b.lo, b.hi)
        for b in binders
        if b.neighborhood is None
        and b.lo is not None
        and b.hi is not None
        and (_const(b.lo, env) is None or _const(b.hi, env) is None)
    )
    g = None if guard is not None and guard.op == Op.CONST and guard.value == 1 else guard
    specs = dim_specs(axes, len(sp.dims[source]), source)
    folded = _fold(specs, binders, g, combos, ranged)
    return _Clause(specs, combos, ranged, g, vars_, folded, sp.dims[target], sp.dims[source])


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a clause's tests establish and may leave out (decided at build time).

    ``ranges``: the target variables' intervals (their axes), narrowed by the guard's simple
    bounds. ``low``/``high``: the test on the source's first axis confines its coordinate to
    ``>= 0`` / ``<= size - 1`` (so kv's membership on that side needs no test)."""

    ranges: Mapping[str, Range]
    low: bool
    high: bool


def _plan(cl: _Clause, params: Mapping[str, int]) -> _Plan:
    ranges: dict[str, Range] = {v: (0, d - 1) for v, d in zip(cl.vars, cl.tdims)}
    narrowed = dict(ranges)
    for g in _conjuncts(cl.guard):
        vb = _var_bound(g, params)
        if vb is not None and vb[0] in narrowed:
            narrowed = _meet(narrowed, *vb)
    low = high = False
    if cl.sdims and not _unrolled(cl):
        first = _first_axis_range(cl, narrowed, params)
        if first is not None:
            low, high = first[0] >= 0, first[1] <= cl.sdims[0] - 1
    return _Plan(ranges, low, high)


def _unrolled(cl: _Clause) -> bool:
    """The clause's binders are tested one combination at a time (not folded)."""
    return cl.folded is None and cl.combos != ({},)


def _first_axis_range(
    cl: _Clause, ranges: Mapping[str, Range], params: Mapping[str, int]
) -> Range | None:
    """Where the test on the source's first axis confines kv's first coordinate."""
    spec = cl.specs[0]
    if cl.folded is not None and 0 in cl.folded.axes:
        i = cl.folded.axes.index(0)
        base = cl.folded.bases[i]
        b = (0, 0) if base is None else _bounds(base, ranges, params)
        lo, hi = cl.folded.hull[i]
        return None if b is None else (b[0] + lo, b[1] + hi)
    if spec.kind == AxisKind.ALL:
        return None
    assert spec.lo is not None and spec.hi is not None
    lo_b, hi_b = _bounds(spec.lo, ranges, params), _bounds(spec.hi, ranges, params)
    low = lo_b[0] if lo_b is not None else None
    high = hi_b[1] if hi_b is not None else None
    if low is None and high is None:
        return None
    return (low if low is not None else -1, high if high is not None else 1 << 62)


# ---- emission (trace time: torch ops on the index tensors) ---------------------------------
def _coords(local: Tensor, dims: tuple[int, ...]) -> list[Tensor]:
    """Row-major coordinates of an in-value index with the fewest ops: the first axis needs no
    ``%`` and the last no ``//`` (garbage outside the value is masked by membership)."""
    st = strides(dims)
    out: list[Tensor] = []
    for a in range(len(dims)):
        c = local if st[a] == 1 else local // st[a]
        out.append(c if a == 0 else c % max(dims[a], 1))
    return out


def _compare(k: Val, op: Op, e: Expr, env: Mapping[str, Val], defined: list[Val]) -> Val:
    """``k op e`` for ``op`` in GE/LE, folding ``e``'s constant term: ``k <= t - 1`` is
    ``k < t``, ``k >= t + 1`` is ``k > t``."""
    params = {n: v for n, v in env.items() if isinstance(v, int)}
    rest, c = _affine(e, params)
    if rest is None:
        return k >= c if op == Op.GE else k <= c
    r = evaluate(rest, env, defined)
    if op == Op.GE:
        return k >= r if c == 0 else k > r if c == 1 else k >= r + c
    return k <= r if c == 0 else k < r if c == -1 else k <= r + c


class _Emitter:
    """The tests of one clause at one binder combination (or all of them, folded)."""

    def __init__(
        self, cl: _Clause, plan: _Plan, established: tuple[bool, bool], params: Mapping[str, int]
    ) -> None:
        self.cl, self.plan, self.params = cl, plan, params
        self.low_ok, self.high_ok = established  # kv's first coordinate is known in range

    def axes(self, kc: list[Tensor], env: Mapping[str, Val], defined: list[Val]) -> Val:
        """The per-axis tests (folded axes excluded)."""
        cl = self.cl
        skip = set(cl.folded.axes) if cl.folded is not None else set()
        cond: Val = True
        for a, (spec, k) in enumerate(zip(cl.specs, kc)):
            if spec.kind == AxisKind.ALL or a in skip:
                continue
            assert spec.lo is not None and spec.hi is not None
            if spec.kind == AxisKind.AT:
                cond = and_(cond, k == evaluate(spec.lo, env, defined))
            else:
                cond = and_(cond, self._range(a, k, spec.lo, spec.hi, env, defined))
        return cond

    def _range(
        self, a: int, k: Tensor, lo: Expr, hi: Expr, env: Mapping[str, Val], defined: list[Val]
    ) -> Val:
        known_low = a > 0 or self.low_ok  # k >= 0 holds without a test
        known_high = a > 0 or self.high_ok  # k <= size - 1 holds without a test
        lo_b = _bounds(lo, self.plan.ranges, self.params)
        hi_b = _bounds(hi, self.plan.ranges, self.params)
        need_lo = not (known_low and lo_b is not None and lo_b[1] <= 0)
        need_hi = not (known_high and hi_b is not None and hi_b[0] >= self.cl.sdims[a] - 1)
        if need_lo and need_hi:
            (r_lo, c_lo), (r_hi, c_hi) = _affine(lo, self.params), _affine(hi, self.params)
            if r_lo is not None and r_lo == r_hi and c_lo == -c_hi:  # x-r..x+r: |k - x| <= r
                return (k - evaluate(r_lo, env, defined)).abs() <= c_hi
        cond: Val = True
        if need_lo:
            cond = and_(cond, _compare(k, Op.GE, lo, env, defined))
        if need_hi:
            cond = and_(cond, _compare(k, Op.LE, hi, env, defined))
        return cond

    def guard(self, env: Mapping[str, Val], defined: list[Val]) -> Val:
        """The guard without the conjuncts the clause's own tests imply."""
        cond: Val = True
        for g in _conjuncts(self.cl.guard):
            if not self._implied(g):
                cond = and_(cond, evaluate(g, env, defined))
        return cond

    def _implied(self, g: Expr) -> bool:
        vb = _var_bound(g, self.params)
        if vb is None:
            return False
        var, (lo, hi) = vb
        if var not in self.plan.ranges:
            return False
        have = self._facts().get(var, self.plan.ranges[var])
        return lo <= have[0] and have[1] <= hi

    def _facts(self) -> dict[str, Range]:
        """Target-variable intervals that the axis tests imply, where kv's coordinate is known
        to be in range (``k == x + c`` gives ``0 <= x + c <= size - 1``; ``k <= x + c`` gives
        ``x + c >= 0``; ``k >= x + c`` gives ``x + c <= size - 1``)."""
        cl = self.cl
        facts: dict[str, Range] = dict(self.plan.ranges)
        skip = set(cl.folded.axes) if cl.folded is not None else set()
        if _unrolled(cl):
            return facts  # binders tested per combination: no shared test to reason from
        for a, spec in enumerate(cl.specs):
            if spec.kind == AxisKind.ALL or a in skip:
                continue
            assert spec.lo is not None and spec.hi is not None
            low_ok, high_ok = (True, True) if a > 0 else (self.low_ok, self.high_ok)
            at = spec.kind == AxisKind.AT
            # (bound expression, it bounds k from above, from below)
            for e, above, below in ((spec.hi, True, at), (spec.lo, at, True)):
                rest, c = _affine(e, self.params)
                if rest is None or rest.op != Op.VAR or str(rest.value) not in facts:
                    continue
                var = str(rest.value)
                if above and low_ok:
                    facts = _meet(facts, var, (-c, 1 << 62))  # x + c >= k >= 0
                if below and high_ok:
                    facts = _meet(facts, var, (-(1 << 62), cl.sdims[a] - 1 - c))  # x + c <= k
        return facts


def build_mask_mod(program: Program, env: Mapping[str, int], sp: Space, layout: Layout) -> MaskMod:
    """The mask_mod of every ``visible`` clause of ``program`` in ``layout``."""
    params = dict(env)
    # target → source → clauses, in source order: q's membership and coordinates are shared by
    # every clause into a target, kv's by every clause from a source.
    groups: dict[str, dict[str, list[_Clause]]] = {}
    for s in program.stencils:
        if s.target not in sp.dims or s.source not in sp.dims:
            continue
        groups.setdefault(s.target, {}).setdefault(s.source, []).append(
            _clause(env, sp, s.target, s.vars, s.source, s.axes, s.binders, s.guard)
        )
    plans = {
        (t, s): [_plan(cl, params) for cl in cls]
        for t, by_src in groups.items()
        for s, cls in by_src.items()
    }
    to_canon = layout.to_canon

    def sides(value: str) -> tuple[bool, bool]:
        """(low, high): the membership comparisons ``value`` needs at all (by its place)."""
        base, n = sp.base[value], sp.size(value)
        return base > 0, base + n < sp.cells

    def member(idx: Tensor, value: str, low: bool, high: bool) -> Val:
        base, n = sp.base[value], sp.size(value)
        return and_(idx >= base if low else True, idx < base + n if high else True)

    def core(q: Tensor, kv: Tensor) -> Val:
        """The visibility of canonical position ``kv`` from ``q`` (a bool when constant)."""
        kv_coords: dict[str, list[Tensor]] = {}
        out: Val = False
        for target, by_source in groups.items():
            base = sp.base[target]
            qc = _coords(q - base if base else q, sp.dims[target])
            seen_t: Val = False
            for source, clauses in by_source.items():
                if source not in kv_coords:
                    kb = sp.base[source]
                    kv_coords[source] = _coords(kv - kb if kb else kv, sp.dims[source])
                kc = kv_coords[source]
                low, high = sides(source)
                pl = plans[(target, source)]
                low = low and not all(p.low for p in pl)  # tested unless every clause implies it
                high = high and not all(p.high for p in pl)
                established = (low or not sides(source)[0], high or not sides(source)[1])
                seen: Val = False
                for cl, plan in zip(clauses, pl):
                    em = _Emitter(cl, plan, established, params)
                    seen = or_(seen, _clause_test(cl, em, qc, kc, params))
                seen_t = or_(seen_t, and_(member(kv, source, low, high), seen))
            out = or_(out, and_(member(q, target, *sides(target)), seen_t))
        return out

    # The walk above, run once and printed as plain source (lmpm.visibility._emit says why).
    return emit_mask_mod(core, to_canon)


def _clause_test(
    cl: _Clause, em: _Emitter, qc: list[Tensor], kc: list[Tensor], params: Mapping[str, int]
) -> Val:
    """One clause's condition on (q coordinates, kv coordinates)."""
    if not cl.combos:
        return False  # a binder range that is empty everywhere
    cell_env: dict[str, Val] = dict(params)
    cell_env.update(zip(cl.vars, qc))
    if not _unrolled(cl):
        defined: list[Val] = []
        cond = and_(em.guard(cell_env, defined), em.axes(kc, cell_env, defined))
        if cl.folded is not None:
            d: list[Tensor] = []
            for a, base in zip(cl.folded.axes, cl.folded.bases):
                d.append(kc[a] if base is None else kc[a] - evaluate(base, cell_env, defined))  # type: ignore[operator]
            cond = and_(cond, _offset_test(cl.folded, d))
        return and_(cond, all_defined(defined))
    seen: Val = False
    for combo in cl.combos:  # binders used in guards or ranges: one test per combination
        local = dict(cell_env)
        local.update(combo)
        defined = []
        cond = True
        for var, lo, hi in cl.ranged:
            d_ = combo[var]
            cond = and_(
                cond,
                and_(evaluate(lo, local, defined) <= d_, evaluate(hi, local, defined) >= d_),
            )
        cond = and_(cond, and_(em.guard(local, defined), em.axes(kc, local, defined)))
        seen = or_(seen, and_(cond, all_defined(defined)))
    return seen
