"""A plain per-stream interpreter of a compiled workflow: the specification the VM is tested
against, and the baseline ``benchmarks/vm.py`` times (the way Python-side controllers run a prompt
program: one state machine object per stream, stepped in a Python loop).

It reads the same :class:`~lmpm.vm.compile.Instructions` but keeps Python ints, lists and bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmpm.ir.nodes import ArgKind
from lmpm.vm.compile import ByteTokenizer, Instructions
from lmpm.vm.core import FORCED, GENERATED, TOOL


class Zone:
    """One zone as plain Python values."""

    def __init__(self, ins: Instructions, z: int) -> None:
        self.name = ins.zone_names[z]
        self.prompt = ins.token_data[int(ins.prompt_start[z]) : int(ins.prompt_end[z])].tolist()
        self.feeds = ins.feeds[z]
        self.generate = bool(ins.generate[z])
        self.max = int(ins.max_tokens[z])
        self.allowed = set(ins.allowed[z].nonzero().flatten().tolist())
        cap = int(ins.capture[z])
        self.capture = ins.capture_names[cap] if cap >= 0 else None
        tool = int(ins.tool[z])
        self.tool = ins.tool_calls[tool] if tool >= 0 else None
        self.tags = int(ins.tags[z])
        # (exit id, pattern bytes, target or None, limit), in source order
        self.exits = [
            (
                e,
                ins.pattern_text[int(ins.exit_pattern[e])].encode("utf-8"),
                int(ins.exit_target[e]) if int(ins.exit_target[e]) >= 0 else None,
                int(ins.exit_limit[e]),
            )
            for e in range(int(ins.exit_zone.numel()))
            if int(ins.exit_zone[e]) == z
        ]


class Stream:
    """One stream's state machine."""

    def __init__(
        self,
        zones: list[Zone],
        length: int,
        inputs: Mapping[str, str],
        tokenizer: ByteTokenizer,
        patterns: list[bytes],
    ) -> None:
        self.zones = zones
        self.patterns = patterns
        self.length = length
        self.tok = tokenizer
        self.prompts = []
        for z in zones:
            ids: list[int] = []
            for text, name in z.feeds:
                ids.extend(tokenizer.encode(text if text is not None else inputs[str(name)]))
            self.prompts.append(ids)
        self.pc = 0
        self.tok_num = 0
        self.gen_num = 0
        self.out = b""  # bytes generated in this zone
        self.cap_start = 0
        self.inj: list[int] = []
        self.inj_pos = 0
        self.jumps: dict[int, int] = {}
        self.waiting: Any = None  # the tool call pending
        self.truncated = False
        self.tokens: list[int] = []
        self.status: list[tuple[int, int, int, int, int]] = []  # zone, token_num, trig, kind, tags
        self.spans: dict[str, tuple[int, int]] = {}
        self.decisions = [zones[0].name] if zones else []
        self._settle()

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.zones) and self.waiting is None and self.inj_pos >= len(self.inj)

    def forced(self) -> tuple[int, int] | None:
        """(token, kind) when this step forces a token; None when the model must propose one
        (call :meth:`wants_model` first: finished and waiting streams commit nothing)."""
        if self.inj_pos < len(self.inj):
            return self.inj[self.inj_pos], TOOL
        if self.tok_num < len(self.prompts[self.pc]):
            return self.prompts[self.pc][self.tok_num], FORCED
        return None

    def active(self) -> bool:
        return not self.finished and self.waiting is None

    def commit(self, token: int, kind: int) -> None:
        z = self.zones[min(self.pc, len(self.zones) - 1)]
        pos = len(self.tokens)
        self.tokens.append(token)
        if kind == GENERATED and self.gen_num == 0:
            self.cap_start = pos
        num = self.tok_num
        if kind == TOOL:
            self.inj_pos += 1
        else:
            self.tok_num += 1
        trig = 0
        fired = None
        if kind == GENERATED:
            self.gen_num += 1
            self.out += self.tok.token_bytes[token]
            for p, pat in enumerate(self.patterns):
                if self.out.endswith(pat):
                    trig |= 1 << p
            for e, pat, target, limit in z.exits:
                if self.out.endswith(pat):
                    fired = (e, pat, target, limit)
                    break
        self.status.append((min(self.pc, len(self.zones) - 1), num, trig, kind, z.tags))
        if kind != TOOL and self.pc < len(self.zones):
            leave = False
            new_pc = self.pc + 1
            if fired is not None:
                e, pat, target, limit = fired
                leave = True
                if target is not None and self.jumps.get(e, 0) < limit:
                    self.jumps[e] = self.jumps.get(e, 0) + 1
                    new_pc = target
            if kind == GENERATED and self.gen_num >= z.max:
                leave = True
            if not z.generate and self.tok_num >= len(self.prompts[self.pc]):
                leave = True
            if leave:
                self._leave(new_pc)
        if not self.finished and len(self.tokens) >= self.length:
            self.truncated = True
            self.pc = len(self.zones)
            self.waiting = None
            self.inj, self.inj_pos = [], 0
        self._settle()

    def _leave(self, new_pc: int) -> None:
        z = self.zones[self.pc]
        if z.capture is not None:
            self.spans[z.capture] = (self.cap_start, len(self.tokens))
        if z.tool is not None:
            self.waiting = z.tool
        self.pc = new_pc
        self.tok_num = self.gen_num = 0
        self.out = b""
        self.cap_start = len(self.tokens)
        self.decisions.append(self.zones[new_pc].name if new_pc < len(self.zones) else "<end>")

    def _settle(self) -> None:
        while (
            self.pc < len(self.zones)
            and not self.zones[self.pc].generate
            and not self.prompts[self.pc]
            and self.tok_num == 0
            and self.waiting is None
            and self.inj_pos >= len(self.inj)
        ):
            self._leave(self.pc + 1)

    def captures(self) -> dict[str, str]:
        out = {}
        for name, (s, e) in self.spans.items():
            out[name] = self.tok.decode(self.tokens[s:e])
        return out

    def tool_args(self, call: Any) -> list[Any]:
        caps = self.captures()
        return [
            caps.get(str(a.value), "") if a.kind == ArgKind.NAME else a.value for a in call.args
        ]

    def feed(self, result: str) -> None:
        self.inj = self.tok.encode(result)
        self.inj_pos = 0
        self.waiting = None
        self._settle()


class Reference:
    """B independent :class:`Stream` objects stepped in a Python loop."""

    def __init__(
        self,
        ins: Instructions,
        *,
        streams: int | None = None,
        inputs: Mapping[str, Sequence[str] | str] | None = None,
        tools: Mapping[str, Callable[[list[Any]], Sequence[str]]] | None = None,
        tokenizer: ByteTokenizer | None = None,
    ) -> None:
        self.ins = ins
        self.tok = tokenizer or ByteTokenizer(min(ins.vocab, 256))
        b = ins.streams if streams is None else streams
        zones = [Zone(ins, z) for z in range(ins.zones)]
        patterns = [p.encode("utf-8") for p in ins.pattern_text]
        self.tools = dict(tools or {})
        given = dict(inputs or {})
        self.streams = []
        for k in range(b):
            mine = {}
            for name, v in given.items():
                mine[name] = v if isinstance(v, str) else (v[0] if len(v) == 1 else v[k])
            self.streams.append(Stream(zones, ins.length, mine, self.tok, patterns))

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.streams)

    def resolve_callbacks(self) -> None:
        for s in self.streams:
            if s.waiting is not None:
                fn = self.tools[s.waiting.func]
                s.feed(next(iter(fn([s.tool_args(s.waiting)]))))

    def step(self, sample: Callable[[int, int, set[int]], int]) -> None:
        """One step: ``sample(stream, position, allowed)`` proposes a token where none is forced."""
        self.resolve_callbacks()
        for k, s in enumerate(self.streams):
            if not s.active():
                continue
            f = s.forced()
            if f is None:
                s.commit(sample(k, len(s.tokens), s.zones[s.pc].allowed), GENERATED)
            else:
                s.commit(f[0], f[1])
