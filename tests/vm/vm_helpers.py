"""Shared helpers for the VM tests: programs from zone text, samplers, a byte-pair tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from lmpm.ir import compile_source
from lmpm.vm import VM, ByteTokenizer, Instructions, Sampler, compile_workflow
from lmpm.vm.reference import Reference
from lmpm.workers import rng


def program(zones: str, streams: int = 3, length: int = 48, extra: str = "") -> str:
    return (
        f"value Txt : Token[Byte] shape Grid2D({streams}, {length}) clock Lamport\n"
        "visible Txt[b, t] <- Txt[b, 0..t-1] when t > 0\n"
        "rule Write:\n"
        "  on Txt[b, t]\n"
        "  read {context = Txt[b, 0..t-1]}\n"
        "  emit proposal Txt[b, t] := ByteLM(context)\n"
        f"{extra}"
        "workflow W on Txt:\n" + zones
    )


def instructions(zones: str, streams: int = 3, length: int = 48, **kw: Any) -> Instructions:
    return compile_workflow(compile_source(program(zones, streams, length)).ir, **kw)


def random_tokens(ins: Instructions, stream: Tensor, pos: Tensor, pc: Tensor, seed: int) -> Tensor:
    """Counter-based samples under each stream's allowed set (identical for any batching)."""
    ok = ins.allowed.to(pc.device)[pc.clamp(max=ins.zones - 1)]
    logits = torch.zeros(ok.shape, dtype=torch.float64, device=ok.device).masked_fill(
        ~ok, float("-inf")
    )
    return rng.categorical(logits, seed=seed, value="Txt", cells=stream, epoch=pos, rule="test")


def run_vm(vm: VM, seed: int = 0, offset: int = 0, max_steps: int = 500) -> int:
    steps = 0
    core = vm.core
    while not vm.done and steps < max_steps:
        if vm.callbacks_ready:
            vm.resolve_callbacks()
        f = vm.forced()
        sampled = random_tokens(vm.ins, core.ar + offset, core.pos, core.pc, seed)
        vm.step(sampled, f)
        steps += 1
    return steps


def rng_sampler(ins: Instructions, seed: int, device: str = "cpu") -> Sampler:
    """:func:`random_tokens` as a device sampler (``VM.advance``): the same tokens."""

    def sample(core: Any, forced: Any, allowed: Tensor) -> Tensor:
        ok = allowed[core.pc.clamp(max=ins.zones - 1)]
        logits = torch.zeros(ok.shape, dtype=torch.float64, device=ok.device).masked_fill(
            ~ok, float("-inf")
        )
        return rng.categorical(
            logits, seed=seed, value="Txt", cells=core.ar, epoch=core.pos, rule="test"
        )

    return Sampler(sample, (ins.allowed.to(device),))


def table_sampler(table: Tensor) -> Sampler:
    """Stream b's token at position p is ``table[b, p]`` (cheap to compile)."""
    return Sampler(_from_table, (table,))


def _from_table(core: Any, forced: Any, table: Tensor) -> Tensor:
    return table[core.ar, core.pos.clamp(max=table.shape[1] - 1)]


def run_advance(vm: VM, sampler: Sampler, max_steps: int = 500) -> int:
    """Drive ``vm`` K steps at a time (``VM.advance``); returns the replays."""
    replays = 0
    while not vm.done and vm.steps < max_steps:
        vm.advance(sampler)
        replays += 1
    return replays


def run_reference(ref: Reference, seed: int = 0, offset: int = 0, max_steps: int = 500) -> None:
    def sample(k: int, pos: int, _allowed: set[int]) -> int:
        s = ref.streams[k]
        tok = random_tokens(
            ref.ins, torch.tensor([k + offset]), torch.tensor([pos]), torch.tensor([s.pc]), seed
        )
        return int(tok[0])

    steps = 0
    while not ref.done and steps < max_steps:
        ref.step(sample)
        steps += 1


def scripted(vm: VM, scripts: list[list[int]], max_steps: int = 500) -> list[int]:
    """Drive ``vm`` with per-stream scripts of generated tokens; returns how often the model was
    asked for each stream."""
    asked = [0] * vm.core.B
    steps = 0
    while not vm.done and steps < max_steps:
        if vm.callbacks_ready:
            vm.resolve_callbacks()
        f = vm.forced()
        sampled = torch.zeros(vm.core.B, dtype=torch.int64)
        for b in f.ask.nonzero().flatten().tolist():
            sampled[b] = scripts[b][asked[b]]
            asked[b] += 1
        vm.step(sampled, f)
        steps += 1
    return asked


def text(s: str) -> list[int]:
    return list(s.encode())


class PairTokenizer(ByteTokenizer):
    """256 tokens: bytes, except ids 1..4 which are multi-byte tokens (triggers span them)."""

    PAIRS: ClassVar[dict[int, bytes]] = {1: b"xy", 2: b"yz", 3: b"zq", 4: b"xyzq"}

    def __init__(self) -> None:
        super().__init__(256)
        for k, v in self.PAIRS.items():
            self.token_bytes[k] = v

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes[i] for i in ids if 0 <= i < 256).decode(
            "utf-8", errors="replace"
        )


Tool = Callable[[list[list[Any]]], list[str]]
