"""A deliberately plain reference interpreter of docs/design.md §3 (one cell at a time, Python loops).

It shares nothing with the vectorized runtime but the front end, the bound models, the RNG and two
plan-time helpers (the graph colouring of the `independent` schedule, the `confidence` quota, the
horizon of epoch-guarded triggers): reads
are enumerated with :func:`lmpm.ir.eval.access_cells`, models run one cell and one replica at a time,
constraints are checked candidate by candidate, and each commit policy is written out as the
comparison it is defined as.

Covered: the six schedules (all, raster, red-black, independent, random, confidence), several rules
per value with `when` triggers (on coordinates and on the epoch `e`), quorum replicas, the policies
satisfy, winner_takes_all, average and quorum(k, inner), payloads Token / Float / Tensor[D],
constraints in-set, change and the user predicates `clash` (built in) and `big` (bound by the tests),
soft or `hard` (a proposal that breaks a hard constraint is not eligible; keep-current always is),
Lamport clocks and provenance (rule, epoch), and the passes of raster / random past cells tried
without a commit (docs/runtime.md, "Stability").
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from lmpm.bindings import Bindings
from lmpm.ir.eval import access_cells, bind_params, evaluate
from lmpm.ir.nodes import (
    ArgKind,
    AxisKind,
    DType,
    Op,
    PredKind,
    Program,
    ReadKind,
    RuleKind,
    ShapeKind,
)
from lmpm.resolve.masks import lowering_of
from lmpm.resolve.schedules import color_graph, confidence_quota, epoch_horizon
from lmpm.workers import MaskSets, VocabMask, WorkItem, get_backend
from lmpm.workers import rng as lrng

INPUT_RULE = -2  # provenance of a cell committed from an input
NO_RULE = -1

# A cell's payload: an int (Token), a float (Float, a float32 value) or a tuple of floats (Tensor[D]).
Payload = Any


class Option(NamedTuple):
    """One candidate of one cell: keep-current, or a proposal of (rule, replica, slot)."""

    payload: Payload
    score: float
    rule: int  # -1 for keep
    replica: int
    slot: int
    reads: list[tuple[str, int]]  # the cells the proposing rule read for this cell
    is_keep: bool


def _cells(dims: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for d in dims:
        out = [(*c, i) for c in out for i in range(d)]
    return out


def _flat(c: tuple[int, ...], dims: tuple[int, ...]) -> int:
    i = 0
    for x, d in zip(c, dims):
        i = i * d + x
    return i


def _policy_of(call: Any) -> tuple[str, tuple[Any, ...]]:
    """A policy call as (name, arguments), nested calls as (name, arguments) tuples too."""
    args: list[Any] = []
    for a in call.args:
        if a.kind == ArgKind.CALL:
            args.append(_policy_of(a.call))
        else:
            args.append(a.value)
    return str(call.func), tuple(args)


# the schedules that open unset cells only (a proposal never meets a committed payload)
FRESH = ("raster", "random", "confidence")


class Reference:
    def __init__(
        self,
        program: Program,
        params: dict[str, int] | None = None,
        bindings: dict[str, Any] | None = None,
        seed: int = 0,
        epochs: int | None = None,
    ) -> None:
        self.p = program
        self.env = bind_params(program, params, require_all=True)
        self.b = Bindings((), bindings or {})
        self.seed = seed
        self.backend = get_backend("cpu")
        self.dims: dict[str, tuple[int, ...]] = {}
        self.coords: dict[str, list[tuple[int, ...]]] = {}
        self.offset: dict[str, int] = {}
        self.kind: dict[str, DType] = {}
        self.width: dict[str, int] = {}  # Tensor[D]: D
        off = 0
        for v in program.values:
            if v.shape == ShapeKind.SET:
                continue
            self.dims[v.name] = tuple(evaluate(d, self.env) for d in v.dims)
            self.coords[v.name] = _cells(self.dims[v.name])  # cell i's coordinates: coords[i]
            self.offset[v.name] = off
            self.kind[v.name] = v.dtype
            if v.dtype == DType.TENSOR:
                self.width[v.name] = evaluate(v.vocab, self.env)  # type: ignore[arg-type]
            off += math.prod(self.dims[v.name])
        n = {v: math.prod(d) for v, d in self.dims.items()}
        self.payload = {v: [self._zero(v)] * n[v] for v in self.dims}
        self.committed = {v: [False] * n[v] for v in self.dims}
        self.clock = {v: [0] * n[v] for v in self.dims}
        self.score = {v: [-math.inf] * n[v] for v in self.dims}
        self.rule = {v: [NO_RULE] * n[v] for v in self.dims}  # provenance: rule id
        self.epoch_of = {v: [-1] * n[v] for v in self.dims}  # provenance: epoch of the commit
        self.from_input = {v: [False] * n[v] for v in self.dims}
        self.policy = {v: ("satisfy", ("max_constraints_then_score",)) for v in self.dims}
        for cm in program.commits:
            self.policy[cm.access.value] = _policy_of(cm.policy)
        self.strategy = "all"
        self.k = 1  # raster, random: cells opened per epoch
        self.steps = epochs or 16  # confidence: epochs to commit everything in (default --epochs)
        for r in program.rules:
            if r.kind == RuleKind.SCHEDULE:
                for a in r.proposal.args:
                    if a.key == "strategy":
                        self.strategy = str(a.value)
                    elif a.key == "k":
                        self.k = int(str(a.value))
                    elif a.key == "steps":
                        self.steps = int(str(a.value))
        self.colors: dict[str, list[int]] = {}
        self.epoch = 0
        # Epoch-guarded triggers settle at epoch `until` and then repeat every `cycle` epochs; `quiet`
        # counts the commit-free epochs since the last commit, from `until` on.
        self.until, self.cycle, self.quiet = 0, 1, 0
        for r in program.rules:
            if r.kind == RuleKind.LOCAL:
                pts = self.coords[r.target]
                env_t: dict[str, Any] = dict(self.env)
                env_t.update({v: torch.tensor([c[k] for c in pts]) for k, v in enumerate(r.vars)})
                until, cycle = epoch_horizon(r.trigger, env_t, len(pts))
                self.until, self.cycle = max(self.until, until), math.lcm(self.cycle, cycle)
        # (epoch, constraint, rule) -> [checked, violations, won, lost], as docs/trace.md defines them
        self.trace: dict[tuple[int, str, int], list[int]] = {}
        # the set constraints the resolver lowers into a mask on a rule's logits (docs/runtime.md,
        # "Constraints before choosing"): which ones is its choice; the mask is built here
        self.lowering = lowering_of(program)

    # ---- the vocabulary mask ---------------------------------------------------------------------
    def _mask(
        self, r: Any, cell: tuple[int, ...], i: int, payload: Payload, committed: bool
    ) -> VocabMask | None:
        """The mask on rule ``r``'s logits at one cell: per lowered set constraint (program
        order), the tokens satisfying it and whether it speaks about the cell; levels by priority,
        highest first, `hard` apart; the committed token where the schedule reopens cells."""
        low = self.lowering.get(r.target)
        if low is None or r.name not in low.rules:
            return None
        vocab = int(evaluate(self.p.value(r.target).vocab, self.env))  # type: ignore[arg-type]
        cons = [c for c in self.p.constraints if c.name in low.lowered]
        ok = []
        for c in cons:
            members = self._set(c)
            sat = [(t in members) == (c.kind == "require") for t in range(vocab)]
            ok.append(torch.tensor(sat, dtype=torch.bool))
        prios = sorted({c.priority for c in cons if not c.hard}, reverse=True)
        levels = tuple(
            tuple(s for s, c in enumerate(cons) if c.priority == p and not c.hard) for p in prios
        )
        hard = tuple(s for s, c in enumerate(cons) if c.hard)
        applies = torch.tensor([[self._covers(c, cell, r.target, i) for c in cons]])
        current = None
        if self.strategy not in FRESH:
            current = torch.tensor([int(payload) if committed else -1])  # type: ignore[arg-type]
        return VocabMask(MaskSets(torch.stack(ok), levels, hard), applies, current)

    # ---- payloads ------------------------------------------------------------------------------
    def _zero(self, value: str) -> Payload:
        kind = self.kind[value]
        if kind == DType.TOKEN:
            return 0
        if kind == DType.TENSOR:
            return (0.0,) * self.width[value]
        return 0.0

    def _tensor(self, value: str, payloads: list[Payload]) -> torch.Tensor:
        """(K,) int64 tokens, (K,) float32 numbers or (K, D) float32 vectors."""
        kind = self.kind[value]
        if kind == DType.TOKEN:
            return torch.tensor(payloads, dtype=torch.int64)
        if kind == DType.TENSOR:
            return torch.tensor(payloads, dtype=torch.float32).reshape(-1, self.width[value])
        return torch.tensor(payloads, dtype=torch.float32)

    def _payload_of(self, value: str, t: torch.Tensor) -> Payload:
        kind = self.kind[value]
        if kind == DType.TOKEN:
            return int(t)
        if kind == DType.TENSOR:
            return tuple(float(x) for x in t.reshape(-1).tolist())
        return float(t)

    def _mean(self, value: str, payloads: list[Payload]) -> Payload:
        # float32 sum then one float32 division: the mean a float32 tensor program computes
        total = self._tensor(value, payloads).sum(dim=0)
        return self._payload_of(value, total / len(payloads))

    def _dtype(self, value: str) -> torch.dtype:
        return torch.int64 if self.kind[value] == DType.TOKEN else torch.float32

    def set_input(self, value: str, values: list[Any]) -> None:
        for i, x in enumerate(values):
            if x is not None:
                self.payload[value][i] = int(x) if self.kind[value] == DType.TOKEN else x
                self.committed[value][i] = True
                self.clock[value][i] = max(self.clock[value][i], 1)
                self.score[value][i] = 0.0
                self.rule[value][i] = INPUT_RULE
                self.from_input[value][i] = True

    # ---- reads and schedules -------------------------------------------------------------------
    def _visible(self, target: str, source: str, cell: tuple[int, ...]) -> list[int]:
        """The cells of ``source`` visible from ``target[cell]``: the union of its clauses."""
        src = self.dims[source]
        cells: set[tuple[int, ...]] = set()
        for s in self.p.stencils:
            if s.target == target and s.source == source:
                local = dict(self.env)
                local.update(zip(s.vars, cell))
                cells |= set(access_cells(s.axes, s.binders, s.guard, local, src))
        return sorted(_flat(c, src) for c in cells)

    def _read_cells(
        self, rule: Any, rd: Any, cell: tuple[int, ...], env: dict[str, int]
    ) -> list[int]:
        if rd.kind == ReadKind.VISIBLE:
            return self._visible(rule.target, rd.source, cell)
        src = self.dims[rd.source]
        return sorted({_flat(c, src) for c in access_cells(rd.axes, rd.binders, None, env, src)})

    def _colors(self, value: str) -> list[int]:
        """`independent`: a colouring of the value's visibility graph (computed the way the plan
        does, from this interpreter's own enumeration of the visible cells), checked proper."""
        hit = self.colors.get(value)
        if hit is not None:
            return hit
        dims = self.dims[value]
        n = math.prod(dims)
        if not any(s.target == value and s.source == value for s in self.p.stencils):
            colors = [0] * n
        else:
            adj = [self._visible(value, value, cell) for cell in self.coords[value]]
            width = max(1, max(len(a) for a in adj))
            index = torch.zeros((n, width), dtype=torch.int64)
            valid = torch.zeros((n, width), dtype=torch.bool)
            for i, a in enumerate(adj):
                for j, c in enumerate(a):
                    index[i, j] = c
                    valid[i, j] = True
            colors = color_graph(index, valid).tolist()
            for i, a in enumerate(adj):
                for j in a:
                    assert i == j or colors[i] != colors[j], (value, i, j, "colouring not proper")
        self.colors[value] = colors
        return colors

    def _open(self, value: str, e: int, committed: list[bool]) -> list[int]:
        """The cells of ``value`` open in epoch ``e`` (sorted)."""
        dims = self.dims[value]
        n = math.prod(dims)
        unset = [i for i in range(n) if not committed[i]]
        if self.strategy == "all":
            return list(range(n))
        if self.strategy == "red-black":
            return [i for i, c in enumerate(self.coords[value]) if sum(c) % 2 == e % 2]
        if self.strategy == "independent":
            colors = self._colors(value)
            return [i for i in range(n) if colors[i] == e % (max(colors, default=0) + 1)]
        # raster / random pass over the cells tried since the last commit: `skip` slices of k, in
        # the order drawn at the pass's first epoch
        skip, start = self.quiet // self.cycle, e - self.quiet
        if self.strategy == "raster":  # the first k unset cells not yet tried in this pass
            return unset[skip * self.k : (skip + 1) * self.k]
        if self.strategy == "random":  # k unset cells, drawn by counter-based noise per cell
            u = {
                i: float(lrng.uniform(self.seed, value, torch.tensor([i]), start, "schedule")[0, 0])
                for i in unset
            }
            return sorted(
                sorted(unset, key=lambda i: (u[i], i))[skip * self.k : (skip + 1) * self.k]
            )
        if self.strategy == "confidence":  # every unset cell proposes; the quota cuts commits
            return unset
        raise NotImplementedError(self.strategy)

    # ---- one epoch -----------------------------------------------------------------------------
    def _propose(
        self,
        rid: int,
        r: Any,
        rep: int,
        cell: tuple[int, ...],
        e: int,
        payload: dict[str, list[Payload]],
        committed: dict[str, list[bool]],
    ) -> list[Option]:
        """The proposals of one rule replica for one cell (its model called for that cell alone)."""
        dims = self.dims[r.target]
        i = _flat(cell, dims)
        env = dict(self.env)
        env.update(zip(r.vars, cell))
        inputs: dict[str, torch.Tensor] = {
            "cells": torch.tensor([i]),
            "coords": torch.tensor([list(cell)]),
        }
        read_cells: list[tuple[str, int]] = []
        arg_of = {
            str(a.value): (a.key or str(a.value)) for a in r.proposal.args if a.kind == ArgKind.READ
        }
        for rd in r.reads:
            cs = self._read_cells(r, rd, cell, env)
            read_cells += [(rd.source, c) for c in cs]
            name = arg_of.get(rd.name, rd.name)
            data = self._tensor(rd.source, [payload[rd.source][c] for c in cs])
            inputs[name] = data.reshape(1, *data.shape)
            inputs[f"{name}_mask"] = torch.tensor(
                [committed[rd.source][c] for c in cs], dtype=torch.bool
            ).reshape(1, len(cs))
            inputs[f"{name}_index"] = torch.tensor(cs, dtype=torch.int64).reshape(1, len(cs))
        kwargs: dict[str, Any] = {}
        for k, a in enumerate(r.proposal.args):
            if a.kind in (ArgKind.INT, ArgKind.STR, ArgKind.NAME):
                kwargs[a.key or f"arg{k}"] = a.value
            elif a.kind == ArgKind.EXPR:
                kwargs[a.key or f"arg{k}"] = evaluate(a.expr, self.env | {"e": e})  # type: ignore[arg-type]
        vocab = None
        if self.kind[r.target] == DType.TOKEN:
            vocab = evaluate(self.p.value(r.target).vocab, self.env)  # type: ignore[arg-type]
        kwargs.update(epoch=e, vocab=vocab, seed=self.seed)
        item = WorkItem(
            r.name,
            self.b.get(r.proposal.func),
            inputs,
            torch.tensor([i + self.offset[r.target]]),
            vocab,
            kwargs,
            dtype=self._dtype(r.target),
            seed=self.seed,
            epoch=e,
            value=r.target,
            replica=rep,
            mask=self._mask(r, cell, i, payload[r.target][i], committed[r.target][i]),
        )
        res = self.backend.collect(self.backend.dispatch([item]))[0]
        scores = res.score.to(torch.float64).reshape(-1).tolist()
        props = res.proposal.reshape(len(scores), *res.proposal.shape[1 + (res.score.dim() > 1) :])
        return [
            Option(self._payload_of(r.target, pv), sv, rid, rep, slot, read_cells, False)
            for slot, (pv, sv) in enumerate(zip(props, scores))
        ]

    def step(self) -> int:
        e = self.epoch
        snap_payload = {v: list(x) for v, x in self.payload.items()}
        snap_committed = {v: list(x) for v, x in self.committed.items()}
        snap_clock = {v: list(x) for v, x in self.clock.items()}
        local_rules = [r for r in self.p.rules if r.kind == RuleKind.LOCAL]
        targets = {r.target for r in local_rules}
        open_ = {v: self._open(v, e, snap_committed[v]) for v in targets}
        # props[value][cell]: every proposal, in column order (rule, replica, slot)
        props: dict[str, dict[int, list[Option]]] = {}
        for rid, r in enumerate(local_rules):
            replicas = self._replicas(r.target)
            for rep in range(replicas):
                for i in open_[r.target]:
                    cell = self.coords[r.target][i]
                    env = dict(self.env)
                    env.update(zip(r.vars, cell))
                    env["e"] = e
                    if not evaluate(r.trigger, env):
                        continue
                    out = self._propose(rid, r, rep, cell, e, snap_payload, snap_committed)
                    props.setdefault(r.target, {}).setdefault(i, []).extend(out)
        for per_cell in props.values():
            for i in per_cell:  # column order: rule, then replica, then slot
                per_cell[i].sort(key=lambda o: (o.rule, o.replica, o.slot))
        commits = 0
        updates: list[tuple[str, int, Payload, Option, list[Option]]] = []
        for value, per_cell in props.items():
            decided = self._decide_value(
                value, e, per_cell, snap_payload, snap_committed, snap_clock
            )
            updates += [(value, *d) for d in decided]
        for value, i, new, win, contributors in updates:
            reads = [rc for o in contributors for rc in o.reads]
            self.payload[value][i] = new
            self.committed[value][i] = True
            self.score[value][i] = win.score
            self.rule[value][i] = win.rule
            self.epoch_of[value][i] = e
            # Lamport: 1 + max(own clock, the clock of every cell the committed proposals read)
            self.clock[value][i] = 1 + max(
                [snap_clock[value][i]] + [snap_clock[src][c] for src, c in reads]
            )
            commits += 1
        self.epoch += 1
        if commits:
            self.quiet = 0
        elif e >= self.until:
            self.quiet += 1
        return commits

    def _replicas(self, value: str) -> int:
        name, args = self.policy[value]
        return max(int(args[0]) if args else 2, 1) if name == "quorum" else 1

    def _aggregates(self, value: str) -> bool:
        """The policy computes the payload (average), so no proposal is the same as keep."""
        name, args = self.policy[value]
        if name == "quorum":
            inner = args[1] if len(args) > 1 else "satisfy"
            name = inner[0] if isinstance(inner, tuple) else str(inner)
        return name == "average"

    def _decide_value(
        self,
        value: str,
        e: int,
        per_cell: dict[int, list[Option]],
        payload: dict[str, list[Payload]],
        committed: dict[str, list[bool]],
        clock: dict[str, list[int]],
    ) -> list[tuple[int, Payload, Option, list[Option]]]:
        """Check and agree every open cell of ``value`` that has proposals: its commits as
        (cell, new payload, the option whose rule/score it records, the proposals it came from)."""
        dims = self.dims[value]
        cons = [
            c
            for c in self.p.constraints
            if c.access is not None and c.access.value == value and c.pred != PredKind.READ_FUTURE
        ]
        out: list[tuple[int, Payload, Option, list[Option]]] = []
        for i in sorted(per_cell):
            cur, com = payload[value][i], committed[value][i]
            keep_score = self.score[value][i]
            proposals = per_cell[i]
            if com and not self._aggregates(value):
                # A proposal equal to the committed payload *is* keep-current, freshly scored.
                same = [o.score for o in proposals if o.payload == cur]
                if same:
                    keep_score = max(same)
                proposals = [o for o in proposals if o.payload != cur]
            options = [Option(cur, keep_score, -1, -1, -1, [], True), *proposals]
            viol = [
                [
                    self._violates(
                        c, value, dims, i, o.payload, o.is_keep, cur, com, payload, committed
                    )
                    for c in cons
                ]
                for o in options
            ]
            new, win, contributors = self._agree(
                self.policy[value],
                options,
                viol,
                [c.priority for c in cons],
                value,
                self._eligible(options, viol, [c.hard for c in cons]),
            )
            self._trace_cell(e, value, dims, i, options, cons, options.index(win), viol)
            if not win.is_keep and (not com or new != cur):
                out.append((i, new, win, contributors))
        if self.strategy == "confidence":
            # MaskGIT: only the `quota` most confident commits land; ties by the lower cell
            # a share of the cells to generate: cells given as input do not count
            given = sum(self.from_input[value])
            quota = confidence_quota(
                e, self.steps, len(payload[value]) - given, sum(committed[value]) - given
            )
            ranked = sorted(out, key=lambda d: (-d[2].score, d[0]))[:quota]
            out = sorted(ranked, key=lambda d: d[0])
        return out

    @staticmethod
    def _eligible(options: list[Option], viol: list[list[bool]], hard: list[bool]) -> list[int]:
        """The columns the policy may choose: keep-current always, a proposal only if it breaks
        no `hard` constraint (docs/language.md, "hard")."""
        return [
            col
            for col, o in enumerate(options)
            if o.is_keep or not any(v and h for v, h in zip(viol[col], hard))
        ]

    def _agree(
        self,
        policy: tuple[str, tuple[Any, ...]],
        options: list[Option],
        viol: list[list[bool]],
        priority: list[int],
        value: str,
        eligible: list[int] | None = None,
    ) -> tuple[Payload, Option, list[Option]]:
        """One cell's decision: (payload to commit, the winning option, the proposals it came from).

        Keep-current is column 0; ties break by the lowest column, so keep wins every tie."""
        name, args = policy
        cols = list(range(len(options))) if eligible is None else eligible
        if name == "quorum":
            k = int(args[0]) if args else 2
            inner = args[1] if len(args) > 1 else "satisfy"
            inner_policy = inner if isinstance(inner, tuple) else (str(inner), ())

            def votes(o: Option) -> int:
                return sum(
                    1
                    for p in options
                    if not p.is_keep and (p.rule, p.slot, p.payload) == (o.rule, o.slot, o.payload)
                )

            ok = [c for c in cols if options[c].is_keep or votes(options[c]) >= k]
            return self._agree(inner_policy, options, viol, priority, value, ok)
        if name == "satisfy":
            prios = sorted(set(priority), reverse=True)

            def key(col: int) -> tuple[Any, ...]:
                levels = tuple(
                    sum(not viol[col][j] for j, p in enumerate(priority) if p == level)
                    for level in prios
                )
                return (levels, options[col].score, -col)

            best = max(cols, key=key)
            return options[best].payload, options[best], [options[best]]
        if name == "winner_takes_all":
            cands = [c for c in cols if not options[c].is_keep]
            if not cands:
                return options[0].payload, options[0], []
            best = max(cands, key=lambda c: (options[c].score, -c))
            return options[best].payload, options[best], [options[best]]
        if name == "average":
            averaged = [options[c] for c in cols if not options[c].is_keep]
            if not averaged:
                return options[0].payload, options[0], []
            # provenance: the lowest rule that contributed
            first = min(averaged, key=lambda o: (o.rule, o.replica, o.slot))
            return self._mean(value, [o.payload for o in averaged]), first, averaged
        raise NotImplementedError(name)

    def _trace_cell(
        self,
        e: int,
        value: str,
        dims: tuple[int, ...],
        i: int,
        options: list[Option],
        cons: list[Any],
        win: int,
        viol: list[list[bool]],
    ) -> None:
        covers = [self._covers(c, self.coords[value][i], value, i) for c in cons]
        for col, opt in enumerate(options):
            for k, c in enumerate(cons):
                if covers[k]:
                    t = self.trace.setdefault((e, c.name, opt.rule), [0, 0, 0, 0])
                    t[0] += 1
                    t[1] += int(viol[col][k])
        fav = max(range(len(options)), key=lambda col: (options[col].score, -col))
        if fav == win:
            return
        alive = list(range(len(options)))
        for prio in sorted({c.priority for c in cons}, reverse=True):
            sat = {
                col: sum(not viol[col][k] for k, c in enumerate(cons) if c.priority == prio)
                for col in alive
            }
            top = max(sat.values())
            if sat[fav] < top:  # the score favourite falls at this level
                for k, c in enumerate(cons):
                    if c.priority == prio and viol[fav][k] and not viol[win][k]:
                        self.trace.setdefault((e, c.name, options[fav].rule), [0, 0, 0, 0])[3] += 1
                        self.trace.setdefault((e, c.name, options[win].rule), [0, 0, 0, 0])[2] += 1
                return
            alive = [col for col in alive if sat[col] == top]

    # ---- constraints ---------------------------------------------------------------------------
    def _violates(
        self,
        c: Any,
        value: str,
        dims: tuple[int, ...],
        i: int,
        pv: Payload,
        is_keep: bool,
        cur: Payload,
        com: bool,
        payload: dict[str, list[Payload]],
        committed: dict[str, list[bool]],
    ) -> bool:
        cell = self.coords[value][i]
        if not self._covers(c, cell, value, i):
            return False
        unset_keep = is_keep and not com  # an unset cell is in no set and satisfies no predicate
        if c.pred == PredKind.CHANGE:
            holds = (not is_keep) and com and pv != cur
        elif c.pred == PredKind.IN_SET:
            holds = (not unset_keep) and pv in self._set(c)
        elif c.call.func == "clash":  # the candidate equals a committed peer (not the cell itself)
            other = next(a.access for a in c.call.args[1:] if a.kind == ArgKind.ACCESS)
            env = dict(self.env)
            env.update(zip([ax.lo.value for ax in c.access.axes], cell))  # type: ignore[union-attr]
            peers = {_flat(x, dims) for x in access_cells(other.axes, (), None, env, dims)}
            holds = (not unset_keep) and any(
                committed[value][j] and payload[value][j] == pv for j in peers if j != i
            )
        elif c.call.func == "big":  # big(V[..], m): the candidate (a vector: its sum) exceeds m
            limit = next(a.value for a in c.call.args if a.kind == ArgKind.INT)
            holds = (not unset_keep) and (sum(pv) if isinstance(pv, tuple) else pv) > limit
        else:
            raise NotImplementedError(c.call.func)
        if c.kind == "forbid":
            return holds
        return unset_keep or not holds

    def _covers(self, c: Any, cell: tuple[int, ...], value: str, i: int) -> bool:
        k = 0
        env = dict(self.env)
        for ax in c.access.axes:
            if ax.kind == AxisKind.AT and ax.lo is not None and ax.lo.op == Op.VAR:
                env[str(ax.lo.value)] = cell[k]
            k += ax.width
        k = 0
        for ax in c.access.axes:
            if ax.kind == AxisKind.REGION:
                call = ax.call
                assert call is not None
                if call.func == "inputs":
                    if not self.from_input[value][i]:
                        return False
                else:
                    dims = self.dims[value][k : k + ax.width]
                    args = [a.value for a in call.args if a.key is None]
                    mask = torch.as_tensor(
                        self.b.get(call.func)(*args, shape=dims), dtype=torch.bool
                    )
                    if not bool(mask[tuple(cell[k : k + ax.width])]):
                        return False
            elif ax.kind == AxisKind.RANGE:
                if not evaluate(ax.lo, env) <= cell[k] <= evaluate(ax.hi, env):  # type: ignore[arg-type]
                    return False
            elif ax.kind == AxisKind.AT and evaluate(ax.lo, env) != cell[k]:  # type: ignore[arg-type]
                return False
            k += ax.width
        return True

    def _set(self, c: Any) -> set[int]:
        if c.set.func != "Set":
            args = [a.value for a in c.set.args if a.key is None]
            return {int(m) for m in self.b.get(c.set.func)(*args)}
        out: set[int] = set()
        args = list(c.set.args)
        while args:
            a = args.pop(0)
            if a.key == "lo":
                hi = args.pop(0)
                out |= set(range(evaluate(a.expr, self.env), evaluate(hi.expr, self.env) + 1))
            elif a.kind == ArgKind.STR:
                out |= set(str(a.value).encode())
            else:
                out.add(int(a.value))  # type: ignore[arg-type]
        return out
