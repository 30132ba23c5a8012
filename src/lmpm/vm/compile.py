"""Workflow IR → instruction tensors: every zone is one row of a set of parallel tensors.

The VM dereferences these rows with its batched program counter (``tensor[pc]``: advanced indexing
is pointer dereference). Text a zone teacher-forces lives in one ragged ``token_data`` tensor; a
zone points into it with ``prompt_start``/``prompt_end``. Exits (``until`` clauses) are a second
table, one row per exit, in source order (the first exit that fires wins)::

    zone z:  prompt_start[z] .. prompt_end[z]   teacher-forced tokens (token_data)
             has_input[z]                        the prompt includes a per-stream input (bound later)
             generate[z], max_tokens[z]          free generation and its bound
             allowed[z, :]                       tokens the model may write here (zone Set ∧ program)
             capture[z], tool[z], tags[z]        capture slot, tool id, tag bits (-1 / 0: none)
    exit e:  exit_zone[e], exit_pattern[e]       the zone it belongs to, the trigger it waits for
             exit_target[e], exit_limit[e]       jump address (-1: advance) and the jump bound
    trigger p: patterns[p, :], pattern_len[p]    byte patterns, right-aligned (matched on a ring)

>>> from lmpm.ir import compile_source
>>> src = '''value Txt : Token[Byte] shape Grid2D(2, 32)
... visible Txt[b, t] <- Txt[b, 0..t-1] when t > 0
... rule R:
...   on Txt[b, t]
...   read {context = Txt[b, 0..t-1]}
...   emit proposal Txt[b, t] := ByteLM(context)
... workflow W on Txt:
...   zone ask:
...     feed "Q: "
...     generate max 4
...     until "."
... '''
>>> ins = compile_workflow(compile_source(src).ir)
>>> ins.prompt_end.tolist(), ins.generate.tolist(), ins.patterns.tolist()
([3], [True], [[46]])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lmpm.errors import CheckError, Diagnostic
from lmpm.ir.check import set_members
from lmpm.ir.eval import bind_params, evaluate
from lmpm.ir.nodes import Call, DType, PredKind, Program, Rule, ShapeKind, Workflow

NO_LIMIT = 2**62  # "unbounded" max_tokens / jump limit (a stream is bounded by its length anyway)
MAX_TRIGGERS = 62  # trigger flags travel as one int64 bitmask per token in the status


class ByteTokenizer:
    """Token id = byte (Token[Byte], or Token[V] with V ≤ 256: the first V byte values)."""

    def __init__(self, vocab: int = 256) -> None:
        if not 1 <= vocab <= 256:
            raise ValueError(f"the byte tokenizer holds at most 256 tokens, got {vocab}")
        self.vocab = vocab
        self.token_bytes = [bytes([i]) for i in range(vocab)]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Instructions:
    """One workflow's zones as parallel tensors (see the module doc for every field)."""

    workflow: Workflow
    value: str
    streams: int  # B (the value's first axis; 1 for Seq)
    length: int  # N: tokens per stream
    vocab: int
    zone_names: tuple[str, ...]
    token_data: Tensor  # (D,) int64, static prompts back to back
    prompt_start: Tensor  # (Z,) int64
    prompt_end: Tensor  # (Z,) int64
    feeds: tuple[tuple[tuple[str | None, str | None], ...], ...]  # per zone: (text, input) parts
    has_input: Tensor  # (Z,) bool
    generate: Tensor  # (Z,) bool
    max_tokens: Tensor  # (Z,) int64
    allowed: Tensor  # (Z, V) bool
    value_allowed: Tensor  # (V,) bool: what the program's `in Set` constraints let a stream hold
    capture: Tensor  # (Z,) int64 capture slot, -1: none
    tool: Tensor  # (Z,) int64 tool id, -1: none
    tags: Tensor  # (Z,) int64 tag bits
    exit_zone: Tensor  # (E,) int64
    exit_pattern: Tensor  # (E,) int64
    exit_target: Tensor  # (E,) int64, -1: advance
    exit_limit: Tensor  # (E,) int64
    patterns: Tensor  # (P, R) int64 bytes right-aligned, -1 padding on the left
    pattern_len: Tensor  # (P,) int64 bytes
    pattern_text: tuple[str, ...]
    capture_names: tuple[str, ...]
    tool_calls: tuple[Call, ...]
    tag_names: tuple[str, ...]
    rule: Rule  # the rule whose model writes the streams
    constraints: tuple[tuple[str, str, frozenset[int]], ...]  # (name, kind, set) over the value
    env: dict[str, int] = field(default_factory=dict)

    @property
    def zones(self) -> int:
        return len(self.zone_names)

    @property
    def ring(self) -> int:
        """Bytes of history each stream keeps for trigger matching (the longest pattern)."""
        return int(self.patterns.shape[1])

    # seed-style per-zone views of the exit table (``lmpm show --vm`` prints them)
    def advance_mask(self) -> Tensor:
        """(Z, P) bool: trigger p advances zone z."""
        m = torch.zeros(self.zones, len(self.pattern_text), dtype=torch.bool)
        adv = self.exit_target < 0
        m[self.exit_zone[adv], self.exit_pattern[adv]] = True
        return m

    def jump_mask(self) -> Tensor:
        """(Z, P) bool: trigger p jumps from zone z (to ``jump_address[z, p]``)."""
        m = torch.zeros(self.zones, len(self.pattern_text), dtype=torch.bool)
        j = self.exit_target >= 0
        m[self.exit_zone[j], self.exit_pattern[j]] = True
        return m

    def jump_address(self) -> Tensor:
        """(Z, P) int64: the jump target of trigger p in zone z (-1: padding)."""
        a = torch.full((self.zones, len(self.pattern_text)), -1, dtype=torch.int64)
        j = self.exit_target >= 0
        a[self.exit_zone[j], self.exit_pattern[j]] = self.exit_target[j]
        return a


def _bad(code: str, message: str, w: Workflow, hint: str | None = None) -> CheckError:
    return CheckError([Diagnostic(code, "error", message, w.span, hint)])


def compile_workflow(
    program: Program,
    name: str | None = None,
    overrides: Mapping[str, int] | None = None,
    tokenizer: ByteTokenizer | None = None,
) -> Instructions:
    """Compile workflow ``name`` (the only one when None) of a checked program."""
    if not program.workflows:
        raise CheckError(
            [Diagnostic("E244", "error", "the program has no workflow", None, "add `workflow`")]
        )
    if name is None:
        w = program.workflows[0]
    else:
        found = [x for x in program.workflows if x.name == name]
        if not found:
            names = ", ".join(x.name for x in program.workflows)
            raise CheckError(
                [Diagnostic("E244", "error", f"no workflow `{name}` (have: {names})", None)]
            )
        w = found[0]
    env = bind_params(program, overrides)
    value = program.value(w.value)
    assert value.dtype == DType.TOKEN and value.vocab is not None
    vocab = evaluate(value.vocab, env)
    dims = [evaluate(d, env) for d in value.dims]
    streams, length = (1, dims[0]) if value.shape == ShapeKind.SEQ else (dims[0], dims[1])
    tok = tokenizer or ByteTokenizer(min(vocab, 256))
    rules = [r for r in program.rules if r.target == w.value]
    if not rules:
        raise _bad("E243", f"workflow `{w.name}` needs a model: no rule proposes `{w.value}`", w)

    # The program's `in Set(...)` constraints over the value (forbid removes, require keeps).
    value_allowed = torch.ones(vocab, dtype=torch.bool)
    constraints: list[tuple[str, str, frozenset[int]]] = []
    for c in program.constraints:
        if c.pred != PredKind.IN_SET or c.access is None or c.access.value != w.value:
            continue
        assert c.set is not None
        members = frozenset(m for m in set_members(c.set, env) if 0 <= m < vocab)
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[list(members)] = True
        value_allowed &= mask if c.kind == "require" else ~mask
        constraints.append((c.name, c.kind, members))

    zone_index = {z.name: i for i, z in enumerate(w.zones)}
    data: list[int] = []
    starts, ends, has_input, gen, maxes, caps, tools, tagbits = [], [], [], [], [], [], [], []
    allowed_rows: list[Tensor] = []
    feeds: list[tuple[tuple[str | None, str | None], ...]] = []
    patterns: dict[str, int] = {}
    ex_zone, ex_pat, ex_tgt, ex_lim = [], [], [], []
    cap_names: list[str] = []
    tool_calls: list[Call] = []
    tag_names: list[str] = []
    for zi, z in enumerate(w.zones):
        starts.append(len(data))
        for f in z.feeds:
            if f.text is not None:
                ids = tok.encode(f.text)
                if any(i >= vocab for i in ids):
                    raise _bad("E242", f"zone `{z.name}` feeds text outside the vocabulary", w)
                data.extend(ids)
        ends.append(len(data))
        feeds.append(tuple((f.text, f.input) for f in z.feeds))
        has_input.append(any(f.input is not None for f in z.feeds))
        gen.append(z.generate)
        maxes.append(evaluate(z.max_tokens, env) if z.max_tokens is not None else NO_LIMIT)
        row = value_allowed.clone()
        if z.allowed is not None:
            zmask = torch.zeros(vocab, dtype=torch.bool)
            zmask[[m for m in set_members(z.allowed, env) if 0 <= m < vocab]] = True
            row &= zmask
        if z.generate and not bool(row.any()):
            raise _bad(
                "E245",
                f"zone `{z.name}` may generate no token at all: its `in Set(...)` and the "
                "program's constraints exclude every token",
                w,
            )
        allowed_rows.append(row)
        if z.capture is not None:
            if z.capture not in cap_names:
                cap_names.append(z.capture)
            caps.append(cap_names.index(z.capture))
        else:
            caps.append(-1)
        if z.tool is not None:
            tools.append(len(tool_calls))
            tool_calls.append(z.tool)
        else:
            tools.append(-1)
        bits = 0
        for t in z.tags:
            if t not in tag_names:
                tag_names.append(t)
            bits |= 1 << tag_names.index(t)
        tagbits.append(bits)
        for x in z.exits:
            pid = patterns.setdefault(x.pattern, len(patterns))
            ex_zone.append(zi)
            ex_pat.append(pid)
            ex_tgt.append(zone_index[x.target] if x.target is not None else -1)
            ex_lim.append(evaluate(x.limit, env) if x.limit is not None else NO_LIMIT)
    if len(patterns) > MAX_TRIGGERS:
        raise _bad("E246", f"a workflow has at most {MAX_TRIGGERS} distinct trigger patterns", w)
    if len(tag_names) > MAX_TRIGGERS:
        raise _bad("E246", f"a workflow has at most {MAX_TRIGGERS} distinct tags", w)
    encoded = [p.encode("utf-8") for p in patterns]
    ring = max([len(b) for b in encoded] + [1])
    pat = torch.full((len(encoded), ring), -1, dtype=torch.int64)
    for i, b in enumerate(encoded):
        pat[i, ring - len(b) :] = torch.tensor(list(b), dtype=torch.int64)
    i64 = torch.int64
    return Instructions(
        workflow=w,
        value=w.value,
        streams=streams,
        length=length,
        vocab=vocab,
        zone_names=tuple(z.name for z in w.zones),
        token_data=torch.tensor(data, dtype=i64),
        prompt_start=torch.tensor(starts, dtype=i64),
        prompt_end=torch.tensor(ends, dtype=i64),
        feeds=tuple(feeds),
        has_input=torch.tensor(has_input, dtype=torch.bool),
        generate=torch.tensor(gen, dtype=torch.bool),
        max_tokens=torch.tensor(maxes, dtype=i64),
        allowed=torch.stack(allowed_rows)
        if allowed_rows
        else torch.ones(0, vocab, dtype=torch.bool),
        value_allowed=value_allowed,
        capture=torch.tensor(caps, dtype=i64),
        tool=torch.tensor(tools, dtype=i64),
        tags=torch.tensor(tagbits, dtype=i64),
        exit_zone=torch.tensor(ex_zone, dtype=i64),
        exit_pattern=torch.tensor(ex_pat, dtype=i64),
        exit_target=torch.tensor(ex_tgt, dtype=i64),
        exit_limit=torch.tensor(ex_lim, dtype=i64),
        patterns=pat,
        pattern_len=torch.tensor([len(b) for b in encoded], dtype=i64),
        pattern_text=tuple(patterns),
        capture_names=tuple(cap_names),
        tool_calls=tuple(tool_calls),
        tag_names=tuple(tag_names),
        rule=rules[0],
        constraints=tuple(constraints),
        env=env,
    )


def instructions_text(ins: Instructions) -> str:
    """The instruction tensors as a table (``lmpm show --vm``)."""

    def lim(n: int) -> str:
        return "-" if n >= NO_LIMIT else str(n)

    w = ins.workflow
    out = [
        f"workflow {w.name} on {ins.value}: {ins.zones} zones, {ins.streams} streams x "
        f"{ins.length} tokens, vocab {ins.vocab}, ring {ins.ring} bytes",
        "",
        "zone  name              start  end  input  gen  max   capture   tool  tags  allowed",
    ]
    for z in range(ins.zones):
        cap = int(ins.capture[z])
        tool = int(ins.tool[z])
        out.append(
            f"{z:<5} {ins.zone_names[z]:<17} {int(ins.prompt_start[z]):>5} "
            f"{int(ins.prompt_end[z]):>4}  {'yes' if ins.has_input[z] else 'no':<5}  "
            f"{'yes' if ins.generate[z] else 'no':<3}  {lim(int(ins.max_tokens[z])):<5} "
            f"{ins.capture_names[cap] if cap >= 0 else '-':<9} "
            f"{ins.tool_calls[tool].func if tool >= 0 else '-':<5} "
            f"{int(ins.tags[z]):<5} {int(ins.allowed[z].sum())}/{ins.vocab}"
        )
    out += ["", "exit  zone  trigger       target       limit"]
    for e in range(int(ins.exit_zone.numel())):
        tgt = int(ins.exit_target[e])
        out.append(
            f"{e:<5} {int(ins.exit_zone[e]):<5} "
            f"{int(ins.exit_pattern[e])}:{ins.pattern_text[int(ins.exit_pattern[e])]!r:<10} "
            f"{'advance' if tgt < 0 else f'jump {tgt}':<12} {lim(int(ins.exit_limit[e]))}"
        )
    out += [
        "",
        f"advance_mask (zone x trigger) = {ins.advance_mask().int().tolist()}",
        f"jump_mask    (zone x trigger) = {ins.jump_mask().int().tolist()}",
        f"jump_address (zone x trigger) = {ins.jump_address().tolist()}",
        f"patterns (right-aligned bytes) = {ins.patterns.tolist()}",
        f"token_data ({int(ins.token_data.numel())} tokens) = {ins.token_data.tolist()}",
    ]
    return "\n".join(out) + "\n"
