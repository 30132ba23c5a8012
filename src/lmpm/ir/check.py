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
from lmpm.ir.eval import EvalError, bind_params, compile_expr, evaluate, fold, names_in
from lmpm.ir.nodes import (
    Arg,
    ArgKind,
    Axis,
    AxisKind,
    Call,
    Constraint,
    DType,
    Expr,
    Op,
    PredKind,
    Program,
    Read,
    ReadKind,
    Rule,
    RuleKind,
    ShapeKind,
    Status,
    Stencil,
    Value,
    Workflow,
)
from lmpm.ir.printer import axis_str, binder_str, expr_str, read_str
from lmpm.ir.probe import Compiled, compiled, probe_cells, probe_indices, shape_of
from lmpm.lang import ast
from lmpm.signatures import POLICIES, SIGNATURES, Signature
from lmpm.signatures import Param as SigParam

MAX_DIM = 2**48  # larger dimensions are an error (E209): no machine holds such a value
PROBE_DIM = 64  # size given to an unbound dimension while probing; divisible by 2..64 powers
# Epochs at which a guard using the epoch `e` is probed: a rule guarded by `e >= 3` fires later.
PROBE_EPOCHS = (0, 1, 2, 3, 4, 5, 7, 8, 10, 16, 32, 64, 100, 1000, 10**6)


def probe_env(program: Program, overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    env = bind_params(program, overrides)
    for p in program.params:
        env.setdefault(p.name, PROBE_DIM)
    return env


class Checker:
    def __init__(
        self,
        program: Program,
        sink: DiagnosticSink,
        overrides: Mapping[str, int] | None,
        known_names: set[str] | None,
        strict: bool,
        tree: ast.Program | None = None,
        bound_names: set[str] | None = None,
    ) -> None:
        self.p = program
        # names the run's own bindings provide: they override a built-in of the same name, whose
        # signature then says nothing
        self.user_bound = bound_names or set()
        self._given: set[str] | None = None  # parameters with a value (_bound)
        # The AST, when given, locates faults on the exact sub-expression (a dim, an argument).
        self.ast_dims: dict[str, tuple[ast.Expr, ...]] = {}
        self.ast_guards: dict[str, Span] = {}
        self._tree = tree
        self._ast_calls: dict[Span, ast.Call] | None = None  # made when a diagnostic needs it
        if tree is not None:
            _index_ast(tree, self.ast_dims, self.ast_guards)
        self.sink = sink
        self.overrides = dict(overrides or {})
        self.known = known_names
        self.strict = strict
        self.env: dict[str, int] = {}
        self.dims: dict[str, tuple[int, ...]] = {}
        # Indices so every check is linear in the program's size.
        self.values = {v.name: v for v in program.values}
        self.into: dict[tuple[str, str], list[Stencil]] = {}
        for s in program.stencils:
            self.into.setdefault((s.target, s.source), []).append(s)
        self.by_target = _group_by_target(program.stencils)
        self.proposed = {r.target for r in program.rules}
        self._stencils: dict[int, Compiled | None] = {}

    def run(self) -> Program:
        if not self._bind():
            return self.p
        self._commits()
        for s in self.p.stencils:
            self._stencil_bounds(s)
        for r in self.p.rules:
            self._rule(r)
        constraints = tuple(self._constraint(c) for c in self.p.constraints)
        for w in self.p.workflows:
            self._workflow(w)
        self._signatures()
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
            srcs = self.ast_dims.get(v.name, ())
            for k, d in enumerate(v.dims):
                dspan = srcs[k].span if k < len(srcs) else v.span
                ok &= self._divisible(v, d, srcs[k] if k < len(srcs) else None)
                try:
                    n = evaluate(d, self.env)
                except EvalError as e:
                    self.sink.error(
                        "E203", f"dimension {k + 1} of `{v.name}` cannot be evaluated: {e}", dspan
                    )
                    ok = False
                    continue
                if n < 1 or n > MAX_DIM:
                    self.sink.error(
                        "E209",
                        f"dimension {k + 1} of `{v.name}` ({_short(expr_str(d))}) is {_num(n)}; "
                        f"dimensions must be between 1 and {MAX_DIM}",
                        dspan,
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

    def _divisible(self, v: Value, d: Expr, src: ast.Expr | None = None) -> bool:
        ok = True
        stack: list[tuple[Expr, ast.Expr | None]] = [(d, src)]
        while stack:
            x, node = stack.pop()
            kids = _ast_kids(node)
            if len(kids) == len(x.args):
                stack.extend(zip(x.args, kids))
            else:
                stack.extend((arg, None) for arg in x.args)
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
                    node.span if node is not None else v.span,
                    f"choose a value divisible by {b} (e.g. --set with a multiple of {b})",
                )
                ok = False
        return ok

    # ---- visibility ----------------------------------------------------------------------------
    def _target_env(self, vars_: tuple[str, ...], cell: tuple[int, ...]) -> dict[str, int]:
        env = dict(self.env)
        env.update(zip(vars_, cell))
        return env

    def _shape(
        self,
        vars_: tuple[str, ...],
        axes: tuple[Axis, ...],
        binders: tuple,
        guard: Expr | None,
        source: str,
    ) -> Compiled:  # type: ignore[type-arg]
        return compiled(shape_of(vars_, axes, binders, guard, self.env, self.dims[source]))

    def _stencil(self, s: Stencil) -> Compiled | None:
        key = id(s)
        if key not in self._stencils:
            ok = s.source in self.dims and s.target in self.dims
            self._stencils[key] = (
                self._shape(s.vars, s.axes, s.binders, s.guard, s.source) if ok else None
            )
        return self._stencils[key]

    def _stencil_bounds(self, s: Stencil) -> None:
        """Warn when an index (not a neighbourhood offset) can leave the source without a guard."""
        c = self._stencil(s)
        if c is None:
            return
        tgt = self.dims[s.target]
        key = (c.shape, tgt)
        found = _BOUNDS.get(key)
        if found is None:
            found = _BOUNDS[key] = _bounds(c, tgt)
        axis_of_var = dict(zip(s.vars, range(len(s.vars))))
        for k, i, n, cell, used in found:
            self._oob_warning(s, k, i, n, cell, used, axis_of_var, tgt)

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
            for val in range(tgt[j] if tgt[j] <= 4096 else 0):  # huge axes: no specific hint
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

    # ---- rules ---------------------------------------------------------------------------------
    def _rule(self, r: Rule) -> None:
        if r.kind in (RuleKind.SCHEDULE, RuleKind.MINIMIZE):
            return  # a minimize rule reads whole data values: no visibility to check
        tgt = self.dims.get(r.target)
        if tgt is None:
            return
        trigger = fold(r.trigger, self.env)
        tvars: set[str] = set()
        _vars_of(trigger, tvars)
        fires_key = ("fires", r.vars, trigger, tgt)
        fires = _FIRES.get(fires_key)
        if fires is None:
            fires = _FIRES[fires_key] = bool(
                _firing(r.vars, trigger, tgt, _axes_using(r.vars, tvars))
            )
        for rd in r.reads:
            src = self.dims.get(rd.source)
            if src is None:
                continue
            if rd.kind == ReadKind.VISIBLE:
                if (r.target, rd.source) not in self.into:
                    self.sink.error(
                        "E201",
                        f"rule `{r.name}` reads `{rd.source}`, but no `visible` "
                        f"clause lets `{r.target}` see `{rd.source}`",
                        rd.span,
                        f"add `visible {self._pattern(r)} <- {rd.source}[...]`",
                    )
                continue
            want = self._shape(r.vars, rd.axes, rd.binders, None, rd.source)
            have = tuple(
                c
                for s in self.into.get((r.target, rd.source), ())
                if (c := self._stencil(s)) is not None
            )
            key = ("read", trigger, want.shape, tuple(h.shape for h in have), tgt)
            if key in _READS:
                miss = _READS[key]
            else:
                miss = _READS[key] = _uncovered(r.vars, trigger, tvars, want, have, tgt)
            if miss is not None:
                cell, bad = miss
                at = f"{r.target}[{', '.join(map(str, cell))}]"
                self.sink.error(
                    "E201",
                    f"rule `{r.name}` reads `{read_str(rd)}`, which is not visible to "
                    f"`{self._pattern(r)}`: e.g. {at} would read {rd.source}[{', '.join(map(str, bad))}]",
                    rd.span,
                    f"add a clause: `{self._clause(r, rd)}`",
                )
        if not fires:
            self.sink.warning(
                "W205",
                f"rule `{r.name}` can never fire: its `on ... when` guard is "
                "false at every probed cell"
                + (" and epoch" if _epochs_of(trigger) != (0,) else ""),
                self.ast_guards.get(r.name, r.span),
            )

    def _clause(self, r: Rule, rd: Read) -> str:
        """The `visible` clause (source syntax) that makes read ``rd`` of rule ``r`` visible."""
        when = [binder_str(b) for b in rd.binders]
        if rd.kind == ReadKind.PREV:
            when.append(f"{r.vars[0]} > 0")
        src = f"{rd.source}[{', '.join(axis_str(a) for a in rd.axes)}]"
        return f"visible {self._pattern(r)} <- {src}" + (
            f" when {' and '.join(when)}" if when else ""
        )

    def _pattern(self, r: Rule) -> str:
        return f"{r.target}[{','.join(r.vars)}]" if r.vars else r.target

    # ---- constraints ---------------------------------------------------------------------------
    def _constraint(self, c: Constraint) -> Constraint:
        if c.access is not None and c.access.value not in self.proposed:
            self.sink.warning(
                "W206",
                f"constraint `{c.name}` speaks about `{c.access.value}`, which "
                "no rule proposes; it can never decide anything",
                c.span,
                f"add a rule with `on {c.access.value}[...]`, or remove the constraint",
            )
        if c.pred == PredKind.IN_SET and c.access is not None:
            self._set_in_vocab(c)
        if c.pred != PredKind.READ_FUTURE or c.access is None:
            return c
        target = self.values[c.access.value]
        tgt = self.dims.get(target.name)
        if tgt is None or target.shape not in (ShapeKind.SEQ, ShapeKind.GRID3D):
            self.sink.error(
                "E204",
                f"`read_future` needs a value with a time axis (Seq or Grid3D); "
                f"`{target.name}` is {target.shape.value}",
                c.access.span,
            )
            return replace(c, status=Status.REFUTED)
        cover = shape_of(target_vars(target), c.access.axes, (), None, self.env, tgt)
        for s in self.by_target.get(target.name, ()):
            if not self._time_aligned(target, self.values[s.source]):
                continue
            sc = self._stencil(s)
            if sc is None:
                continue
            key = ("future", cover.axes, sc.shape, tgt)
            if key in _FUTURE:
                hit = _FUTURE[key]
            else:
                hit = _FUTURE[key] = _reads_later(cover.axes, sc, tgt)
            if hit is not None:
                cell, later = hit
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
        driven = {w.value for w in self.p.workflows}  # the VM commits these values
        for r in self.p.rules:
            if r.kind == RuleKind.LOCAL and r.target not in seen and r.target not in driven:
                self.sink.warning(
                    "W207",
                    f"`{r.target}` has proposals (rule `{r.name}`) but no "
                    "`commit` statement; it commits by satisfy(max_constraints_then_score)",
                    r.span,
                    f"add `commit {r.target}[*] using satisfy(max_constraints_then_score)`",
                )
                seen[r.target] = r.span

    # ---- workflows -------------------------------------------------------------------------------
    def _workflow(self, w: Workflow) -> None:
        """Zones reachable, counts positive, every trigger able to match what the stream can hold."""
        if w.value not in self.proposed:
            self.sink.error(
                "E243",
                f"workflow `{w.name}` needs a model: no rule proposes `{w.value}`",
                w.span,
                f"add a rule that emits proposals for `{w.value}` (its model writes the streams)",
            )
        for z in w.zones:
            for what, e, span in [("max", z.max_tokens, z.span)] + [
                ("limit", x.limit, x.span) for x in z.exits
            ]:
                if e is None:
                    continue
                try:
                    n = evaluate(e, self.env)
                except EvalError as err:
                    self.sink.error("E148", f"`{what}` of zone `{z.name}`: {err}", span)
                    continue
                if n < 1:
                    self.sink.error("E148", f"`{what}` of zone `{z.name}` must be at least 1", span)
        reach = workflow_reachable(w)
        for z, ok in zip(w.zones, reach):
            if not ok:
                self.sink.error(
                    "E241",
                    f"zone `{z.name}` is unreachable: no zone advances or jumps into it",
                    z.span,
                    "give the zone before it a way to advance (`max N` or an `until` without "
                    "`jump`), jump to it, or remove it",
                )
        vocab = self._vocab_of(w.value)
        value_allowed = self._value_allowed(w.value, vocab)
        for z in w.zones:
            allowed = value_allowed
            if z.allowed is not None:
                allowed = allowed & set_members(z.allowed, self.env)
            for x in z.exits:
                bad = [b for b in x.pattern.encode("utf-8") if b not in allowed]
                if bad:
                    why = (
                        f"byte {bad[0]} is outside the vocabulary (size {vocab})"
                        if bad[0] >= vocab
                        else f"{bytes([bad[0]])!r} is never allowed in zone `{z.name}`"
                    )
                    self.sink.error(
                        "E242",
                        f"trigger {x.pattern!r} can never match: {why}",
                        x.span,
                        "use a pattern made of tokens the zone may generate",
                    )
            jumps_unbounded = [x for x in z.exits if x.target is not None and x.limit is None]
            for x in jumps_unbounded:
                self.sink.warning(
                    "W240",
                    f"`jump {x.target}` has no limit: a stream may loop until it is full",
                    x.span,
                    "add `limit K` (after K jumps the zone advances instead)",
                )

    def _set_in_vocab(self, c: Constraint) -> None:
        """W208: a `Set(...)` literal holding tokens the value's vocabulary does not have (they
        can never be proposed, so they neither satisfy a `require` nor trip a `forbid`)."""
        assert c.access is not None and c.set is not None
        v = self.values.get(c.access.value)
        if v is None or v.vocab is None or c.set.func != "Set":
            return
        vocab = self._vocab_of(v.name)
        try:
            outside = sorted(t for t in set_members(c.set, self.env) if not 0 <= t < vocab)
        except EvalError:
            return
        if outside:
            shown = ", ".join(map(str, outside[:6])) + (", …" if len(outside) > 6 else "")
            self.sink.warning(
                "W208",
                f"`Set(...)` of constraint `{c.name}` holds {len(outside)} token"
                f"{'s' if len(outside) > 1 else ''} outside the vocabulary of `{v.name}` "
                f"(0..{vocab - 1}): {shown}; no cell can hold them",
                c.set.span,
                f"keep the set within 0..{vocab - 1}",
            )

    def _vocab_of(self, value: str) -> int:
        v = self.values[value]
        try:
            return evaluate(v.vocab, self.env) if v.vocab is not None else 256
        except EvalError:
            return 256

    def _value_allowed(self, value: str, vocab: int) -> set[int]:
        """Tokens the program's `in Set(...)` constraints over ``value`` let a stream hold."""
        allowed = set(range(vocab))
        for c in self.p.constraints:
            if c.pred != PredKind.IN_SET or c.access is None or c.access.value != value:
                continue
            assert c.set is not None
            if c.set.func != "Set":
                continue
            members = set_members(c.set, self.env)
            allowed = allowed & members if c.kind == "require" else allowed - members
        return allowed

    # ---- built-in signatures: policies, schedules, models -------------------------------------
    def _signatures(self) -> None:
        for cm in self.p.commits:
            v = self.values.get(cm.access.value)
            if v is not None and v.dtype == DType.PARAMS:
                continue  # checked when built (diloco, average, satisfy)
            self._policy(cm.policy, v)
        for r in self.p.rules:
            if r.kind == RuleKind.MINIMIZE:
                continue  # checked when built (lmpm.train.spec.MinimizeSpec's options)
            if r.kind == RuleKind.SCHEDULE:
                if not self._ruleset_rule(r):
                    self._schedule(r.proposal)
            else:
                self._model(r, r.proposal)
                if r.score is not None:
                    self._model(r, r.score)
        if self.known is None:
            from lmpm.bindings import BUILTINS

            reported: set[str] = set()
            for call in self.p.calls():
                if call.func in BUILTINS or call.func in reported or call.role == "policy":
                    continue
                if call.func in self.user_bound:
                    continue  # bound by a --bind module
                if call.role in TRAIN_ROLES:
                    continue  # bound by the training runtime (lmpm.train)
                reported.add(call.func)
                near = _suggest(call.func, sorted(BUILTINS))
                self.sink.warning(
                    "W210",
                    f"`{call.func}` ({call.role}) is not a built-in name; a run must bind it "
                    "(--bind MODULE, or bindings= in Python)",
                    _name_span(call),
                    near or "check it with `lmpm check --strict --bind MODULE`",
                )

    def _user_bound(self, name: str) -> bool:
        """A name some --bind module / bindings= mapping binds (it overrides a built-in)."""
        if name in self.user_bound:
            return True
        if self.known is None:
            return False
        from lmpm.bindings import BUILTINS

        return name in self.known and name not in BUILTINS

    @property
    def ast_calls(self) -> dict[Span, ast.Call]:
        """Each call of the source by its span (walked once, when a diagnostic points into one)."""
        if self._ast_calls is None:
            self._ast_calls = {} if self._tree is None else _ast_calls(self._tree)
        return self._ast_calls

    def _bound(self, e: Expr) -> bool:
        """Whether ``e`` uses only parameters with a value (a default or --set), not probe sizes."""
        if self._given is None:
            self._given = {p.name for p in self.p.params if p.default is not None} | set(
                self.overrides
            )
        return all(n in self._given for op, n in names_in(e) if op == Op.PARAM)

    def _arg_span(self, call: Call, i: int, *, value: bool = False) -> Span:
        """The i-th argument (``k=0``), or with ``value`` only its value (``0``)."""
        node = self.ast_calls.get(call.span)
        if node is not None and i < len(node.args):
            return node.args[i].value.span if value else node.args[i].span
        return call.span

    def _policy(self, call: Call, v: Value | None) -> None:
        sig = SIGNATURES.get(call.func)
        if sig is None or sig.role != "policy":
            if self._user_bound(call.func) or _registered_policy(call.func):
                return
            near = _suggest(call.func, list(POLICIES))
            self.sink.error(
                "E210",
                f"unknown commit policy `{call.func}`",
                _name_span(call),
                (near + "; " if near else "") + "policies: " + ", ".join(POLICIES),
            )
            return
        if sig.dtypes and v is not None and v.dtype.value not in sig.dtypes:
            self.sink.error(
                "E211",
                f"`{call.func}` needs a value of type {' or '.join(sig.dtypes)}; `{v.name}` holds "
                f"{v.dtype.value}s",
                _name_span(call),
                "for tokens use satisfy(max_constraints_then_score) or winner_takes_all",
            )
        if len(call.args) > len(sig.params):
            self.sink.error(
                "E210",
                f"`{call.func}` takes {len(sig.params)} argument"
                f"{'s' if len(sig.params) != 1 else ''}; got {len(call.args)}",
                self._arg_span(call, len(sig.params)),
                f"write {sig.doc}",
            )
            return
        for i, (a, prm) in enumerate(zip(call.args, sig.params)):
            if a.key is not None:
                self.sink.error(
                    "E210",
                    f"`{call.func}` takes positional arguments; got `{a.key}=`",
                    self._arg_span(call, i),
                    f"write {sig.doc}",
                )
                continue
            if a.kind == ArgKind.OF and "of" in prm.kinds:
                self._count_of(call, i, a)
                continue
            if prm.name == "inner":
                if a.kind == ArgKind.CALL and a.call is not None:
                    self._policy(a.call, v)
                elif a.kind in (ArgKind.NAME, ArgKind.STR):
                    self._policy(Call(str(a.value), (), "policy", self._arg_span(call, i)), v)
                else:
                    self._arg_error("E210", call, i, a, prm, sig)
                continue
            self._check_arg("E210", call, i, a, prm, sig)

    def _count_of(self, call: Call, i: int, a: Arg) -> None:
        """`k of n` (quorum): integers with 1 <= k <= n, the caret on the side that is wrong."""
        node = self.ast_calls.get(call.span)
        of = node.args[i].value if node is not None and i < len(node.args) else None
        spans = (of.count.span, of.total.span) if isinstance(of, ast.Of) else (call.span,) * 2
        got: list[int | None] = []
        for part in a.parts:
            value: int | None = None
            if part.kind == ArgKind.INT:
                value = int(part.value)  # type: ignore[arg-type]
            elif part.kind == ArgKind.EXPR and part.expr is not None:
                try:
                    value = int(evaluate(part.expr, self.env))
                except EvalError:
                    value = None  # an unbound param: decided when it is given
            got.append(value)
        k, n = got
        if n is not None and n < 1:
            self.sink.error(
                "E210",
                f"`{call.func}`: {k if k is not None else 'k'} of {n} needs at least 1 replica",
                spans[1],
                "write e.g. quorum(2 of 3, satisfy)",
            )
        elif k is not None and (k < 1 or (n is not None and k > n)):
            bound = f"between 1 and {n}" if n is not None else "at least 1"
            self.sink.error(
                "E210",
                f"`{call.func}`: {k} of {n if n is not None else 'n'} asks for {k} agreeing "
                f"replicas; k must be {bound}",
                spans[0],
                "write e.g. quorum(2 of 3, satisfy)",
            )

    def _ruleset_rule(self, r: Rule) -> bool:
        """No rule proposes to a `Rule` Set (the seed's RuleSet): the active constraints change
        between epochs through enable/disable, which a rule cannot call (E214). True: reported."""
        v = self.values.get(r.target)
        if v is None or v.dtype != DType.RULE:
            return False
        self.sink.error(
            "E214",
            f"`{r.target}` is a Set of Rules, the RuleSet (the active constraints): no rule "
            "proposes to it",
            r.span,
            "switch constraints between epochs with `lmpm run --resume DIR --disable NAME` "
            "(or --enable), or run.disable(NAME) in Python; remove this rule",
        )
        return True

    def _schedule(self, call: Call) -> None:
        sig = SIGNATURES.get(call.func)
        if sig is not None and sig.role != "schedule" and not self._user_bound(call.func):
            self.sink.error(
                "E212",
                f"`{call.func}` is a {sig.role}, not a schedule: a rule on a Set value proposes "
                "the open set",
                _name_span(call),
                'write e.g. SampleTiles(strategy="red-black", epoch=e)',
            )
            return
        if sig is None or sig.role != "schedule" or self._user_bound(call.func):
            return
        for i, a in enumerate(call.args):
            if a.key is None:
                self.sink.error(
                    "E212",
                    f"`{call.func}` takes keyword arguments; this one has no name",
                    self._arg_span(call, i),
                    f"write {sig.doc}",
                )
                continue
            prm = sig.param(a.key)
            if prm is None:
                near = _suggest(a.key, [p.name for p in sig.params])
                self.sink.error(
                    "E212",
                    f"`{call.func}` has no argument `{a.key}`",
                    self._arg_span(call, i),
                    (near + "; " if near else "")
                    + "arguments: "
                    + ", ".join(p.name for p in sig.params),
                )
                continue
            self._check_arg("E212", call, i, a, prm, sig)

    def _model(self, r: Rule, call: Call) -> None:
        sig = SIGNATURES.get(call.func)
        if sig is None or sig.role not in ("model", "score") or self._user_bound(call.func):
            return
        v = self.values.get(r.target)
        names = _input_names(r, call)
        missing = [n for n in sig.reads if n not in names]
        if missing:
            have = ", ".join(f"`{n}`" for n in sorted(names)) or "none"
            need = missing[0]
            first = next((rd.name for rd in r.reads), None)
            fix = f"name a read `{need}` (`read {{{need} = ...}}`)" + (
                f" or pass it by keyword: `{call.func}({need}={first})`" if first else ""
            )
            self.sink.error(
                "E213",
                f"`{call.func}` needs an input named `{need}`; rule `{r.name}` gives it {have}",
                _name_span(call),
                fix,
            )
        if sig.role == "model" and v is not None:
            if sig.dtypes and v.dtype.value not in sig.dtypes:
                self.sink.error(
                    "E213",
                    f"`{call.func}` proposes {' or '.join(sig.dtypes)}s; `{v.name}` holds "
                    f"{v.dtype.value}s",
                    _name_span(call),
                )
            elif sig.vocab is not None and v.vocab is not None and self._bound(v.vocab):
                try:
                    vocab = evaluate(v.vocab, self.env)
                except EvalError:
                    vocab = sig.vocab
                if vocab != sig.vocab:
                    self.sink.error(
                        "E213",
                        f"`{call.func}` proposes tokens of a vocabulary of {sig.vocab}; "
                        f"`{v.name}` has {vocab}",
                        _name_span(call),
                        f"declare `{v.name}` with Token[{sig.vocab}], or bind another model",
                    )
        for i, a in enumerate(call.args):
            if a.kind in (ArgKind.READ, ArgKind.FORWARD):
                continue
            if a.key is None:
                continue  # a positional literal: passed as argN, ignored by the built-ins
            prm = sig.param(a.key)
            if prm is None:
                near = _suggest(a.key, [p.name for p in sig.params])
                self.sink.error(
                    "E213",
                    f"`{call.func}` has no argument `{a.key}`",
                    self._arg_span(call, i),
                    (near + "; " if near else "")
                    + (
                        "arguments: " + ", ".join(p.name for p in sig.params)
                        if sig.params
                        else f"`{call.func}` takes reads only"
                    ),
                )
                continue
            self._check_arg("E213", call, i, a, prm, sig)

    def _check_arg(
        self, code: str, call: Call, i: int, a: Arg, prm: SigParam, sig: Signature
    ) -> None:
        if a.kind.value not in prm.kinds:
            self._arg_error(code, call, i, a, prm, sig)
            return
        if prm.choices and a.kind in (ArgKind.STR, ArgKind.NAME) and a.value not in prm.choices:
            near = _suggest(str(a.value), list(prm.choices))
            self.sink.error(
                code,
                f"`{call.func}`: {prm.name} `{a.value}` is not one of " + ", ".join(prm.choices),
                self._arg_span(call, i, value=True),
                near or f"write {sig.doc}",
            )
            return
        value: float | None = None
        if a.kind in (ArgKind.INT, ArgKind.FLOAT):
            value = float(a.value)  # type: ignore[arg-type]
        elif a.kind == ArgKind.EXPR and a.expr is not None:
            try:
                value = evaluate(a.expr, self.env)
            except EvalError:
                value = None  # uses the epoch or a variable: decided at run time
        if value is None:
            return
        if (prm.minimum is not None and value < prm.minimum) or (prm.positive and value <= 0):
            bound = f"at least {prm.minimum:g}" if prm.minimum is not None else "above 0"
            self.sink.error(
                code,
                f"`{call.func}`: {prm.name} must be {bound}, got {value:g}",
                self._arg_span(call, i, value=True),
            )

    def _arg_error(
        self, code: str, call: Call, i: int, a: Arg, prm: SigParam, sig: Signature
    ) -> None:
        kinds = " or ".join(_KIND_WORDS.get(k, k) for k in prm.kinds)
        got = _KIND_WORDS.get(a.kind.value, a.kind.value)
        self.sink.error(
            code,
            f"`{call.func}`: {prm.name} must be {kinds}, got {got}",
            self._arg_span(call, i, value=True),
            f"write {sig.doc}",
        )

    def _strict_names(self) -> None:
        if self.known is None:
            return
        reported: set[str] = set()
        params = {v.name for v in self.p.values if v.dtype == DType.PARAMS}
        skip = {id(cm.policy) for cm in self.p.commits if cm.access.value in params}
        for call in self.p.calls():
            if call.func in self.known or call.func in reported:
                continue
            if call.role in TRAIN_ROLES or id(call) in skip:
                continue  # bound by the training runtime (lmpm.train)
            reported.add(call.func)
            msg = f"`{call.func}` ({call.role}) is not bound to anything"
            hint = "bind it in a module passed with --bind, or use a built-in name"
            close = _suggest(call.func, sorted(self.known))
            if close:
                hint = f"{close} ({hint})"
            if self.strict:
                self.sink.error("E207", msg, call.span, hint)


# Call roles of a training program, bound by the training runtime rather than by name lookup.
TRAIN_ROLES = ("minimize", "loss", "norm")


# Probed facts per clause structure (see lmpm.ir.probe), shared by every check in the process.
_Hit = tuple[tuple[int, ...], tuple[int, ...]] | None  # (probe cell, offending source cell)
_OOB = list[tuple[int, int, int, tuple[int, ...], set[str]]]
_BOUNDS: dict[tuple[object, ...], _OOB] = {}
_FIRES: dict[tuple[object, ...], bool] = {}
_READS: dict[tuple[object, ...], _Hit] = {}
_FUTURE: dict[tuple[object, ...], _Hit] = {}


_KIND_WORDS = {
    "int": "an integer",
    "float": "a decimal",
    "expr": "an integer expression",
    "str": "a string",
    "name": "a name",
    "call": "a call",
    "read": "a read",
    "access": "an access",
    "forward": "`...`",
    "of": "`k of n`",
}


def _input_names(r: Rule, call: Call) -> set[str]:
    """The input names ``call`` sees in rule ``r`` (as lmpm.resolve.plan passes them): a model
    sees each read under the keyword(s) of the arguments naming it, else under its own name; a
    score sees the reads its arguments name, or with `...` what the model sees."""
    if call is r.score and not any(a.kind == ArgKind.FORWARD for a in call.args):
        return {str(a.value) for a in call.args if a.kind == ArgKind.READ}
    keyed: dict[str, list[str]] = {}
    for a in r.proposal.args:
        if a.kind == ArgKind.READ:
            keyed.setdefault(str(a.value), []).append(a.key or str(a.value))
    names: set[str] = set()
    for rd in r.reads:
        names.update(keyed.get(rd.name, [rd.name]))
    return names


def _name_span(call: Call) -> Span:
    """The span of the call's name (``average`` in ``average()``)."""
    sp = call.span
    return Span(sp.file, sp.line, sp.col, sp.line, sp.col + len(call.func))


def _suggest(name: str, candidates: list[str]) -> str | None:
    import difflib

    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


def _ast_kids(a: ast.Expr | None) -> tuple[ast.Expr, ...]:
    match a:
        case ast.BinOp(lhs=lhs, rhs=rhs) | ast.Cmp(lhs=lhs, rhs=rhs):
            return (lhs, rhs)
        case ast.And(lhs=lhs, rhs=rhs) | ast.Or(lhs=lhs, rhs=rhs):
            return (lhs, rhs)
        case ast.Neg(operand=x) | ast.Not(operand=x):
            return (x,)
    return ()


def _index_ast(
    tree: ast.Program, dims: dict[str, tuple[ast.Expr, ...]], guards: dict[str, Span]
) -> None:
    """Where each value's dims and each rule's guard are in the source."""
    for item in tree.items:
        if isinstance(item, ast.Value):
            dims[item.name] = item.shape.dims
        elif isinstance(item, ast.Rule):
            for st in item.body:
                if isinstance(st, ast.On) and st.guard is not None:
                    guards[item.name] = st.guard.span


def _ast_calls(tree: ast.Program) -> dict[Span, ast.Call]:
    """Every call in the source by its span."""
    calls: dict[Span, ast.Call] = {}

    def walk(e: object) -> None:
        stack = [e]
        while stack:
            x = stack.pop()
            if isinstance(x, ast.Call):
                calls.setdefault(x.span, x)
                stack.extend(a.value for a in x.args)
            elif isinstance(x, ast.Arg):
                stack.append(x.value)
            elif hasattr(x, "__slots__") and not isinstance(x, Span):
                for name in x.__slots__:
                    child = getattr(x, name)
                    if isinstance(child, tuple):
                        stack.extend(child)
                    elif child is not None and not isinstance(child, str | int | float | Span):
                        stack.append(child)

    for item in tree.items:
        walk(item)
    return calls


def clear_caches() -> None:
    """Forget every probed fact (benchmarks use it to measure a cold check)."""
    from lmpm.ir import eval as ir_eval
    from lmpm.ir import probe

    for d in (_BOUNDS, _FIRES, _READS, _FUTURE, probe._COMPILED, ir_eval._COMPILED):
        d.clear()


def _num(n: int) -> str:
    digits = len(str(abs(n))) if abs(n) < 10**4000 else 4000
    return str(n) if digits <= 30 else f"a number with {digits}+ digits"


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _group_by_target(stencils: tuple[Stencil, ...]) -> dict[str, list[Stencil]]:
    out: dict[str, list[Stencil]] = {}
    for s in stencils:
        out.setdefault(s.target, []).append(s)
    return out


def target_vars(v: Value) -> tuple[str, ...]:
    return v.axis_names


def _vars_of(e: Expr, out: set[str]) -> None:
    out.update(n for op, n in names_in(e) if op == Op.VAR)


def _axes_using(vars_: tuple[str, ...], used: set[str]) -> frozenset[int]:
    return frozenset(k for k, v in enumerate(vars_) if v in used)


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


def _firing(
    vars_: tuple[str, ...], trigger: Expr, tgt: tuple[int, ...], relevant: frozenset[int]
) -> bool:
    if trigger == Expr.const(1):
        return True
    fn = compile_expr(trigger, (*vars_, "e"))
    epochs = _epochs_of(trigger)
    for cell in probe_cells(tgt, relevant):
        for ep in epochs:
            try:
                if fn(*cell, ep):
                    return True
            except EvalError:
                continue
    return False


def _epochs_of(guard: Expr) -> tuple[int, ...]:
    """The epochs to probe ``guard`` at: only epoch 0 unless it uses the epoch variable `e`."""
    uses_e = any(op == Op.VAR and n == "e" for op, n in names_in(guard))
    return PROBE_EPOCHS if uses_e else (0,)


def _fires_at(trig: object, cell: tuple[int, ...], epochs: tuple[int, ...]) -> bool:
    for ep in epochs:
        try:
            if trig(*cell, ep):  # type: ignore[operator]
                return True
        except EvalError:
            continue
    return False


def _uncovered(
    vars_: tuple[str, ...],
    trigger: Expr,
    tvars: set[str],
    want: Compiled,
    have: tuple[Compiled, ...],
    tgt: tuple[int, ...],
) -> _Hit:
    """A probe cell where the read wants a cell no clause makes visible, and that cell; or None."""
    relevant = set(want.relevant_axes()) | _axes_using(vars_, tvars)
    for h in have:
        relevant |= h.relevant_axes()
    trig = compile_expr(trigger, (*vars_, "e"))
    epochs = _epochs_of(trigger)
    for cell in probe_cells(tgt, frozenset(relevant)):
        if not _fires_at(trig, cell, epochs):
            continue
        try:
            wanted = want.cells(cell)
        except EvalError:
            continue
        if not wanted:
            continue
        visible: set[tuple[int, ...]] = set()
        for h in have:
            try:
                visible |= h.cells(cell)
            except EvalError:
                continue
        if not wanted <= visible:
            return cell, min(wanted - visible)
    return None


def _cover_axes(axes: tuple[Axis, ...], dims: tuple[int, ...]) -> dict[int, list[int]]:
    """Target axes a constraint's access restricts, with their in-bounds endpoints as extra probes."""
    out: dict[int, list[int]] = {}
    k = 0
    for ax in axes:
        if ax.kind in (AxisKind.ALL, AxisKind.REGION):
            k += ax.width
            continue
        if not (ax.kind == AxisKind.AT and ax.lo is not None and ax.lo.op == Op.VAR):
            picks = []
            for e in (ax.lo, ax.hi):
                if e is not None and e.op == Op.CONST and isinstance(e.value, int):
                    picks.append(e.value)
            out[k] = [i for i in picks if 0 <= i < dims[k]] if k < len(dims) else []
        k += 1
    return out


def _covers(axes: tuple[Axis, ...], cell: tuple[int, ...]) -> bool:
    """Whether a constraint's (folded) access includes ``cell``; pattern variables match anything."""
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
                if evaluate(ax.lo, {}) != cell[k]:
                    return False
            else:
                assert ax.lo is not None and ax.hi is not None
                if not evaluate(ax.lo, {}) <= cell[k] <= evaluate(ax.hi, {}):
                    return False
        except EvalError:
            pass
        k += 1
    return True


def _reads_later(cover: tuple[Axis, ...], sc: Compiled, tgt: tuple[int, ...]) -> _Hit:
    """A covered probe cell from which the clause reads a later index on the time axis."""
    extra = _cover_axes(cover, tgt)
    relevant = set(sc.relevant_axes()) | {0} | set(extra)
    axes = [
        sorted(set(probe_indices(n)) | set(extra.get(k, ()))) if k in relevant else [n // 2]
        for k, n in enumerate(tgt)
    ]
    for cell in itertools.product(*axes):
        if not _covers(cover, cell):
            continue
        try:
            cells = sc.cells(cell)
        except EvalError:
            continue
        later = min((x for x in cells if x[0] > cell[0]), default=None)
        if later is not None:
            return cell, later
    return None


def set_members(c: Call, env: Mapping[str, int]) -> set[int]:
    """The tokens of a `Set(...)` literal: integers, `lo..hi` ranges, strings (their UTF-8 bytes)."""
    out: set[int] = set()
    lo: int | None = None
    for a in c.args:
        if a.kind == ArgKind.INT:
            out.add(int(a.value))  # type: ignore[arg-type]
        elif a.kind == ArgKind.STR:
            out.update(str(a.value).encode("utf-8"))
        elif a.kind == ArgKind.EXPR and a.expr is not None:
            n = evaluate(a.expr, env)
            if a.key == "lo":
                lo = n
            elif a.key == "hi" and lo is not None:
                out.update(range(lo, n + 1))
                lo = None
            else:
                out.add(n)
    return out


def workflow_reachable(w: Workflow) -> list[bool]:
    """Which zones a stream can enter, starting in the first one."""
    index = {z.name: i for i, z in enumerate(w.zones)}
    seen = [False] * len(w.zones)
    stack = [0] if w.zones else []
    while stack:
        i = stack.pop()
        if i >= len(w.zones) or seen[i]:
            continue
        seen[i] = True
        z = w.zones[i]
        advances = (
            not z.generate
            or z.max_tokens is not None
            or any(x.target is None or x.limit is not None for x in z.exits)
        )
        if advances:
            stack.append(i + 1)
        stack.extend(index[x.target] for x in z.exits if x.target is not None)
    return seen


def check(
    program: Program,
    sink: DiagnosticSink | None = None,
    *,
    overrides: Mapping[str, int] | None = None,
    known_names: Iterable[str] | None = None,
    strict: bool = False,
    tree: ast.Program | None = None,
    bound_names: Iterable[str] = (),
) -> Program:
    """Run every static check; returns the program with constraint statuses decided.

    ``known_names`` (the names a run binds) turns unknown call names into E207 with ``strict``;
    ``bound_names`` (the names the run's own modules/mappings bind) are not held to the signature
    of a built-in they override; ``tree`` (the AST the program was built from) lets diagnostics
    point at sub-expressions.

    Errors go to ``sink`` (raised as CheckError when no sink is given).
    """
    own = sink is None
    sink = sink if sink is not None else DiagnosticSink()
    known = set(known_names) if known_names is not None else None
    out = Checker(program, sink, overrides, known, strict, tree, set(bound_names)).run()
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
    params = {v.name for v in program.values if v.dtype == DType.PARAMS}
    for r in program.rules:
        if (r.kind == RuleKind.MINIMIZE) != (r.target in params):
            problems.append(f"rule {r.name}: minimize rules and Params targets go together")
    accesses = [c.access for c in program.constraints] + [cm.access for cm in program.commits]
    for a in accesses:
        if a is not None and a.value in params and len(a.axes) != 1:
            problems.append(f"an access of the Params value {a.value} has {len(a.axes)} axes")
    for w in program.workflows:
        if w.value not in values:
            problems.append(f"workflow {w.name} runs on an unknown value")
        zones = [z.name for z in w.zones]
        if len(set(zones)) != len(zones):
            problems.append(f"workflow {w.name} has duplicate zones")
        for z in w.zones:
            for x in z.exits:
                if x.target is not None and x.target not in zones:
                    problems.append(f"zone {z.name} of {w.name} jumps to an unknown zone")
            if (z.exits or z.capture is not None) and not z.generate:
                problems.append(f"zone {z.name} of {w.name} has exits but no generation")
    return problems


def _registered_policy(name: str) -> bool:
    """A commit policy registered in this process with ``lmpm.resolve.policies.register`` (looked
    up only if that module is already loaded: the checker never imports torch)."""
    import sys

    policies = sys.modules.get("lmpm.resolve.policies")
    return policies is not None and name in getattr(policies, "POLICIES", {})
