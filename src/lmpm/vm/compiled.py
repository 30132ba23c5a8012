"""The compiled VM step (``VM(..., compile=True)``, ``lmpm vm run --compile``).

An eager VM step is about two hundred small tensor operations (the program counter's dereferences,
the trigger ring, the exits, the history writes) and a few Python decisions that read a tensor
(is a settle round needed, is every stream done, is a tool call waiting). At a thousand streams
each costs microseconds of dispatch whatever its size, so the step costs as much as stepping every
stream in a Python loop. :class:`CompiledStep` traces one whole step -- :meth:`Core.commit` on the
sampled and forced tokens, the settle rounds unrolled, then :meth:`Core.forced` of the next step
and the two flags the driver polls -- with ``make_fx`` into one aten graph, which inductor
compiles into a few fused C++ loops (:func:`lmpm.runtime.data.compiled.compile_graph`). The streams'
state goes in and comes back (the history tables are written in place); the workflow's
instruction tensors go in as they are.

What the graph computes for the next step -- its forced tokens, whether every stream is done,
whether a tool waits -- is kept on the core (``next_forced``, ``flags``) until something changes
the state eagerly (a tool result fed back), so polling ``vm.done`` or ``vm.forced()`` between
steps costs no tensor operation. Compiled and eager steps commit identically, token for token,
with the same status, captures and zone paths (tests/vm/test_vm_compiled.py).

On CUDA the same traced step is compiled by inductor into Triton kernels and captured as one CUDA
graph (:mod:`lmpm.workers.graphs`): the streams' state lives in the graph's static input buffers
(the core's tensors *are* those buffers), a replay runs the whole step and copies the new state
into them, and what escapes the step (its ``StepOut``, the zone visits, the next ``Forced``) is
copied out of the graph's output buffers in two copies (its int64 and its bool outputs). The
flags reach the host through a pinned buffer, read when the GPU got there
(:class:`~lmpm.workers.graphs.LateFlags`): the driver learns that every stream is done, or that a
tool waits, up to a few steps late and never waits per step — a late step commits nothing on the
streams that are done or waiting, so the streams' tokens are the same; the step indices of a tool
result can be later than the eager step's.

A graph depends on the shapes of its inputs (the stream count and length, the zones, exits and
triggers, the tool-result width) and on how many settle rounds the workflow needs, not on the
instructions' values: workflows of one shape share it. :data:`lmpm.runtime.data.compiled._GRAPHS` keeps
it for the process and inductor's on-disk cache for later runs.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import WorkflowError
from lmpm.vm.core import Core, Forced, Sampler, StepOut
from lmpm.workers import graphs, simcuda

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
    "wait_steps",
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


def _shadow(core: Core, ts: tuple[Tensor, ...]) -> Core:
    """A core over the traced tensors ``ts`` (``STATE`` then ``CONSTANTS``) that runs its
    settle rounds unrolled (no Python decision on a tensor's value)."""
    sh = object.__new__(Core)
    sh.__dict__.update(core.__dict__)  # the Python values: B, N, Z, settle_rounds, ...
    for name, t in zip(STATE + CONSTANTS, ts):
        setattr(sh, name, t)
    sh.visits, sh.visits_mask = [], []
    sh.unrolled = True
    sh.next_forced = sh.flags = None
    return sh


def _step_fn(core: Core, rebound: list[str]) -> Callable[..., tuple[Tensor, ...]]:
    """One step over flat tensors: the state (``STATE``), the constants (``CONSTANTS``), the
    sampled tokens and this step's ``Forced``. Returns the ``StepOut``, the state fields the step
    replaced (their names go to ``rebound`` while tracing), the zone visits, the next ``Forced``
    and (3,) int64 flags: every stream done, a tool waiting, settle rounds that moved a
    stream."""

    def step(*ts: Tensor) -> tuple[Tensor, ...]:
        n, m = len(STATE), len(STATE) + len(CONSTANTS)
        sh = _shadow(core, ts[:m])
        sampled, *forced = ts[m:]
        out = Core.commit(sh, sampled, Forced(*forced))
        nxt = Core.forced(sh)
        rebound[:] = [name for name, t in zip(STATE, ts[:n]) if getattr(sh, name) is not t]
        assert sh.settled is not None
        flags = torch.stack((sh.finished.all().long(), sh.waiting.any().long(), sh.settled))
        return (
            *_step_fields(out),
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


def _step_fields(out: StepOut) -> tuple[Tensor, ...]:
    """The ``StepOut`` fields a compiled step returns, in the order the replays read them back."""
    return (out.tokens, out.active, out.kind, out.tags, out.pc, out.token_num, out.triggers)


_FLAGS = 3  # per step: every stream done, a tool waits, streams waiting


def _sampled_step_fn(
    core: Core, sample: Callable[..., Tensor], tensors: int, rebound: list[str]
) -> Callable[..., tuple[Tensor, ...]]:
    """One step with its sampler inside, over flat tensors: the state (``STATE``), the constants
    (``CONSTANTS``), the sampler's ``tensors`` and a tool-answers block
    (:meth:`Core.results_block`; all zero: no answer). The answers are applied first
    (:meth:`Core.answer`), then the step asks ``sample`` for the tokens and commits them: the
    same :meth:`Core.forced` and :meth:`Core.commit` as the eager step. K of these run back to
    back make one replay (:class:`_StepsReplay`; on the CPU, :meth:`CompiledStep.advance`):
    streams done or waiting for a tool idle (commit nothing) until the host's next visit.
    Returns the ``StepOut`` fields, the state fields the step replaced (their names go to
    ``rebound``), the zone visits and their masks (V, B), and (3,) int64 flags (``_FLAGS``)."""

    def run(*ts: Tensor) -> tuple[Tensor, ...]:
        n, m = len(STATE), len(STATE) + len(CONSTANTS)
        sh = _shadow(core, ts[:m])
        Core.answer(sh, ts[m + tensors])
        forced = Core.forced(sh)
        out = Core.commit(sh, sample(sh, forced, *ts[m : m + tensors]), forced)
        rebound[:] = [name for name, t in zip(STATE, ts[:n]) if getattr(sh, name) is not t]
        waiting = sh.waiting.long()
        return (
            *_step_fields(out),
            *(getattr(sh, name) for name in rebound),
            torch.stack(sh.visits),
            torch.stack(sh.visits_mask),
            torch.stack((sh.finished.all().long(), waiting.amax(), waiting.sum())),
        )

    return run


def _stack_steps(per_step: list[tuple[Tensor, ...]]) -> list[Tensor]:
    """K steps' escaping outputs (``StepOut`` fields, visits, their masks, flags), each
    stacked: (K, B) fields, (K * V, B) visits and masks, (K, 3) flags."""
    cols = list(zip(*per_step))
    fields = [torch.stack(c) for c in cols[:_STEP_OUT]]
    return [
        *fields,
        torch.cat(cols[_STEP_OUT]),
        torch.cat(cols[_STEP_OUT + 1]),
        torch.stack(cols[-1]),
    ]


# Captured graphs by (compiled step, input signature): a core that ends hands its graph to the
# next core of the same shapes (a capture costs a warm-up and milliseconds; a step, microseconds).
_REPLAYS: dict[tuple[Any, ...], _Replay] = {}


class _Replay:
    """The compiled step captured as one CUDA graph, over static input buffers.

    ``inputs`` are the step's arguments (``STATE``, ``CONSTANTS``, sampled, the four ``Forced``
    fields): the graph reads them, writes the history tables in place and copies the new state
    and the next ``Forced`` back into them, so that a driver passing the core's own tensors and
    the step's own next ``Forced`` copies in only the sampled tokens. ``flat`` holds what escapes
    the step, one buffer per dtype (int64, bool), copied out after each replay; the flags go to
    the host late (:class:`~lmpm.workers.graphs.LateFlags`)."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Tensor, ...], rebound: list[str]):
        where = [STATE.index(name) for name in rebound]
        forced_at = len(STATE) + len(CONSTANTS) + 1  # the Forced fields follow the sampled tokens
        self.inputs = [a.clone() for a in args]
        self.layout: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self.dtypes: list[torch.dtype] = []

        def body() -> list[Tensor]:
            outs = fn(*self.inputs)
            i = _STEP_OUT
            for k in where:
                self.inputs[k].copy_(outs[i])
                i += 1
            visits, moved = outs[i], outs[i + 1]
            nxt = outs[i + 2 : i + 2 + _FORCED]
            for k, t in enumerate(nxt):
                self.inputs[forced_at + k].copy_(t)
            escaping = [*outs[:_STEP_OUT], visits, moved, *nxt]
            self.layout = [(t.dtype, tuple(t.shape)) for t in escaping]
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            for t in escaping:
                by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
            self.dtypes = list(by_dtype)
            return [*(torch.cat(parts) for parts in by_dtype.values()), outs[i + 2 + _FORCED]]

        def warmup() -> None:  # on copies: the step writes its history tables in place
            for _ in range(2):
                fn(*[a.clone() for a in args])

        outs, self.replay = graphs.capture(body, warmup=warmup)
        self.flat = list(outs[:-1])
        self.flags = graphs.LateFlags(outs[-1])  # (3,): done, a tool waits, settle rounds
        self.sizes = {
            dt: [math.prod(shape) for d, shape in self.layout if d == dt] for dt in self.dtypes
        }
        self.forced_at = forced_at
        self.fed: Forced | None = None  # the Forced the graph left in its inputs
        self.owner: weakref.ref[Core] | None = None  # the core whose state the inputs hold
        self.fresh = True  # the owner's tensors are not the inputs yet

    def run(self, args: tuple[Tensor, ...]) -> list[Tensor]:
        """One step: copy in what is not already in the static inputs, replay, copy out."""
        for a, static in zip(args, self.inputs):
            if a is not static:
                static.copy_(a)
        self.replay()
        self.flags.mark()
        parts = {
            dt: iter(flat.clone().split(self.sizes[dt])) for dt, flat in zip(self.dtypes, self.flat)
        }
        return [next(parts[dt]).view(shape) for dt, shape in self.layout]


_STEPS_REPLAYS: dict[tuple[Any, ...], _StepsReplay] = {}


class _StepsReplay:
    """K steps captured as one CUDA graph (K runs of :func:`_sampled_step_fn`), over static
    input buffers.

    ``inputs`` are the step's arguments (``STATE``, ``CONSTANTS``, the sampler's tensors, the
    answers block). After each step the graph copies the new state back into the inputs (the
    history tables are written in place), and after the first it clears the answers block's
    first column (its answers are in): a driver passing the core's own tensors copies in
    nothing, and tool answers with one copy (the block). The sampler's tensors are its own (the
    graph reads them where they are). What escapes the K steps -- their ``StepOut`` fields
    (K, B) and zone visits, static ring buffers the graph fills -- is one buffer per dtype,
    copied out once per replay; the (K, 3) flags go to the host late
    (:class:`~lmpm.workers.graphs.LateFlags`, at most ``lag`` replays: about 16 steps)."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Tensor, ...], rebound: list[str], steps: int
    ) -> None:
        where = [STATE.index(name) for name in rebound]
        fixed = len(STATE) + len(CONSTANTS)
        self.answers_at = len(args) - 1
        # the state, constants and answers as copies (the core adopts them); the sampler's own
        self.inputs = [a if fixed <= k < self.answers_at else a.clone() for k, a in enumerate(args)]
        self.layout: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self.dtypes: list[torch.dtype] = []

        def body() -> list[Tensor]:
            per_step = []
            for k in range(steps):
                outs = fn(*self.inputs)
                i = _STEP_OUT
                for at in where:
                    self.inputs[at].copy_(outs[i])
                    i += 1
                if k == 0:  # answered: the later steps, and the next replay, answer none
                    self.inputs[self.answers_at][:, 0].zero_()
                per_step.append((*outs[:_STEP_OUT], *outs[i:]))
            *escaping, flags = _stack_steps(per_step)
            self.layout = [(t.dtype, tuple(t.shape)) for t in escaping]
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            for t in escaping:
                by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
            self.dtypes = list(by_dtype)
            return [*(torch.cat(parts) for parts in by_dtype.values()), flags.reshape(-1)]

        def warmup() -> None:  # on copies: the step writes its history tables in place
            for _ in range(2):
                fn(*[a.clone() for a in args])

        outs, self.replay = graphs.capture(body, warmup=warmup)
        self.flat = list(outs[:-1])
        self.flags = graphs.LateFlags(outs[-1], lag=max(2, 16 // steps))  # (K * _FLAGS,)
        self.sizes = {
            dt: [math.prod(shape) for d, shape in self.layout if d == dt] for dt in self.dtypes
        }
        self.owner: weakref.ref[Core] | None = None  # the core whose state the inputs hold
        self.fresh = True  # the owner's tensors are not the inputs yet

    def run(self, args: tuple[Tensor, ...], block: Tensor | None) -> list[Tensor]:
        """K steps: copy in what is not in the static inputs already (nothing once the core
        adopted them) and the answers (one copy), replay once, copy the outputs out."""
        for a, static in zip(args[: self.answers_at], self.inputs):
            if a is not static:
                static.copy_(a)
        if block is not None:
            self.inputs[self.answers_at].copy_(block, non_blocking=True)
        self.replay()
        self.flags.mark()
        parts = {
            dt: iter(flat.clone().split(self.sizes[dt])) for dt, flat in zip(self.dtypes, self.flat)
        }
        return [next(parts[dt]).view(shape) for dt, shape in self.layout]


class CompiledStep:
    """A core's compiled step (one graph per stream count, length and tool-result width); on
    CUDA, captured and replayed as one CUDA graph."""

    def __init__(self, core: Core, workflow: str) -> None:
        self.core = core
        self.workflow = workflow
        # by tool-result width (the one shape that changes in a run: results wider than any
        # before widen the queue); every other input keeps its shape for the core's life
        self._graphs: dict[int, tuple[Callable[..., Any], list[str]]] = {}
        self.graphed = core.device.type == "cuda"
        self._replays: dict[int, _Replay] = {}
        self.compiles = 0  # graphs built or loaded in this process for this core
        self.compile_seconds = 0.0
        self.steps = 0
        self.replays = 0  # K-step graphs run (advance)
        # the step with a sampler inside, by (width, the sampler's function, its tensor count)
        self._sampled: dict[tuple[Any, ...], tuple[Callable[..., Any], list[str]]] = {}
        self._steps_replays: dict[tuple[Any, ...], _StepsReplay] = {}
        self._no_answers: dict[int, Tensor] = {}  # (B, 2 + width) zeros: no tool answers
        from lmpm.runtime.data.compiled import CACHE_ENV, cache_dir

        os.environ.setdefault(CACHE_ENV, str(cache_dir()))  # kept across runs

    def _graph(self, width: int, args: tuple[Tensor, ...]) -> tuple[Callable[..., Any], list[str]]:
        hit = self._graphs[width] = self._build(
            ("vm", self.core.settle_rounds), lambda rebound: _step_fn(self.core, rebound), args
        )
        return hit

    def _build(
        self,
        key: tuple[Any, ...],
        make: Callable[[list[str]], Callable[..., tuple[Tensor, ...]]],
        args: tuple[Tensor, ...],
    ) -> tuple[Callable[..., Any], list[str]]:
        """The compiled ``make(rebound)`` for the signature of ``args`` (``key``: what else the
        graph depends on), and the names of the state fields it replaces."""
        from lmpm.runtime.data.compiled import compile_graph, freeze_compiled, signature

        rebound: list[str] = []
        t0 = time.perf_counter()
        try:
            if simcuda.active() is not None:
                # The simulated device has no inductor backend: its "graph" is the traced step's
                # own function, which the capture then replays (what the device check proves).
                fn = make(rebound)
                fn(*[a.clone() for a in args])  # names the rebound fields, as tracing does
                self.compiles += 1
                self.compile_seconds += time.perf_counter() - t0
                return fn, rebound
            # All inputs of one element crash inductor's C++ wrapper (torch 2.13): one stream
            # runs with the Python wrapper. On CUDA the wrapper is Python (it launches Triton
            # kernels, and the CUDA graph replays them without it).
            fn, gm, how = compile_graph(
                (*key, signature(args)),
                lambda: make(rebound),
                args,
                cpp_wrapper=self.core.B > 1 and not self.graphed,
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
        return fn, rebound

    # ---- K steps per replay ----------------------------------------------------------------------
    def advance(self, sampler: Sampler, block: Tensor | None, steps: int) -> StepOut:
        """``steps`` (K) steps, each the compiled step with ``sampler`` inside, with no host
        decision between them (on CUDA one replay of one CUDA graph): ``block`` (the host's tool
        answers, :meth:`Core.results_block`, or None) goes in with the first; the (K, B)
        ``StepOut`` comes back, and the flags of the last step (late, on CUDA)."""
        core = self.core
        width = core.inj.shape[1]
        none = self._no_answers.get(width)
        if none is None:
            none = self._no_answers[width] = torch.zeros(
                (core.B, 2 + width), dtype=torch.int64, device=core.device
            )
        args = (
            *(getattr(core, name) for name in STATE),
            *(getattr(core, name) for name in CONSTANTS),
            *sampler.tensors,
            none,
        )
        key = (width, sampler.fn, len(sampler.tensors))
        graph = self._sampled.get(key)
        if graph is None:
            graph = self._sampled[key] = self._build(
                ("vm-sampled", core.settle_rounds, sampler.fn),
                lambda rebound: _sampled_step_fn(core, sampler.fn, len(sampler.tensors), rebound),
                args,
            )
        fn, rebound = graph
        self.steps += steps
        self.replays += 1
        core.next_forced = None
        if self.graphed:
            outs = self._replay_steps((*key, steps), fn, rebound, args, block)
        else:
            outs = self._run_steps(fn, rebound, args, block, steps)
        core.visits.append(outs[_STEP_OUT])
        core.visits_mask.append(outs[_STEP_OUT + 1])
        return StepOut(*outs[:_STEP_OUT])

    def _run_steps(
        self,
        fn: Callable[..., Any],
        rebound: list[str],
        args: tuple[Tensor, ...],
        block: Tensor | None,
        steps: int,
    ) -> list[Tensor]:
        """K compiled steps on the CPU, back to back: each step's new state is the next one's
        input; the flags are read once, after the last."""
        core = self.core
        state = list(args[: len(STATE)])
        where = [STATE.index(name) for name in rebound]
        rest = args[len(STATE) : -1]
        answers = block.to(core.device) if block is not None else args[-1]
        per_step = []
        for _ in range(steps):
            outs = fn(*state, *rest, answers)
            answers = args[-1]
            for i, at in enumerate(where, _STEP_OUT):
                state[at] = outs[i]
            per_step.append((*outs[:_STEP_OUT], *outs[_STEP_OUT + len(where) :]))
        for name, t in zip(STATE, state):
            setattr(core, name, t)
        *escaping, flags = _stack_steps(per_step)
        done, waits, _waiting = flags[-1].tolist()
        core.flags = (bool(done), bool(waits))
        return escaping

    def _replay_steps(
        self,
        key: tuple[Any, ...],
        fn: Callable[..., Any],
        rebound: list[str],
        args: tuple[Tensor, ...],
        block: Tensor | None,
    ) -> list[Tensor]:
        core = self.core
        rep = self._steps_replays.get(key)
        if rep is None:
            rep = self._steps_replays[key] = self._adopt_steps(fn, rebound, args, key[-1])
        outs = rep.run(args, block)
        core.flags = _Late(rep.flags, offset=len(rep.flags.seen) - _FLAGS)
        if rep.fresh:  # the core's tensors become the graph's inputs: later replays copy nothing
            rep.fresh = False
            for name, static in zip(STATE + CONSTANTS, rep.inputs):
                setattr(core, name, static)
        return outs

    def _adopt_steps(
        self, fn: Callable[..., Any], rebound: list[str], args: tuple[Tensor, ...], steps: int
    ) -> _StepsReplay:
        """As :meth:`_adopt`, for the K-step graph."""
        from lmpm.runtime.data.compiled import signature

        key = (fn, steps, signature(args))
        rep = _STEPS_REPLAYS.get(key)
        if rep is None or (rep.owner is not None and rep.owner() is not None):
            t0 = time.perf_counter()
            rep = _StepsReplay(fn, args, rebound, steps)
            self.compile_seconds += time.perf_counter() - t0
            _STEPS_REPLAYS[key] = rep
        rep.owner = weakref.ref(self.core)
        rep.fresh = True
        rep.flags.reset()
        return rep

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
        if self.graphed:
            return self._replay(width, fn, rebound, args, f)
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

    def _replay(
        self,
        width: int,
        fn: Callable[..., Any],
        rebound: list[str],
        args: tuple[Tensor, ...],
        f: Forced,
    ) -> StepOut:
        core = self.core
        rep = self._replays.get(width)
        if rep is None:
            rep = self._adopt(fn, rebound, args)
            self._replays[width] = rep
        if rep.fed is not None and f is rep.fed:
            # the driver passes the Forced this graph computed: it is in the inputs already
            args = (*args[: rep.forced_at], *rep.inputs[rep.forced_at :])
        outs = rep.run(args)
        self.steps += 1
        visits, moved = outs[_STEP_OUT], outs[_STEP_OUT + 1]
        nxt = Forced(*outs[_STEP_OUT + 2 :])
        core.next_forced = rep.fed = nxt
        core.flags = _Late(rep.flags)
        core.visits.append(visits)
        core.visits_mask.append(moved)
        if rep.fresh:  # the core's tensors become the graph's inputs: later steps copy nothing
            rep.fresh = False
            for name, static in zip(STATE + CONSTANTS, rep.inputs):
                setattr(core, name, static)
        return StepOut(*outs[:_STEP_OUT])

    def _adopt(
        self, fn: Callable[..., Any], rebound: list[str], args: tuple[Tensor, ...]
    ) -> _Replay:
        """This core's graph: the process's captured one for these shapes when no live core
        owns it (its inputs take this core's state at the first replay), else a new capture."""
        from lmpm.runtime.data.compiled import signature

        key = (fn, signature(args))
        rep = _REPLAYS.get(key)
        if rep is None or (rep.owner is not None and rep.owner() is not None):
            t0 = time.perf_counter()
            rep = _Replay(fn, args, rebound)
            self.compile_seconds += time.perf_counter() - t0
            _REPLAYS[key] = rep
        rep.owner = weakref.ref(self.core)
        rep.fed = None
        rep.fresh = True
        rep.flags.reset()  # the last owner's flags (its streams were done) are not this core's
        return rep


class _Late:
    """``core.flags`` of a replayed step: (every stream done, a tool waits), read late; of K
    replayed steps, the last step's (``offset``: where its row starts in the flags)."""

    def __init__(self, flags: graphs.LateFlags, offset: int = 0) -> None:
        self._flags = flags
        self._offset = offset

    def __getitem__(self, i: int) -> bool:
        return bool(self._flags.read()[self._offset + i])
