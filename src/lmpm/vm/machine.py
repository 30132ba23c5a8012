"""The VM: the core plus tools, extraction and the debug views (the seed's ``MOA_VM``).

>>> import torch
>>> from lmpm.ir import compile_source
>>> from lmpm.vm import VM, compile_workflow
>>> src = '''value Txt : Token[Byte] shape Grid2D(2, 32)
... visible Txt[b, t] <- Txt[b, 0..t-1] when t > 0
... rule R:
...   on Txt[b, t]
...   read {context = Txt[b, 0..t-1]}
...   emit proposal Txt[b, t] := ByteLM(context)
... workflow W on Txt:
...   zone ask:
...     feed "Q:"
...     generate max 3
...     capture a
... '''
>>> vm = VM(compile_workflow(compile_source(src).ir))
>>> while not vm.done:
...     out = vm.step(torch.tensor([ord("x"), ord("y")]))   # what a sampler proposed
>>> vm.generative_sequence(), vm.extract()
(['Q:xxx', 'Q:yyy'], [{'a': 'xxx'}, {'a': 'yyy'}])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lmpm.errors import UsageError, WorkflowError
from lmpm.ir.nodes import ArgKind
from lmpm.vm.compile import ByteTokenizer, Instructions
from lmpm.vm.core import Core, Forced, Sampler, StepOut

if TYPE_CHECKING:
    from lmpm.vm.compiled import CompiledStep

Tool = Callable[[list[Any]], Sequence[str]]
STEPS_PER_REPLAY = (1, 2, 4, 8, 16)  # the K a VM takes (``steps_per_replay``)


class VM:
    """One workflow over B streams: feed it the sampled tokens of a step, get the tokens to commit.

    ``tools`` maps tool names to callables (:class:`lmpm.vm.WorkflowRun` binds them through the
    link step, :func:`lmpm.ir.link.link_workflow`). A tool is
    called once per step for all streams whose zone just ended, with one argument list per stream
    (each argument a capture's text or a literal), and returns one string per stream.
    """

    def __init__(
        self,
        ins: Instructions,
        *,
        streams: int | None = None,
        inputs: Mapping[str, Sequence[str] | str] | None = None,
        tools: Mapping[str, Tool] | None = None,
        tokenizer: ByteTokenizer | None = None,
        device: str | torch.device = "cpu",
        compile: bool = False,
        steps_per_replay: int = 1,
    ) -> None:
        self.ins = ins
        self.tok = tokenizer or ByteTokenizer(min(ins.vocab, 256))
        if steps_per_replay not in STEPS_PER_REPLAY:
            raise UsageError(
                f"steps_per_replay must be one of {', '.join(map(str, STEPS_PER_REPLAY))}; "
                f"got {steps_per_replay!r}",
                code="U146",
                hint="K steps run as one graph between two visits of the host: 1 (every step) "
                "up to 16",
            )
        self.steps_per_replay = steps_per_replay
        if compile and torch.device(device).type not in ("cpu", "cuda"):
            raise UsageError(
                f"the compiled VM step runs on the cpu (inductor's C++) or on cuda (one CUDA "
                f"graph); these streams are on {device}",
                code="U104",
                hint="drop compile=True (the eager step runs on any device)",
            )
        self.core = Core(ins, streams=streams, inputs=inputs, tokenizer=self.tok, device=device)
        self.compiled: CompiledStep | None = None
        if compile:
            from lmpm.vm.compiled import CompiledStep

            self.compiled = CompiledStep(self.core, ins.workflow.name)
        self._tools: Mapping[str, Tool] = tools or {}
        self._tool_fns: dict[int, Tool] = {}
        self.steps = 0
        self.tool_calls = 0  # callables invoked (one per tool per step with ready streams)
        self.answered = 0  # tool answers fed back (one per stream per call)

    # ---- the step ----------------------------------------------------------------------------------
    def forced(self) -> Forced:
        """What this step forces; the model is only needed for ``forced().ask``."""
        return self.core.forced()

    def step(self, sampled: Tensor, forced: Forced | None = None) -> StepOut:
        """Commit a step: forced tokens where the workflow forces, ``sampled`` elsewhere."""
        b = self.core.B
        if not isinstance(sampled, Tensor) or tuple(sampled.shape) != (b,):
            got = tuple(sampled.shape) if isinstance(sampled, Tensor) else type(sampled).__name__
            raise WorkflowError(
                f"step() takes one sampled token per stream, a ({b},) tensor; got {got}",
                where={"workflow": self.ins.workflow.name, "streams": b},
                code="R159",
                hint="pass sampled[b] for every stream (any value where forced().ask is False)",
            )
        if self.callbacks_ready:
            self.resolve_callbacks()
            forced = None
        if self.compiled is not None:
            out = self.compiled.step(sampled, forced)
        else:
            out = self.core.commit(sampled, forced)
        self.steps += 1
        return out

    def advance(self, sampler: Sampler) -> StepOut:
        """Run ``steps_per_replay`` (K) steps with ``sampler`` (the model and sampler on the
        streams' device) and no host decision between them: compiled, one graph (on CUDA one
        replay). The tools that became ready since the last call are resolved first, one call per
        tool for all its waiting streams, and their answers go in with the steps (one copy). A
        stream that finishes, or whose zone ends with a tool call, idles for the rest of the K
        steps (it commits nothing), so every stream commits what K = 1 commits; it learns its
        tool's answer at the next call (:attr:`tool_steps_late`). Returns the K steps'
        ``StepOut``, each field (K, B).

        >>> import torch
        >>> from lmpm.ir import compile_source
        >>> from lmpm.vm import VM, Sampler, compile_workflow
        >>> src = '''value Txt : Token[Byte] shape Grid2D(2, 32)
        ... visible Txt[b, t] <- Txt[b, 0..t-1] when t > 0
        ... rule R:
        ...   on Txt[b, t]
        ...   read {context = Txt[b, 0..t-1]}
        ...   emit proposal Txt[b, t] := ByteLM(context)
        ... workflow W on Txt:
        ...   zone ask:
        ...     feed "Q:"
        ...     generate max 3
        ...     capture a
        ... '''
        >>> vm = VM(compile_workflow(compile_source(src).ir), steps_per_replay=4)
        >>> xy = Sampler(lambda core, forced, t: t[core.ar], (torch.tensor([120, 121]),))
        >>> while not vm.done:
        ...     out = vm.advance(xy)                       # 4 steps: out.tokens is (4, 2)
        >>> vm.extract(), vm.steps
        ([{'a': 'xxx'}, {'a': 'yyy'}], 8)
        """
        core = self.core
        block = self._answers() if self.callbacks_ready else None
        k = self.steps_per_replay
        if self.compiled is not None:
            out = self.compiled.advance(sampler, block, k)
        else:
            if block is not None:
                core.next_forced = core.flags = None
                core.answer(block.to(core.device))
            outs = []
            for _ in range(k):
                f = core.forced()
                outs.append(core.commit(sampler.fn(core, f, *sampler.tensors), f))
            out = StepOut(*(torch.stack(col) for col in zip(*(_fields(o) for o in outs))))
        self.steps += k
        return out

    @property
    def tool_steps_late(self) -> float:
        """Mean steps a stream idled after its zone ended before its tool's answer was in:
        0 when tools are resolved after every step; (K - 1) / 2 on average with K steps per
        replay (a zone ending at step k of K waits K - 1 - k); more on CUDA, where the host
        learns late that a tool waits."""
        if self.answered == 0:
            return 0.0
        return (int(self.core.wait_steps.sum()) - self.answered) / self.answered

    @property
    def done(self) -> bool:
        """Every stream has left its last zone (or filled its length)."""
        flags = self.core.flags  # the compiled step's, for the state it left
        return flags[0] if flags is not None else bool(self.core.finished.all())

    @property
    def callbacks_ready(self) -> bool:
        """Some stream waits for a tool result."""
        flags = self.core.flags
        return flags[1] if flags is not None else bool(self.core.waiting.any())

    def resolve_callbacks(self) -> int:
        """Call every pending tool once for all its waiting streams; feed the results back."""
        got = self._resolve()
        if got is None:
            return 0
        rows, results = got
        self.core.feed_results(rows, results)
        return int(rows.numel())

    def _answers(self) -> Tensor | None:
        """The pending tools' answers as one host block (:meth:`Core.results_block`)."""
        got = self._resolve()
        return None if got is None else self.core.results_block(*got)

    def _resolve(self) -> tuple[Tensor, list[list[int]]] | None:
        """Call every pending tool once for all its waiting streams: their rows and results
        (encoded), or None when no stream waits."""
        core = self.core
        waiting = core.waiting.nonzero().flatten()
        if waiting.numel() == 0:
            return None
        tool_ids = core.tool[core.cb_zone[waiting]]
        rows_all: list[Tensor] = []
        encoded: list[list[int]] = []
        for tid in sorted(set(tool_ids.tolist())):
            rows = waiting[tool_ids == tid]
            call = self.ins.tool_calls[tid]
            fn = self._tool(tid)
            args = self._args(call, rows)
            try:
                results = list(fn(args))
            except Exception as e:
                raise WorkflowError(
                    f"tool `{call.func}` raised {type(e).__name__}: {e}",
                    where={"workflow": self.ins.workflow.name, "streams": len(args)},
                    span=call.span,
                    code="R153",
                ) from e
            if len(results) != len(args) or not all(isinstance(r, str) for r in results):
                raise WorkflowError(
                    f"tool `{call.func}` must return one string per stream "
                    f"({len(args)}), got {type(results).__name__} of {len(results)}",
                    where={"workflow": self.ins.workflow.name},
                    span=call.span,
                    code="R154",
                    hint="a tool takes a list of argument lists and returns a list of strings",
                )
            self.tool_calls += 1
            rows_all.append(rows)
            encoded.extend(self.tok.encode(r) for r in results)
        self.answered += len(encoded)
        return torch.cat(rows_all), encoded

    def _tool(self, tid: int) -> Tool:
        fn = self._tool_fns.get(tid)
        if fn is not None:
            return fn
        name = self.ins.tool_calls[tid].func
        if name not in self._tools:
            raise WorkflowError(
                f"tool `{name}` is not bound",
                where={"workflow": self.ins.workflow.name},
                span=self.ins.tool_calls[tid].span,
                code="R155",
                hint=f'pass tools={{"{name}": fn}} or bind it with --bind MODULE',
            )
        fn = self._tools[name]
        self._tool_fns[tid] = fn
        return fn

    def _args(self, call: Any, rows: Tensor) -> list[list[Any]]:
        """Each row's argument list for ``call``: a capture's text or a literal (the rows' spans
        and tokens read in one go, only the captures the call names decoded)."""
        core = self.core
        slots = {name: i for i, name in enumerate(self.ins.capture_names)}
        spans = core.cap_span[rows].tolist()
        tokens = core.tokens[rows].tolist()
        out: list[list[Any]] = []
        for span, row in zip(spans, tokens):
            args: list[Any] = []
            for a in call.args:
                if a.kind != ArgKind.NAME:
                    args.append(a.value)
                    continue
                slot = slots.get(str(a.value))
                s, e = span[slot] if slot is not None else (-1, -1)
                args.append(self.tok.decode(row[s:e]) if s >= 0 else "")
            out.append(args)
        return out

    # ---- extraction and debugging ---------------------------------------------------------------
    def captures(self, b: int) -> dict[str, str]:
        """Stream ``b``'s captured outputs so far (the last capture of each name)."""
        core = self.core
        spans = core.cap_span[b].tolist()
        row = core.tokens[b].tolist()
        out: dict[str, str] = {}
        for name, (s, e) in zip(self.ins.capture_names, spans):
            if s >= 0:
                out[name] = self.tok.decode(row[s:e])
        return out

    def extract(self) -> list[dict[str, str]]:
        """Per stream, its captured outputs as a dict (capture name → text)."""
        return [self.captures(b) for b in range(self.core.B)]

    def generative_sequence(self) -> list[str]:
        """Per stream, the text the model saw: prompts, its own tokens, tool results."""
        rows = self.core.tokens.tolist()
        return [self.tok.decode([t for t in r if t >= 0]) for r in rows]

    def decisions(self) -> list[list[str]]:
        """Per stream, the zones it entered in order (``<end>`` when it finished)."""
        names = [*self.ins.zone_names, "<end>"]
        out: list[list[str]] = [[names[0]] for _ in range(self.core.B)]
        if not self.core.visits:
            return out
        # each entry one transition (B,) or, from a CUDA-graph step, all its rounds (R, B)
        b = self.core.B
        pcs = torch.cat([v.reshape(-1, b) for v in self.core.visits]).T.tolist()  # (B, transitions)
        moved = torch.cat([m.reshape(-1, b) for m in self.core.visits_mask]).T.tolist()
        for b in range(self.core.B):
            out[b].extend(names[min(p, len(names) - 1)] for p, m in zip(pcs[b], moved[b]) if m)
        return out

    @property
    def raw_stream(self) -> Tensor:
        """(B, N) int64: the tokens of every stream, -1 past its end."""
        return self.core.tokens

    @property
    def status(self) -> dict[str, Tensor]:
        """Per token of the raw stream (B, N): zone, token_num in zone, trigger bits, kind, tags."""
        c = self.core
        return {
            "zone": c.st_zone,
            "token_num": c.st_num,
            "triggers": c.st_trig,
            "kind": c.st_kind,
            "tags": c.st_tags,
        }

    def stream_status(self) -> list[str]:
        """Per stream: ``done``, ``truncated``, ``waiting`` (a tool) or ``zone NAME``."""
        c = self.core
        names = self.ins.zone_names
        fin, trunc, wait = c.finished.tolist(), c.truncated.tolist(), c.waiting.tolist()
        out = []
        for b, pc in enumerate(c.pc.tolist()):
            if trunc[b]:
                out.append("truncated")
            elif fin[b]:
                out.append("done")
            elif wait[b]:
                out.append("waiting")
            else:
                out.append(f"zone {names[min(pc, len(names) - 1)]}")
        return out


def _fields(out: StepOut) -> tuple[Tensor, ...]:
    return (out.tokens, out.active, out.kind, out.tags, out.pc, out.token_num, out.triggers)
