"""A deliberately plain reference interpreter of docs/design.md §3 (one cell at a time, Python loops).

It shares nothing with the vectorized runtime but the front end, the bound models and the RNG: reads
are enumerated with :func:`lmpm.ir.eval.access_cells`, candidates and constraints are checked cell
by cell, and the satisfy policy is written out as the lexicographic comparison it is defined as.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmpm.bindings import Bindings
from lmpm.ir.eval import access_cells, bind_params, evaluate
from lmpm.ir.nodes import ArgKind, AxisKind, Op, PredKind, Program, ReadKind, RuleKind, ShapeKind
from lmpm.workers import WorkItem, get_backend


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


class Reference:
    def __init__(
        self,
        program: Program,
        params: dict[str, int] | None = None,
        bindings: dict[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        self.p = program
        self.env = bind_params(program, params, require_all=True)
        self.b = Bindings((), bindings or {})
        self.seed = seed
        self.backend = get_backend("cpu")
        self.dims: dict[str, tuple[int, ...]] = {}
        self.offset: dict[str, int] = {}
        off = 0
        for v in program.values:
            if v.shape == ShapeKind.SET:
                continue
            self.dims[v.name] = tuple(evaluate(d, self.env) for d in v.dims)
            self.offset[v.name] = off
            off += math.prod(self.dims[v.name])
        self.payload = {v: [0] * math.prod(d) for v, d in self.dims.items()}
        self.committed = {v: [False] * math.prod(d) for v, d in self.dims.items()}
        self.clock = {v: [0] * math.prod(d) for v, d in self.dims.items()}
        self.score = {v: [-math.inf] * math.prod(d) for v, d in self.dims.items()}
        self.from_input = {v: [False] * math.prod(d) for v, d in self.dims.items()}
        self.strategy = "all"
        self.k = 1  # raster: cells opened per epoch
        for r in program.rules:
            if r.kind == RuleKind.SCHEDULE:
                self.strategy = next(str(a.value) for a in r.proposal.args if a.key == "strategy")
                self.k = next((int(str(a.value)) for a in r.proposal.args if a.key == "k"), 1)
        self.epoch = 0
        # (epoch, constraint, rule) -> [checked, violations, won, lost], as docs/trace.md defines them
        self.trace: dict[tuple[int, str, int], list[int]] = {}

    def set_input(self, value: str, values: list[int | None]) -> None:
        for i, x in enumerate(values):
            if x is not None:
                self.payload[value][i] = int(x)
                self.committed[value][i] = True
                self.clock[value][i] = 1
                self.score[value][i] = 0.0
                self.from_input[value][i] = True

    def _read_cells(self, rule: Any, rd: Any, env: dict[str, int]) -> list[int]:
        src = self.dims[rd.source]
        if rd.kind == ReadKind.VISIBLE:
            cells: set[tuple[int, ...]] = set()
            for s in self.p.stencils:
                if s.target == rule.target and s.source == rd.source:
                    local = dict(self.env)
                    local.update(zip(s.vars, (env[v] for v in rule.vars)))
                    cells |= set(access_cells(s.axes, s.binders, s.guard, local, src))
            return sorted(_flat(c, src) for c in cells)
        return sorted({_flat(c, src) for c in access_cells(rd.axes, rd.binders, None, env, src)})

    def _open(self, value: str, cell: tuple[int, ...]) -> bool:
        if self.strategy == "all":
            return True
        if self.strategy == "red-black":
            return sum(cell) % 2 == self.epoch % 2
        if self.strategy == "raster":  # the first k unset cells (commits land after all proposals)
            unset = [j for j, c in enumerate(self.committed[value]) if not c]
            return _flat(cell, self.dims[value]) in unset[: self.k]
        raise NotImplementedError(self.strategy)  # the differential tests use these three

    def step(self) -> int:
        e = self.epoch
        snap_payload = {v: list(x) for v, x in self.payload.items()}
        snap_committed = {v: list(x) for v, x in self.committed.items()}
        snap_clock = {v: list(x) for v, x in self.clock.items()}
        # candidates[value][cell] = list of (payload, score, rule_index, read cells)
        cands: dict[str, dict[int, list[tuple[int, float, int, list[tuple[str, int]]]]]] = {}
        local_rules = [r for r in self.p.rules if r.kind == RuleKind.LOCAL]
        for rid, r in enumerate(local_rules):
            dims = self.dims[r.target]
            model = self.b.get(r.proposal.func)
            for cell in _cells(dims):
                if not self._open(r.target, cell):
                    continue
                env = dict(self.env)
                env.update(zip(r.vars, cell))
                env["e"] = e
                if not evaluate(r.trigger, env):
                    continue
                i = _flat(cell, dims)
                inputs: dict[str, torch.Tensor] = {
                    "cells": torch.tensor([i]),
                    "coords": torch.tensor([list(cell)]),
                }
                read_cells: list[tuple[str, int]] = []
                arg_of = {
                    str(a.value): (a.key or str(a.value))
                    for a in r.proposal.args
                    if a.kind == ArgKind.READ
                }
                for rd in r.reads:
                    cs = self._read_cells(r, rd, env)
                    read_cells += [(rd.source, c) for c in cs]
                    name = arg_of.get(rd.name, rd.name)
                    inputs[name] = torch.tensor(
                        [[snap_payload[rd.source][c] for c in cs]], dtype=torch.int64
                    ).reshape(1, len(cs))
                    inputs[f"{name}_mask"] = torch.tensor(
                        [[snap_committed[rd.source][c] for c in cs]], dtype=torch.bool
                    ).reshape(1, len(cs))
                    inputs[f"{name}_index"] = torch.tensor([cs], dtype=torch.int64).reshape(
                        1, len(cs)
                    )
                kwargs = {
                    a.key or f"arg{k}": a.value
                    for k, a in enumerate(r.proposal.args)
                    if a.kind in (ArgKind.INT, ArgKind.STR, ArgKind.NAME)
                }
                vocab = evaluate(self.p.value(r.target).vocab, self.env)  # type: ignore[arg-type]
                kwargs.update(epoch=e, vocab=vocab, seed=self.seed)
                item = WorkItem(
                    r.name,
                    model,
                    inputs,
                    torch.tensor([i + self.offset[r.target]]),
                    vocab,
                    kwargs,
                    dtype=torch.int64,
                    seed=self.seed,
                    epoch=e,
                    value=r.target,
                )
                res = self.backend.collect(self.backend.dispatch([item]))[0]
                props = res.proposal.reshape(-1).tolist()
                scores = res.score.to(torch.float64).reshape(-1).tolist()
                for pv, sv in zip(props, scores):
                    cands.setdefault(r.target, {}).setdefault(i, []).append(
                        (int(pv), sv, rid, read_cells)
                    )
        commits = 0
        for value, per_cell in cands.items():
            dims = self.dims[value]
            cons = [
                c
                for c in self.p.constraints
                if c.access is not None
                and c.access.value == value
                and c.pred != PredKind.READ_FUTURE
            ]
            for i, props in per_cell.items():
                cur, com = snap_payload[value][i], snap_committed[value][i]
                keep_score = self.score[value][i]
                fresh = [s for (pv, s, _, _) in props if com and pv == cur]
                if fresh:
                    keep_score = max(fresh)
                options = [(cur, keep_score, -1, [], True)] + [
                    (pv, s, rid, rc, False) for (pv, s, rid, rc) in props if not (com and pv == cur)
                ]
                best = None
                for col, (pv, s, rid, rc, is_keep) in enumerate(options):
                    levels: dict[int, int] = {}
                    for c in cons:
                        ok = not self._violates(
                            c, value, dims, i, pv, is_keep, cur, com, snap_payload, snap_committed
                        )
                        levels[c.priority] = levels.get(c.priority, 0) + int(ok)
                    key = (tuple(levels[p] for p in sorted(levels, reverse=True)), s, -col)
                    if best is None or key > best[0]:
                        best = (key, col, pv, rid, rc, is_keep)
                assert best is not None
                _, col, pv, rid, rc, is_keep = best
                self._trace_cell(
                    e, value, dims, i, options, cons, col, snap_payload, snap_committed
                )
                if not is_keep and (not com or pv != cur):
                    self.payload[value][i] = pv
                    self.committed[value][i] = True
                    self.score[value][i] = options[col][1]
                    self.clock[value][i] = 1 + max(
                        [snap_clock[value][i]] + [snap_clock[src][c] for src, c in rc]
                    )
                    commits += 1
        self.epoch += 1
        return commits

    def _trace_cell(
        self,
        e: int,
        value: str,
        dims: tuple[int, ...],
        i: int,
        options: list[Any],
        cons: list[Any],
        win: int,
        payload: dict[str, list[int]],
        committed: dict[str, list[bool]],
    ) -> None:
        cur, com = payload[value][i], committed[value][i]
        viol = [
            [
                self._violates(c, value, dims, i, pv, is_keep, cur, com, payload, committed)
                for c in cons
            ]
            for (pv, _, _, _, is_keep) in options
        ]
        covers = [self._covers(c, _cells(dims)[i], value, i) for c in cons]
        for col, opt in enumerate(options):
            for k, c in enumerate(cons):
                if covers[k]:
                    t = self.trace.setdefault((e, c.name, opt[2]), [0, 0, 0, 0])
                    t[0] += 1
                    t[1] += int(viol[col][k])
        fav = max(range(len(options)), key=lambda col: (options[col][1], -col))
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
                        self.trace.setdefault((e, c.name, options[fav][2]), [0, 0, 0, 0])[3] += 1
                        self.trace.setdefault((e, c.name, options[win][2]), [0, 0, 0, 0])[2] += 1
                return
            alive = [col for col in alive if sat[col] == top]

    def _violates(
        self,
        c: Any,
        value: str,
        dims: tuple[int, ...],
        i: int,
        pv: int,
        is_keep: bool,
        cur: int,
        com: bool,
        payload: dict[str, list[int]],
        committed: dict[str, list[bool]],
    ) -> bool:
        cell = _cells(dims)[i]
        if not self._covers(c, cell, value, i):
            return False
        unset_keep = is_keep and not com
        if c.pred == PredKind.CHANGE:
            holds = (not is_keep) and com and pv != cur
        elif c.pred == PredKind.IN_SET:
            members = self._set(c)
            holds = (not unset_keep) and pv in members
        else:  # clash, the only user predicate the differential tests bind
            other = next(a.access for a in c.call.args[1:] if a.kind == ArgKind.ACCESS)
            env = dict(self.env)
            env.update(zip([ax.lo.value for ax in c.access.axes], cell))  # type: ignore[union-attr]
            peers = {_flat(x, dims) for x in access_cells(other.axes, (), None, env, dims)}
            holds = (not unset_keep) and any(
                committed[value][j] and payload[value][j] == pv for j in peers if j != i
            )
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
