"""The static checker: everything that can be decided before a tensor exists.

Facts about index arithmetic (bounds, reads ⊆ visibility, `read_future`) are decided by probing each
clause at concrete *probe cells*: every cell near each boundary and a few interior ones, with the
program's parameters bound (declared defaults, ``--set``; unbound dimensions get a probe size). Index
expressions are affine (plus floor division), so a fact that holds at the edges and the interior
holds everywhere the clause is uniform; the edges are where clauses change behaviour.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import replace

from lmpm.errors import DiagnosticSink, Span
from lmpm.ir.eval import EvalError, access_cells, bind_params, evaluate, names_in
from lmpm.ir.nodes import (
    Axis,
    AxisKind,
    Constraint,
    Expr,
    Op,
    PredKind,
    Program,
    ReadKind,
    Rule,
    RuleKind,
    ShapeKind,
    Status,
    Stencil,
    Value,
)
from lmpm.ir.printer import expr_str, read_str

PROBE_DIM = 64  # size given to an unbound dimension while probing; divisible by 2..64 powers


def probe_env(program: Program, overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    env = bind_params(program, overrides)
    for p in program.params:
        env.setdefault(p.name, PROBE_DIM)
    return env


def _probe_indices(n: int) -> list[int]:
    picks = {0, 1, 2, n // 2, n - 3, n - 2, n - 1}
    return sorted(i for i in picks if 0 <= i < n)


def probe_cells(dims: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(_probe_indices(n) for n in dims)))


class Checker:
    def __init__(
        self,
        program: Program,
        sink: DiagnosticSink,
        overrides: Mapping[str, int] | None,
        known_names: set[str] | None,
        strict: bool,
    ) -> None:
        self.p = program
        self.sink = sink
        self.overrides = dict(overrides or {})
        self.known = known_names
        self.strict = strict
        self.env: dict[str, int] = {}
        self.dims: dict[str, tuple[int, ...]] = {}

    def run(self) -> Program:
        if not self._bind():
            return self.p
        self._commits()
        for s in self.p.stencils:
            self._stencil_bounds(s)
        visible = self._visible_cache()
        for r in self.p.rules:
            self._rule(r, visible)
        constraints = tuple(self._constraint(c, visible) for c in self.p.constraints)
        self._strict_names()
        return replace(self.p, constraints=constraints)

    # ---- parameters and shapes ------------------------------------------------------------------
    def _bind(self) -> bool:
        try:
            self.env = probe_env(self.p, self.overrides)
        except Exception as e:  # BindError: report as a diagnostic at the program level
            from lmpm.errors import LmpmError

            if not isinstance(e, LmpmError):
                raise
            self.sink.error(e.code, e.message, e.span, e.hint)
            return False
        ok = True
        for v in self.p.values:
            dims: list[int] = []
            for k, d in enumerate(v.dims):
                ok &= self._divisible(v, d)
                try:
                    n = evaluate(d, self.env)
                except EvalError as e:
                    self.sink.error(
                        "E203", f"dimension {k + 1} of `{v.name}` cannot be evaluated: {e}", v.span
                    )
                    ok = False
                    continue
                if n < 1:
                    self.sink.error(
                        "E209",
                        f"dimension {k + 1} of `{v.name}` ({expr_str(d)}) is {n}; "
                        "dimensions must be at least 1",
                        v.span,
                        "check the parameters it uses (`--set`)",
                    )
                    ok = False
                dims.append(n)
            self.dims[v.name] = tuple(dims)
            if v.vocab is not None:
                try:
                    if evaluate(v.vocab, self.env) < 1:
                        self.sink.error(
                            "E209", f"vocabulary of `{v.name}` must be at least 1", v.span
                        )
                except EvalError:
                    pass
        return ok

    def _divisible(self, v: Value, d: Expr) -> bool:
        ok = True
        stack = [d]
        while stack:
            x = stack.pop()
            stack.extend(x.args)
            if x.op != Op.DIV:
                continue
            try:
                a, b = evaluate(x.args[0], self.env), evaluate(x.args[1], self.env)
            except EvalError:
                continue
            if b != 0 and a % b != 0:
                bound = {n for op, n in names_in(x.args[0]) if op == Op.PARAM}
                shown = ", ".join(f"{n} = {self.env[n]}" for n in sorted(bound)) or expr_str(
                    x.args[0]
                )
                self.sink.error(
                    "E203",
                    f"`{expr_str(x)}` in the shape of `{v.name}` is not exact: "
                    f"{shown} is not divisible by {b}",
                    v.span,
                    f"choose a value divisible by {b} (e.g. --set with a multiple of {b})",
                )
                ok = False
        return ok

    # ---- visibility ----------------------------------------------------------------------------
    def _target_env(self, vars_: tuple[str, ...], cell: tuple[int, ...]) -> dict[str, int]:
        env = dict(self.env)
        env.update(zip(vars_, cell))
        return env

    def _stencil_bounds(self, s: Stencil) -> None:
        """Warn when an index (not a neighbourhood offset) can leave the source without a guard."""
        binder_vars = {v for b in s.binders for v in b.vars}
        src = self.dims.get(s.source)
        tgt = self.dims.get(s.target)
        if src is None or tgt is None:
            return
        axis_of_var = dict(zip(s.vars, range(len(s.vars))))
        reported: set[int] = set()
        for cell in probe_cells(tgt):
            env = self._target_env(s.vars, cell)
            try:
                if not evaluate(s.guard, env):
                    continue
            except EvalError:
                pass  # the guard uses binder variables: probe the cell anyway
            k = 0
            for ax in s.axes:
                if ax.kind != AxisKind.AT or k in reported:
                    k += ax.width
                    continue
                assert ax.lo is not None
                used = {n for op, n in names_in(ax.lo) if op == Op.VAR}
                if used & binder_vars:
                    k += 1
                    continue
                try:
                    i = evaluate(ax.lo, env)
                except EvalError:
                    k += 1
                    continue
                n = src[k]
                if not 0 <= i < n:
                    reported.add(k)
                    self._oob_warning(s, k, i, n, cell, used, axis_of_var, tgt)
                k += 1

    def _oob_warning(
        self,
        s: Stencil,
        k: int,
        i: int,
        n: int,
        cell: tuple[int, ...],
        used: set[str],
        axis_of_var: dict[str, int],
        tgt: tuple[int, ...],
    ) -> None:
        src_v = self.p.value(s.source)
        tgt_v = self.p.value(s.target)
        axis = src_v.axis_names[k] if k < len(src_v.axis_names) else f"axis {k}"
        at = ", ".join(f"{v} = {c}" for v, c in zip(s.vars, cell) if v in used) or "some cells"
        hint = None
        var = next((v for v in s.vars if v in used), None)
        if var is not None:
            j = axis_of_var[var]
            # Find the guard on `var` that keeps this axis in bounds over all of var's values.
            bad = []
            for val in range(tgt[j]):
                env = self._target_env(
                    s.vars, tuple(val if q == j else c for q, c in enumerate(cell))
                )
                try:
                    assert s.axes[k].lo is not None
                    idx = evaluate(s.axes[k].lo, env)  # type: ignore[arg-type]
                except EvalError:
                    break
                if not 0 <= idx < n:
                    bad.append(val)
            if bad and max(bad) < tgt[j] // 2 + 1 and bad == list(range(len(bad))):
                hint = f"add `when {var} > {len(bad) - 1}`"
            elif bad and bad == list(range(tgt[j] - len(bad), tgt[j])):
                d = tgt_v.dims[j]
                bound = str(tgt[j] - len(bad)) if d.op == Op.CONST else f"{expr_str(d)}-{len(bad)}"
                hint = f"add `when {var} < {bound}`"
        side = "-1" if i < 0 else f"{i} (past the end)"
        self.sink.warning(
            "W202",
            f"`{s.source}[...]` can read {axis} = {side} at {at}; out-of-bounds cells are dropped",
            s.span,
            hint or "add a `when` guard that keeps the index inside the value",
        )

    def _visible_cache(self) -> dict[tuple[str, str, tuple[int, ...]], set[tuple[int, ...]]]:
        """(target, source, probe cell) -> visible source cells, for every clause pair used."""
        cache: dict[tuple[str, str, tuple[int, ...]], set[tuple[int, ...]]] = {}
        for s in self.p.stencils:
            tgt = self.dims.get(s.target)
            src = self.dims.get(s.source)
            if tgt is None or src is None:
                continue
            for cell in probe_cells(tgt):
                env = self._target_env(s.vars, cell)
                try:
                    cells = set(access_cells(s.axes, s.binders, s.guard, env, src))
                except EvalError:
                    continue
                cache.setdefault((s.target, s.source, cell), set()).update(cells)
        return cache

    # ---- rules ---------------------------------------------------------------------------------
    def _rule(
        self, r: Rule, visible: dict[tuple[str, str, tuple[int, ...]], set[tuple[int, ...]]]
    ) -> None:
        if r.kind == RuleKind.SCHEDULE:
            return
        tgt = self.dims.get(r.target)
        if tgt is None:
            return
        cells = []
        for cell in probe_cells(tgt):
            env = self._target_env(r.vars, cell)
            env["e"] = 0
            try:
                if evaluate(r.trigger, env):
                    cells.append(cell)
            except EvalError:
                continue
        fires = bool(cells)
        for rd in r.reads:
            src = self.dims.get(rd.source)
            if src is None:
                continue
            if rd.kind == ReadKind.VISIBLE:
                if not any(s.target == r.target and s.source == rd.source for s in self.p.stencils):
                    self.sink.error(
                        "E201",
                        f"rule `{r.name}` reads `{rd.source}`, but no `visible` "
                        f"clause lets `{r.target}` see `{rd.source}`",
                        rd.span,
                        f"add `visible {self._pattern(r)} <- {rd.source}[...]`",
                    )
                continue
            for cell in cells:
                env = self._target_env(r.vars, cell)
                try:
                    wanted = set(access_cells(rd.axes, rd.binders, None, env, src))
                except EvalError:
                    continue
                missing = wanted - visible.get((r.target, rd.source, cell), set())
                if missing:
                    bad = min(missing)
                    at = f"{r.target}[{', '.join(map(str, cell))}]"
                    self.sink.error(
                        "E201",
                        f"rule `{r.name}` reads `{read_str(rd)}`, which is not visible to "
                        f"`{self._pattern(r)}`: e.g. {at} would read {rd.source}[{', '.join(map(str, bad))}]",
                        rd.span,
                        "add a clause: `visible "
                        + f"{self._pattern(r)} <- {read_str(rd)}"
                        + (f" when {r.vars[0]} > 0" if rd.kind == ReadKind.PREV else "")
                        + "`",
                    )
                    break
        if not fires:
            self.sink.warning(
                "W205",
                f"rule `{r.name}` can never fire: its `on ... when` guard is "
                "false at every probed cell",
                r.span,
            )

    def _pattern(self, r: Rule) -> str:
        return f"{r.target}[{','.join(r.vars)}]" if r.vars else r.target

    # ---- constraints ---------------------------------------------------------------------------
    def _constraint(
        self, c: Constraint, visible: dict[tuple[str, str, tuple[int, ...]], set[tuple[int, ...]]]
    ) -> Constraint:
        if c.access is not None and not any(r.target == c.access.value for r in self.p.rules):
            self.sink.warning(
                "W206",
                f"constraint `{c.name}` speaks about `{c.access.value}`, which "
                "no rule proposes; it can never decide anything",
                c.span,
                f"add a rule with `on {c.access.value}[...]`, or remove the constraint",
            )
        if c.pred != PredKind.READ_FUTURE or c.access is None:
            return c
        target = self.p.value(c.access.value)
        tgt = self.dims.get(target.name)
        if tgt is None or target.shape not in (ShapeKind.SEQ, ShapeKind.GRID3D):
            self.sink.error(
                "E204",
                f"`read_future` needs a value with a time axis (Seq or Grid3D); "
                f"`{target.name}` is {target.shape.value}",
                c.access.span,
            )
            return replace(c, status=Status.REFUTED)
        for s in self.p.stencils:
            if s.target != target.name or not self._time_aligned(target, self.p.value(s.source)):
                continue
            for cell in probe_cells(tgt):
                if not self._covers(c.access.axes, cell):
                    continue
                env = self._target_env(s.vars, cell)
                try:
                    cells = access_cells(s.axes, s.binders, s.guard, env, self.dims[s.source])
                    later = next((sc for sc in cells if sc[0] > cell[0]), None)
                except EvalError:
                    continue
                if later is not None:
                    t = target.axis_names[0]
                    self.sink.error(
                        "E204",
                        f"constraint `{c.name}` (forbid read_future) is refuted: this clause lets "
                        f"{target.name}[{', '.join(map(str, cell))}] read "
                        f"{s.source}[{', '.join(map(str, later))}], a later {t}",
                        s.span,
                        f"restrict the clause to earlier {t} (e.g. `when` or an index ≤ {t}), or drop "
                        f"`{c.name}`",
                    )
                    return replace(c, status=Status.REFUTED)
        if c.kind == "forbid":
            return replace(c, status=Status.PROVED)
        return c

    def _time_aligned(self, target: Value, source: Value) -> bool:
        if source.name == target.name:
            return True
        if source.shape not in (ShapeKind.SEQ, ShapeKind.GRID3D):
            return False
        return source.shape == target.shape or source.dims[0] == target.dims[0]

    def _covers(self, axes: tuple[Axis, ...], cell: tuple[int, ...]) -> bool:
        k = 0
        for ax in axes:
            if ax.kind in (AxisKind.ALL, AxisKind.REGION):
                k += ax.width
                continue
            if ax.kind == AxisKind.AT and ax.lo is not None and ax.lo.op == Op.VAR:
                k += 1
                continue
            try:
                if ax.kind == AxisKind.AT:
                    assert ax.lo is not None
                    if evaluate(ax.lo, self.env) != cell[k]:
                        return False
                else:
                    assert ax.lo is not None and ax.hi is not None
                    if not evaluate(ax.lo, self.env) <= cell[k] <= evaluate(ax.hi, self.env):
                        return False
            except EvalError:
                pass
            k += 1
        return True

    # ---- commits and names ---------------------------------------------------------------------
    def _commits(self) -> None:
        seen: dict[str, Span] = {}
        for cm in self.p.commits:
            v = cm.access.value
            if v in seen:
                self.sink.error(
                    "E208",
                    f"`{v}` already has a commit policy (line {seen[v].line})",
                    cm.span,
                    "one `commit` per value",
                )
            seen[v] = cm.span
        for r in self.p.rules:
            if r.kind == RuleKind.LOCAL and r.target not in seen:
                self.sink.warning(
                    "W207",
                    f"`{r.target}` has proposals (rule `{r.name}`) but no "
                    "`commit` statement; it commits by satisfy(max_constraints_then_score)",
                    r.span,
                    f"add `commit {r.target}[*] using satisfy(max_constraints_then_score)`",
                )
                seen[r.target] = r.span

    def _strict_names(self) -> None:
        if self.known is None:
            return
        reported: set[str] = set()
        for call in self.p.calls():
            if call.func in self.known or call.func in reported:
                continue
            reported.add(call.func)
            msg = f"`{call.func}` ({call.role}) is not bound to anything"
            hint = "bind it in a module passed with --bind, or use a built-in name"
            if self.strict:
                self.sink.error("E207", msg, call.span, hint)


def check(
    program: Program,
    sink: DiagnosticSink | None = None,
    *,
    overrides: Mapping[str, int] | None = None,
    known_names: Iterable[str] | None = None,
    strict: bool = False,
) -> Program:
    """Run every static check; returns the program with constraint statuses decided.

    Errors go to ``sink`` (raised as CheckError when no sink is given).
    """
    own = sink is None
    sink = sink if sink is not None else DiagnosticSink()
    known = set(known_names) if known_names is not None else None
    out = Checker(program, sink, overrides, known, strict).run()
    if own:
        sink.raise_if_errors()
    return out


def lint(program: Program) -> list[str]:
    """Internal invariants of a well-formed IR (run after every pass in tests)."""
    problems: list[str] = []
    names = [v.name for v in program.values]
    if len(set(names)) != len(names):
        problems.append("duplicate value names")
    values = {v.name: v for v in program.values}
    for s in program.stencils:
        if s.target not in values or s.source not in values:
            problems.append(f"stencil refers to an unknown value: {s.target} <- {s.source}")
            continue
        if len(s.vars) != len(values[s.target].dims):
            problems.append(f"stencil into {s.target} binds {len(s.vars)} vars")
        if sum(a.width for a in s.axes) != len(values[s.source].dims):
            problems.append(f"stencil from {s.source} has the wrong number of axes")
    for r in program.rules:
        if r.target not in values:
            problems.append(f"rule {r.name} targets an unknown value")
        for rd in r.reads:
            if rd.source not in values:
                problems.append(f"rule {r.name} reads an unknown value")
            elif rd.kind != ReadKind.VISIBLE and sum(a.width for a in rd.axes) != len(
                values[rd.source].dims
            ):
                problems.append(f"read {rd.name} of {r.name} has the wrong number of axes")
    for c in program.constraints:
        if c.access is not None and c.access.value not in values:
            problems.append(f"constraint {c.name} refers to an unknown value")
    return problems
