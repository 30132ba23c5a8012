"""The compiled VM step (``VM(..., compile=True)``, ``lmpm vm run --compile``).

An eager VM step is about two hundred small tensor operations (the program counter's dereferences,
the trigger ring, the exits, the history writes) and a few Python decisions that read a tensor
(is a settle round needed, is every stream done, is a tool call waiting). At a thousand streams
each costs microseconds of dispatch whatever its size, so the step costs as much as stepping every
stream in a Python loop. :class:`CompiledStep` traces one whole step -- :meth:`Core.commit` on the
sampled and forced tokens, the settle rounds unrolled, then :meth:`Core.forced` of the next step
and the two flags the driver polls -- with ``make_fx`` into one aten graph, which inductor
compiles into a few fused C++ loops (:func:`lmpm.runtime.compiled.compile_graph`). The streams'
state goes in and comes back (the history tables are written in place); the workflow's
instruction tensors go in as they are.

What the graph computes for the next step -- its forced tokens, whether every stream is done,
whether a tool waits -- is kept on the core (``next_forced``, ``flags``) until something changes
the state eagerly (a tool result fed back), so polling ``vm.done`` or ``vm.forced()`` between
steps costs no tensor operation. Compiled and eager steps commit identically, token for token,
with the same status, captures and zone paths (tests/vm/test_vm_compiled.py).

A graph depends on the shapes of its inputs (the stream count and length, the zones, exits and
triggers, the tool-result width) and on how many settle rounds the workflow needs, not on the
instructions' values: workflows of one shape share it. :data:`lmpm.runtime.compiled._GRAPHS` keeps
it for the process and inductor's on-disk cache for later runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import WorkflowError
from lmpm.vm.core import Core, Forced, StepOut

# The streams' state: what a step reads and writes (the history tables in place, the rest anew).
STATE = (
    "pc",
    "tok_num",
    "gen_num",
    "gen_bytes",
    "ring",
    "pos",
    "jumps",
    "inj",
    "inj_pos",
    "inj_len",
    "waiting",
    "cb_zone",
    "truncated",
    "cap_start",
    "cap_span",
    "tokens",
    "st_zone",
    "st_num",
    "st_trig",
    "st_kind",
    "st_tags",
)
# Fixed for a core's life: the instructions and the bound inputs.
CONSTANTS = (
    "ar",
    "generate",
    "max_tokens",
    "capture",
    "tool",
    "ztags",
    "exit_zone",
    "exit_pattern",
    "exit_target",
    "exit_limit",
    "patterns",
    "pattern_len",
    "exit_pattern_b",
    "pattern_bit",
    "tok_bytes",
    "tok_len",
    "data",
    "pstart",
    "pend",
)
_STEP_OUT = 7  # StepOut's fields
_FORCED = 4  # Forced's fields


def _step_fn(core: Core, rebound: list[str]) -> Callable[..., tuple[Tensor, ...]]:
    """One step over flat tensors: the state (``STATE``), the constants (``CONSTANTS``), the
    sampled tokens and this step's ``Forced``. Returns the ``StepOut``, the state fields the step
    replaced (their names go to ``rebound`` while tracing), the zone visits, the next ``Forced``
    and (3,) int64 flags: every stream done, a tool waiting, settle rounds that moved a
    stream."""

    def step(*ts: Tensor) -> tuple[Tensor, ...]:
        n, m = len(STATE), len(STATE) + len(CONSTANTS)
        sh = object.__new__(Core)
        sh.__dict__.update(core.__dict__)  # the Python values: B, N, Z, settle_rounds, ...
        for name, t in zip(STATE + CONSTANTS, ts[:m]):
            setattr(sh, name, t)
        sh.visits, sh.visits_mask = [], []
        sh.unrolled = True
        sh.next_forced = sh.flags = None
        sampled, *forced = ts[m:]
        out = Core.commit(sh, sampled, Forced(*forced))
        nxt = Core.forced(sh)
        rebound[:] = [name for name, t in zip(STATE, ts[:n]) if getattr(sh, name) is not t]
        assert sh.settled is not None
        flags = torch.stack((sh.finished.all().long(), sh.waiting.any().long(), sh.settled))
        return (
            out.tokens,
            out.active,
            out.kind,
            out.tags,
            out.pc,
            out.token_num,
            out.triggers,
            *(getattr(sh, name) for name in rebound),
            torch.stack(sh.visits),
            torch.stack(sh.visits_mask),
            nxt.tokens,
            nxt.mask,
            nxt.ask,
            nxt.from_tool,
            flags,
        )

    return step


class CompiledStep:
    """A core's compiled step (one graph per stream count, length and tool-result width)."""

    def __init__(self, core: Core, workflow: str) -> None:
        self.core = core
        self.workflow = workflow
        # by tool-result width (the one shape that changes in a run: results wider than any
        # before widen the queue); every other input keeps its shape for the core's life
        self._graphs: dict[int, tuple[Callable[..., Any], list[str]]] = {}
        self.compiles = 0  # graphs built or loaded in this process for this core
        self.compile_seconds = 0.0
        self.steps = 0
        from lmpm.runtime.compiled import CACHE_ENV, cache_dir

        os.environ.setdefault(CACHE_ENV, str(cache_dir()))  # kept across runs

    def _graph(self, width: int, args: tuple[Tensor, ...]) -> tuple[Callable[..., Any], list[str]]:
        from lmpm.runtime.compiled import _signature, compile_graph, freeze_compiled

        key = ("vm", self.core.settle_rounds, _signature(args))
        rebound: list[str] = []
        t0 = time.perf_counter()
        try:
            # All inputs of one element crash inductor's C++ wrapper (torch 2.13): one stream
            # runs with the Python wrapper.
            fn, gm, how = compile_graph(
                key,
                lambda: _step_fn(self.core, rebound),
                args,
                cpp_wrapper=self.core.B > 1,
            )
        except Exception as exc:
            raise WorkflowError(
                f"--compile could not compile the VM step: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}",
                where={"workflow": self.workflow, "streams": self.core.B},
                code="R158",
                hint="run without --compile (the eager step commits the same)",
            ) from exc
        if how != "reused":
            freeze_compiled()
        if not rebound:  # reused from another core of this process: the graph knows
            rebound = list(gm.meta.get("lmpm_rebound", ()))
        gm.meta["lmpm_rebound"] = tuple(rebound)
        self.compiles += 1
        self.compile_seconds += time.perf_counter() - t0
        hit = self._graphs[width] = (fn, rebound)
        return hit

    def step(self, sampled: Tensor, forced: Forced | None) -> StepOut:
        core = self.core
        f = forced if forced is not None else core.forced()
        if sampled.dtype != torch.int64 or sampled.device != core.device:
            sampled = sampled.to(core.device, torch.int64)
        args = (
            *(getattr(core, name) for name in STATE),
            *(getattr(core, name) for name in CONSTANTS),
            sampled.contiguous(),
            f.tokens,
            f.mask,
            f.ask,
            f.from_tool,
        )
        width = core.inj.shape[1]
        graph = self._graphs.get(width)
        fn, rebound = graph if graph is not None else self._graph(width, args)
        outs = fn(*args)
        self.steps += 1
        i = _STEP_OUT
        for name in rebound:
            setattr(core, name, outs[i])
            i += 1
        visits, moved = outs[i], outs[i + 1]
        core.next_forced = Forced(*outs[i + 2 : i + 2 + _FORCED])
        done, ready, settled = outs[i + 2 + _FORCED].tolist()
        core.flags = (bool(done), bool(ready))
        # the commit's zone change, then the settle rounds that moved a stream (as eagerly)
        for r in range(1 + settled):
            core.visits.append(visits[r])
            core.visits_mask.append(moved[r])
        return StepOut(*outs[:_STEP_OUT])
