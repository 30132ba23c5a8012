"""The token-stream VM against a per-stream Python state machine doing the same workflow.

The workflow is ``examples/vm.lmpm`` (5 zones: forced prompts, generation with triggers, a bounded
loop, captures, a tool whose result is fed back). Both sides get the same "sampled" tokens, drawn
once from a small alphabet so that triggers fire, loops loop and streams end at different steps:

- ``vm``: :class:`lmpm.vm.VM` — one ``forced()`` + ``step()`` per step for all streams (tensor ops),
  tools resolved for all ready streams at once; eager, and compiled (``VM(compile=True)``: the
  step as one inductor graph, built before the timed runs);
- ``baseline``: :class:`lmpm.vm.reference.Reference` — one Python state-machine object per stream,
  stepped in a Python loop (the way Python-side controllers, guidance- or LMQL-style, run a prompt
  program), tools called per stream.

Prints one JSON line per batch size: ``streams``, ``steps``, ``vm_s``, ``compiled_s`` and
``baseline_s`` (seconds per step, whole run / steps, the minimum of ``--repeat`` interleaved runs),
``ratio`` (baseline / the faster VM: compiled unless ``--no-compile``), ``ratio_eager`` and
``compile_s`` (building the graphs, once per size). Every side's whole run is divided by the
workflow's steps (the eager VM's): on CUDA the graphed step learns late that every stream is done
and may run a few steps that commit nothing (``compiled_late_steps``), which its time includes.
A ``vm_step_tool_free`` line (sizes >= 1024) times the same workflow without its tool call: every
step is the VM's own work. Tool calls are user code and cost the same on
both sides: the seconds inside the user's tool are measured on both (``vm_tool_s``,
``compiled_tool_s``, ``baseline_tool_s`` per step) and ``ratio_without_tools`` /
``ratio_eager_without_tools`` take them out. ``device`` names where the VM's streams live:

- ``--device cpu`` (default): as above;
- ``--device cuda``: the streams and the step on the GPU (timed to the device's end of work); the
  compiled step is one CUDA graph per size (``VM(compile=True, device="cuda")``); ``vm_cpu_s``: the same eager step on the host, in the
  same run. The per-stream baseline runs on the host either way (up to ``--baseline-max`` streams);
  the byte-model run (below) is a CPU claim and is skipped.

``vm_steps_per_replay`` (sizes in ``--k-sizes``, default 1024; with and without the tool): the
same workflow driven K steps at a time (``VM(steps_per_replay=K).advance(sampler)``, K in
``--steps-per-replay``, default 1,2,4,8,16), the benchmark's sampler (the token table, read at each
stream's position) inside the compiled step, so that the host touches nothing between the K steps
(on CUDA: one CUDA-graph replay per K steps). Per K: ``step_s`` (whole run / the workflow's steps,
device work included), ``host_s`` (the seconds the host spent in ``advance()`` and polling
``vm.done``, per step: on CUDA the launches and copies, not the GPU's work), ``steps_run`` (K
rounds up the run, idle steps included), ``ratio_vs_k1`` (K = 1's step_s over this K's, the same
driver), ``ratio`` (the per-stream loop over step_s, tools taken out of both sides for
``ratio_without_tools``) and ``tool_steps_late`` (mean steps a stream waits for a tool's answer
beyond the step its zone ended: answers arrive between replays).

Then (CPU):

- ``model_share`` (B = 256, ``--model-streams``): the whole example on the embedded byte model
  (``WorkflowRun``, compiled after a compiling run unless ``--no-compile``; the eager share beside
  it): the VM's share of a step next to ByteLM's (goal ≤ 5 %), and the model calls
  saved by forced spans (tokens committed without a proposal; forward passes skipped because every
  stream was forced) against sampling every token;
- ``scaling``: VM step time at B = 4096 over B = 64 (it should grow far slower than 64x).

    python benchmarks/vm.py [--sizes 1,64,256,1024,4096] [--repeat 3] [--model-streams 256]
                            [--no-compile] [--device cpu|cuda] [--baseline-max 16384]
                            [--steps-per-replay 1,2,4,8,16] [--k-sizes 1024] [--k-only]
    python benchmarks/vm.py --device cuda --k-only --k-sizes 1024,16384 --baseline-max 1024
    python benchmarks/vm.py --device cuda --sizes 1024,4096,16384 --repeat 2   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "vm.lmpm"
TOOL_LINE = "    call Count(sky)\n"  # removed for the tool-free case

from lmpm.errors import UsageError  # noqa: E402
from lmpm.ir import compile_file, compile_source  # noqa: E402
from lmpm.vm import VM, Sampler, WorkflowRun, compile_workflow  # noqa: E402
from lmpm.vm.reference import Reference  # noqa: E402

ALPHABET = b"leftrighupdownblue sky red square  "


def count(calls: list[list[Any]]) -> list[str]:
    return [f" ({len(str(a[0]).split())} words)" for a in calls]


def tokens_table(streams: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    alphabet = torch.tensor(list(ALPHABET))
    return alphabet[torch.randint(len(ALPHABET), (streams, length), generator=g)]


class ToolClock:
    """A user tool wrapped to add up the seconds spent inside it: the same tool, timed the same
    way, on both sides (tool calls are user code and cost the same with or without the VM)."""

    def __init__(self, fn: Callable[[list[list[Any]]], list[str]]) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, calls: list[list[Any]]) -> list[str]:
        t0 = time.perf_counter()
        try:
            return self.fn(calls)
        finally:
            self.seconds += time.perf_counter() - t0


class Timed(NamedTuple):
    """One whole run of the workflow."""

    seconds: float  # wall time of the run, device work included
    steps: int
    tool_seconds: float  # of ``seconds``, inside the user's tool


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _instructions(streams: int, tools: bool = True) -> Any:
    """The example's workflow over ``streams`` streams; ``tools=False``: without its tool call
    (the tool-free case: every step is the VM's own work)."""
    if tools:
        return compile_workflow(compile_file(PROGRAM).ir, overrides={"B": streams})
    text = PROGRAM.read_text()
    assert TOOL_LINE in text, "examples/vm.lmpm changed: update TOOL_LINE"
    front = compile_source(text.replace(TOOL_LINE, ""), str(PROGRAM))
    return compile_workflow(front.ir, overrides={"B": streams})


def time_vm(
    streams: int,
    table: torch.Tensor,
    compile: bool = False,
    device: str = "cpu",
    tools: bool = True,
) -> Timed:
    ins = _instructions(streams, tools)
    tool = ToolClock(count)
    vm = VM(ins, tools={"Count": tool}, compile=compile, device=device)
    core = vm.core
    table = table.to(core.device)
    steps = 0
    sync(device)
    t0 = time.perf_counter()
    while not vm.done:
        if vm.callbacks_ready:
            vm.resolve_callbacks()
        f = vm.forced()
        sampled = table[core.ar, core.pos.clamp(max=core.N - 1)]
        vm.step(sampled, f)
        steps += 1
    sync(device)
    return Timed(time.perf_counter() - t0, steps, tool.seconds)


def from_table(core: Any, forced: Any, table: torch.Tensor) -> torch.Tensor:
    """The benchmark's sampler on the device: stream b's token at position p is table[b, p]."""
    return table[core.ar, core.pos.clamp(max=core.N - 1)]


class Advanced(NamedTuple):
    """One whole run driven K steps at a time."""

    seconds: float  # wall time, device work included
    host_seconds: float  # in advance() and the vm.done polls
    steps: int  # steps run (K per replay)
    tool_seconds: float
    tool_steps_late: float


def time_advance(
    streams: int, table: torch.Tensor, k: int, compile: bool, device: str, tools: bool
) -> Advanced:
    ins = _instructions(streams, tools)
    tool = ToolClock(count)
    vm = VM(ins, tools={"Count": tool}, compile=compile, device=device, steps_per_replay=k)
    sampler = Sampler(from_table, (table.to(vm.core.device),))
    host = 0.0
    sync(device)
    t0 = time.perf_counter()
    while True:
        h0 = time.perf_counter()
        if vm.done:
            host += time.perf_counter() - h0
            break
        vm.advance(sampler)
        host += time.perf_counter() - h0
    sync(device)
    wall = time.perf_counter() - t0
    return Advanced(wall, host - tool.seconds, vm.steps, tool.seconds, vm.tool_steps_late)


def time_steps_per_replay(
    b: int, length: int, args: argparse.Namespace, compile: bool, tools: bool
) -> list[dict[str, Any]]:
    """The ``vm_steps_per_replay`` lines of one batch size: one per K, interleaved runs."""
    table = tokens_table(b, length)
    ks = [int(k) for k in args.steps_per_replay.split(",")]
    for k in ks:  # builds (compiled: the step with the sampler inside) and captures each K
        time_advance(b, table, k, compile, args.device, tools)
    baseline = b <= args.baseline_max
    runs: dict[int, list[Advanced]] = {k: [] for k in ks}
    base_t: list[Timed] = []
    for _ in range(args.repeat):
        for k in ks:
            runs[k].append(time_advance(b, table, k, compile, args.device, tools))
        if baseline:
            base_t.append(time_baseline(b, table, tools))
    steps = time_vm(b, table, device="cpu", tools=tools).steps  # the workflow's steps
    base = best(base_t) if baseline else None
    first = min(runs[ks[0]], key=lambda r: r.seconds)
    lines = []
    for k in ks:
        run = min(runs[k], key=lambda r: r.seconds)
        step_s = run.seconds / steps
        free_s = (run.seconds - run.tool_seconds) / steps
        lines.append(
            {
                "benchmark": "vm",
                "case": "vm_steps_per_replay" if tools else "vm_steps_per_replay_tool_free",
                "bench": "vm_steps_per_replay",
                "device": device_name(args.device),
                "streams": b,
                "k": k,
                "compiled": compile,
                "steps": steps,
                "steps_run": run.steps,
                "step_s": round(step_s, 7),
                "host_s": round(run.host_seconds / steps, 7),
                "tool_s": round(run.tool_seconds / steps, 7),
                f"ratio_vs_k{ks[0]}": round(first.seconds / run.seconds, 2),
                "ratio": round(base.seconds / steps / step_s, 2) if base else None,
                "ratio_without_tools": (
                    round((base.seconds - base.tool_seconds) / steps / free_s, 2) if base else None
                ),
                "tool_steps_late": round(run.tool_steps_late, 2),
            }
        )
    return lines


def time_baseline(streams: int, table: torch.Tensor, tools: bool = True) -> Timed:
    ins = _instructions(streams, tools)
    tool = ToolClock(count)
    ref = Reference(ins, tools={"Count": tool})
    rows = table.tolist()
    n = ins.length

    def sample(k: int, pos: int, _allowed: set[int]) -> int:
        return rows[k][min(pos, n - 1)]

    steps = 0
    t0 = time.perf_counter()
    while not ref.done:
        ref.step(sample)
        steps += 1
    return Timed(time.perf_counter() - t0, steps, tool.seconds)


def compiled_refusal(device: str) -> str | None:
    """Why ``VM(compile=True)`` refuses ``device`` (U104 off the cpu and cuda), or None."""
    ins = compile_workflow(compile_file(PROGRAM).ir, overrides={"B": 1})
    try:
        VM(ins, tools={"Count": count}, compile=True, device=device)
    except UsageError as e:
        return f"{e.code}: {e.message}"
    return None


def best(runs: list[Timed]) -> Timed:
    return min(runs, key=lambda r: r.seconds)


def _workflow_run(streams: int, compile: bool) -> tuple[WorkflowRun, VM, float]:
    from lmpm.bindings import Bindings

    run = WorkflowRun(
        compile_file(PROGRAM, overrides={"B": streams}).ir,
        overrides={"B": streams},
        bindings=Bindings(mapping={"Count": count}),
        seed=0,
        compile=compile,
    )
    t0 = time.perf_counter()
    vm = run.run()
    return run, vm, time.perf_counter() - t0


def _share_of(run: WorkflowRun) -> float:
    st = run.stats
    return st.vm_seconds / (st.vm_seconds + st.model_seconds + st.tool_seconds)


def model_share(streams: int, compile: bool) -> dict[str, Any]:
    eager, vm_e, _ = _workflow_run(streams, False)
    if compile:
        first, _, _ = _workflow_run(streams, True)  # builds the graphs (timed below: none)
        run, vm, wall = _workflow_run(streams, True)
        assert vm.generative_sequence() == vm_e.generative_sequence()
        built = first.stats.compile_seconds
    else:
        run, vm, wall, built = eager, vm_e, 0.0, 0.0
    st = run.stats
    return {
        "benchmark": "vm",
        "case": "model_share",
        "bench": "model_share",
        "streams": streams,
        "done": vm.done,
        "steps": st.steps,
        "wall_s": round(wall, 3),
        "vm_s": round(st.vm_seconds, 4),
        "model_s": round(st.model_seconds, 3),
        "tool_s": round(st.tool_seconds, 4),
        "vm_share": round(_share_of(run), 4),
        "vm_share_eager": round(_share_of(eager), 4),
        "compiled": compile,
        "compile_s": round(built, 2),
        "goal_vm_share": 0.05,
        "tokens_committed": st.committed,
        "tokens_forced": st.forced,
        "token_proposals_saved": round(st.forced / max(st.committed, 1), 4),
        "model_calls": st.model_calls,
        "model_calls_sampling_every_token": st.steps,
        "model_calls_saved": st.steps_all_forced,
    }


def time_size(
    b: int, length: int, args: argparse.Namespace, compile: bool, tools: bool = True
) -> dict[str, Any]:
    """The ``vm_step`` line of one batch size: eager, compiled, baseline, interleaved runs
    (``tools=False``: the ``vm_step_tool_free`` line, the workflow without its tool call)."""
    table = tokens_table(b, length)
    built = 0.0
    if compile:  # build the graphs of this size first (a run's first steps compile)
        t0 = time.perf_counter()
        time_vm(b, table, compile=True, device=args.device, tools=tools)
        built = time.perf_counter() - t0
    else:
        time_vm(b, table, device=args.device, tools=tools)  # warm-up: allocator, kernels
    baseline = b <= args.baseline_max
    vm_t: list[Timed] = []
    comp_t: list[Timed] = []
    base_t: list[Timed] = []
    host_t: list[Timed] = []  # the eager VM on the host too, when the streams live elsewhere
    for _ in range(args.repeat):  # interleaved, the minimum kept
        vm_t.append(time_vm(b, table, device=args.device, tools=tools))
        if args.device != "cpu":
            host_t.append(time_vm(b, table, tools=tools))
        if compile:
            comp_t.append(time_vm(b, table, compile=True, device=args.device, tools=tools))
            # a CUDA-graph step tells the host late that every stream is done: it may run a
            # few steps that commit nothing (timed, and counted in compiled_steps_run)
            assert comp_t[-1].steps >= vm_t[-1].steps, (comp_t[-1].steps, vm_t[-1].steps)
        if baseline:
            base_t.append(time_baseline(b, table, tools))
            assert base_t[-1].steps == vm_t[-1].steps, (base_t[-1].steps, vm_t[-1].steps)
    eager = best(vm_t)
    fast = best(comp_t) if compile else eager
    base = best(base_t) if baseline else None
    steps = eager.steps  # the workflow's steps: every side's run time is divided by these
    late = fast.steps - steps

    def per_step(run: Timed) -> float:
        return run.seconds / steps

    def tool_free(run: Timed) -> float:
        return (run.seconds - run.tool_seconds) / steps

    def ratio(num: float | None, den: float) -> float | None:
        return None if num is None else round(num / den, 2)

    return {
        "benchmark": "vm",
        "case": "vm_step" if tools else "vm_step_tool_free",
        "bench": "vm_step" if tools else "vm_step_tool_free",
        "device": device_name(args.device),
        "streams": b,
        "steps": eager.steps,
        "vm_s": round(per_step(eager), 6),
        "compiled_s": round(per_step(fast), 6) if compile else None,
        "baseline_s": round(per_step(base), 6) if base else None,
        "ratio": ratio(per_step(base) if base else None, per_step(fast)),
        "ratio_eager": ratio(per_step(base) if base else None, per_step(eager)),
        # the same, the seconds spent inside the user's tool taken out of both sides
        "vm_tool_s": round(eager.tool_seconds / steps, 6),
        "compiled_tool_s": round(fast.tool_seconds / steps, 6) if compile else None,
        "baseline_tool_s": round(base.tool_seconds / steps, 6) if base else None,
        "compiled_steps_run": fast.steps if compile else None,  # late steps included
        "compiled_late_steps": late if compile else None,
        "ratio_without_tools": ratio(tool_free(base) if base else None, tool_free(fast)),
        "ratio_eager_without_tools": ratio(tool_free(base) if base else None, tool_free(eager)),
        "compile_s": round(built, 2),
        "goal_ratio_at_1024": 100,
        **({"vm_cpu_s": round(per_step(best(host_t)), 6)} if host_t else {}),
    }


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,64,256,1024,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model-streams", type=int, default=256, help="0: skip the model run")
    ap.add_argument("--quick", action="store_true", help="sizes 64,1024,4096, one repeat")
    ap.add_argument(
        "--steps-per-replay",
        default="1,2,4,8,16",
        help="the K of the vm_steps_per_replay lines ('': none)",
    )
    ap.add_argument("--k-sizes", default="1024", help="batch sizes of the K lines ('': none)")
    ap.add_argument(
        "--k-only", action="store_true", help="only the vm_steps_per_replay lines (no vm_step)"
    )
    ap.add_argument("--no-compile", action="store_true", help="time the eager VM only")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the VM's streams live (the per-stream baseline runs on the host)",
    )
    ap.add_argument(
        "--baseline-max",
        type=int,
        default=16384,
        help="largest batch size timed with the per-stream Python loop (above: null)",
    )
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.repeat = "64,1024,4096", 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "vm", "case": "vm_step", "skipped": "no CUDA device"}))
        return 0
    torch.set_grad_enabled(False)
    sizes = [int(s) for s in args.sizes.split(",")]
    length = compile_workflow(compile_file(PROGRAM).ir).length
    steps_s: dict[int, float] = {}
    # The VM's ops are small; on a shared CPU, intra-op threads spin and wait on each other (at
    # B=4096 one thread is ~50x faster than two under load). The baseline is one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # The CPU and CUDA have the compiled step; elsewhere ask the VM (U104).
    refused = (
        compiled_refusal(args.device) if args.device != "cpu" and not args.no_compile else None
    )
    compile = not args.no_compile and refused is None
    for b in [] if args.k_only else sizes:
        line = time_size(b, length, args, compile)
        if refused:
            line["compiled_note"] = f"compiled step not timed on {args.device}: {refused}"
        steps_s[b] = line["compiled_s"] if compile else line["vm_s"]
        print(json.dumps(line), flush=True)
    for b in [] if args.k_only else sizes:  # every step the VM's own work: no tool to wait on
        if b >= 1024 or len(sizes) == 1:
            line = time_size(b, length, args, compile, tools=False)
            print(json.dumps(line), flush=True)
    k_sizes = [int(s) for s in args.k_sizes.split(",") if s] if args.steps_per_replay else []
    for b in k_sizes:
        for tools in (False, True):
            for line in time_steps_per_replay(b, length, args, compile, tools):
                print(json.dumps(line), flush=True)
    torch.set_num_threads(threads)
    if (
        args.model_streams and args.device == "cpu" and not args.k_only
    ):  # the byte model's run is a CPU claim
        print(json.dumps(model_share(args.model_streams, compile)), flush=True)
    if 64 in steps_s and 4096 in steps_s:
        print(
            json.dumps(
                {
                    "benchmark": "vm",
                    "case": "scaling",
                    "bench": "scaling",
                    "device": device_name(args.device),
                    "streams": [64, 4096],
                    "vm_s": [round(steps_s[64], 6), round(steps_s[4096], 6)],
                    "growth": round(steps_s[4096] / steps_s[64], 2),
                    "streams_growth": 64,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
