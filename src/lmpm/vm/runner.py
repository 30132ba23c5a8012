"""Running a workflow: the VM as the commit engine of its token value.

Each step: pending tool calls are resolved (all ready streams at once), the VM says which streams
commit a forced token, the program's model (the rule that proposes the value) runs **only** for
the other streams, the program's ``in Set(...)`` constraints and the zone's ``generate in`` set
mask its logits, the counter-based RNG samples (keyed by stream and position, so results do not
depend on how streams are batched), and the VM commits. With a run directory every step is one
epoch of the commit log (``lmpm.db``: commits, constraint trace, and the VM's per-token status).

>>> from lmpm.vm import WorkflowRun                                        # doctest: +SKIP
>>> run = WorkflowRun.from_file("examples/vm.lmpm", tools={"Count": count}, seed=0)  # doctest: +SKIP
>>> vm = run.run(); vm.extract()[0]                                       # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lmpm.bindings import Bindings
from lmpm.errors import ModelError
from lmpm.ir.link import link_workflow
from lmpm.ir.nodes import ArgKind, Program
from lmpm.vm.compile import Instructions, compile_workflow
from lmpm.vm.core import StepOut
from lmpm.vm.log import VMLog
from lmpm.vm.machine import VM
from lmpm.workers import rng


@dataclass
class Stats:
    """What a run cost: steps, model rows and forward calls, forced tokens (calls saved)."""

    steps: int = 0
    committed: int = 0  # tokens committed, all streams
    forced: int = 0  # committed without asking the model (prompts and tool results)
    asked: int = 0  # stream-tokens the model proposed
    model_calls: int = 0  # forward passes (one per step with at least one generating stream)
    steps_all_forced: int = 0  # steps where no stream needed the model (no forward at all)
    model_seconds: float = 0.0
    vm_seconds: float = 0.0  # forced() + commit(): the VM's own share of a step
    tool_seconds: float = 0.0
    compile_seconds: float = 0.0  # building the compiled step (--compile), not in vm_seconds

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class WorkflowRun:
    """A workflow of a checked program over its streams, with its model, tools and commit log.

    The model and the tools are bound once, by the link step (:func:`lmpm.ir.link.link_workflow`),
    from ``bindings`` (the run's ``--bind`` modules) or else from the mapping ``tools``."""

    def __init__(
        self,
        program: Program,
        *,
        workflow: str | None = None,
        overrides: Mapping[str, int] | None = None,
        inputs: Mapping[str, Sequence[str] | str] | None = None,
        bindings: Bindings | None = None,
        tools: Mapping[str, Any] | None = None,
        seed: int = 0,
        streams: int | None = None,
        stream_offset: int = 0,
        run_dir: str | Path | None = None,
        source: str = "",
        device: str = "cpu",
        compile: bool = False,
    ) -> None:
        self.program = program
        self.ins: Instructions = compile_workflow(program, workflow, overrides)
        if bindings is None:
            bindings = Bindings(mapping=dict(tools or {}))
        linked = link_workflow(program, self.ins.workflow, bindings)
        self.vm = VM(
            self.ins,
            streams=streams,
            inputs=inputs,
            tools={c.func: linked.bound(c) for c in self.ins.tool_calls},
            device=device,
            compile=compile,
        )
        self.seed = seed
        self.device = torch.device(device)
        b = self.vm.core.B
        self.stream_ids = torch.arange(stream_offset, stream_offset + b, device=self.device)
        rule = self.ins.rule
        self.rule_name = rule.name
        self.model = linked.bound(rule.proposal)
        self.kwargs: dict[str, Any] = {
            str(a.key): value
            for a, value in zip(rule.proposal.args, linked.args(rule.proposal))
            if a.key is not None and a.kind in (ArgKind.INT, ArgKind.STR)
        }
        self.read = rule.reads[0].name if rule.reads else "context"
        self.allowed = self.ins.allowed.to(self.device)  # (Z, V)
        self.value_allowed = self.ins.value_allowed.to(self.device)
        self.stats = Stats()
        self.log = None
        if run_dir is not None:
            self.log = VMLog(run_dir, self, source)

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> WorkflowRun:
        from lmpm.ir import compile_file

        overrides = kw.get("overrides")
        front = compile_file(path, overrides=overrides)
        return cls(front.ir, source=Path(path).read_text(encoding="utf-8"), **kw)

    # ---- the model ---------------------------------------------------------------------------------
    def logits(self, rows: Tensor) -> Tensor:
        """(n, V) next-token logits of the streams ``rows`` from the rule's model."""
        core = self.vm.core
        pos = core.pos[rows]
        width = max(int(pos.max()), 1)
        ctx = core.tokens[rows, :width]
        inputs = {
            "cells": pos,
            self.read: ctx,
            f"{self.read}_mask": ctx >= 0,
            f"{self.read}_index": torch.arange(width, device=self.device).expand(len(rows), -1),
        }
        try:
            out = self.model(inputs, vocab=self.ins.vocab, **self.kwargs)
        except Exception as e:
            raise ModelError(
                f"model `{self.ins.rule.proposal.func}` raised {type(e).__name__}: {e}",
                where={"rule": self.rule_name, "streams": len(rows)},
                span=self.ins.rule.proposal.span,
                code="R156",
            ) from e
        if isinstance(out, dict) and "logits" not in out:  # a proposer (RandomTokens): no logits
            raise ModelError(
                f"model `{self.ins.rule.proposal.func}` returned "
                f"{', '.join(map(str, out)) or 'nothing'}, not logits: the VM samples each token "
                "from the model's next-token logits",
                where={"rule": self.rule_name},
                span=self.ins.rule.proposal.span,
                hint="bind a model that returns logits (ByteLM, a Hugging Face model, or a "
                "function returning {'logits': (streams, vocab)}); proposers such as "
                "RandomTokens fit `lmpm run`",
                code="R157",
            )
        logits = out["logits"] if isinstance(out, dict) else out
        if logits.dim() == 3:
            logits = logits[:, 0]
        if tuple(logits.shape) != (len(rows), self.ins.vocab):
            raise ModelError(
                f"model `{self.ins.rule.proposal.func}` returned logits of shape "
                f"{tuple(logits.shape)}, expected ({len(rows)}, {self.ins.vocab})",
                where={"rule": self.rule_name},
                span=self.ins.rule.proposal.span,
                code="R157",
            )
        return logits.to(self.device)

    def sample(self, rows: Tensor, logits: Tensor) -> Tensor:
        """Sample under the zone's allowed set (zone `in Set` ∧ program constraints)."""
        core = self.vm.core
        ok = self.allowed[core.pc[rows].clamp(max=core.Z - 1)]
        masked = logits.float().masked_fill(~ok, float("-inf"))
        return rng.categorical(
            masked,
            seed=self.seed,
            value=self.ins.value,
            cells=self.stream_ids[rows],
            epoch=core.pos[rows],
            rule=self.rule_name,
        )

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> StepOut:
        vm, st = self.vm, self.stats
        t0 = time.perf_counter()
        if vm.callbacks_ready:
            vm.resolve_callbacks()
        t1 = time.perf_counter()
        st.tool_seconds += t1 - t0
        forced = vm.forced()
        t2 = time.perf_counter()
        rows = forced.ask.nonzero().flatten()
        sampled = torch.zeros(vm.core.B, dtype=torch.int64, device=self.device)
        logp: Tensor | None = None
        if rows.numel():
            logits = self.logits(rows)
            st.model_calls += 1
            tok = self.sample(rows, logits)
            sampled[rows] = tok
            logp = torch.log_softmax(logits.float(), -1).gather(1, tok[:, None])[:, 0]
        else:
            st.steps_all_forced += 1
        built = vm.compiled.compile_seconds if vm.compiled is not None else 0.0
        t3 = time.perf_counter()
        out = vm.step(sampled, forced)
        t4 = time.perf_counter()
        if vm.compiled is not None:
            built = vm.compiled.compile_seconds - built
            st.compile_seconds += built
            t4 -= built
        st.model_seconds += t3 - t2
        st.vm_seconds += (t2 - t1) + (t4 - t3)
        n = int(out.active.sum())
        st.steps += 1
        st.committed += n
        st.forced += int(forced.mask.sum())
        st.asked += int(rows.numel())
        if self.log is not None:
            self.log.on_step(st.steps - 1, out, forced, rows, logp, t4 - t0, t3 - t2)
        return out

    def run(self, max_steps: int | None = None) -> VM:
        """Step until every stream is done (or ``max_steps``); returns the VM for extraction."""
        limit = max_steps if max_steps is not None else self.vm.core.N * 4 + 16
        while not self.vm.done and self.stats.steps < limit:
            self.step()
        if self.log is not None:
            self.log.on_end()
        return self.vm
