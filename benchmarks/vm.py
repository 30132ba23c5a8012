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
``compile_s`` (building the graphs, once per size). Then:

- ``model_share`` (B = 256, ``--model-streams``): the whole example on the embedded byte model
  (``WorkflowRun``, compiled after a compiling run unless ``--no-compile``; the eager share beside
  it): the VM's share of a step next to ByteLM's (goal ≤ 5 %), and the model calls
  saved by forced spans (tokens committed without a proposal; forward passes skipped because every
  stream was forced) against sampling every token;
- ``scaling``: VM step time at B = 4096 over B = 64 (it should grow far slower than 64x).

    python benchmarks/vm.py [--sizes 1,64,256,1024,4096] [--repeat 3] [--model-streams 256]
                            [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "vm.lmpm"

from lmpm.ir import compile_file  # noqa: E402
from lmpm.vm import VM, WorkflowRun, compile_workflow  # noqa: E402
from lmpm.vm.reference import Reference  # noqa: E402

ALPHABET = b"leftrighupdownblue sky red square  "


def count(calls: list[list[Any]]) -> list[str]:
    return [f" ({len(str(a[0]).split())} words)" for a in calls]


def tokens_table(streams: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    alphabet = torch.tensor(list(ALPHABET))
    return alphabet[torch.randint(len(ALPHABET), (streams, length), generator=g)]


def time_vm(streams: int, table: torch.Tensor, compile: bool = False) -> tuple[float, int]:
    ins = compile_workflow(compile_file(PROGRAM).ir, overrides={"B": streams})
    vm = VM(ins, tools={"Count": count}, compile=compile)
    core = vm.core
    steps = 0
    t0 = time.perf_counter()
    while not vm.done:
        if vm.callbacks_ready:
            vm.resolve_callbacks()
        f = vm.forced()
        sampled = table[core.ar, core.pos.clamp(max=core.N - 1)]
        vm.step(sampled, f)
        steps += 1
    return time.perf_counter() - t0, steps


def time_baseline(streams: int, table: torch.Tensor) -> tuple[float, int]:
    ins = compile_workflow(compile_file(PROGRAM).ir, overrides={"B": streams})
    ref = Reference(ins, tools={"Count": count})
    rows = table.tolist()
    n = ins.length

    def sample(k: int, pos: int, _allowed: set[int]) -> int:
        return rows[k][min(pos, n - 1)]

    steps = 0
    t0 = time.perf_counter()
    while not ref.done:
        ref.step(sample)
        steps += 1
    return time.perf_counter() - t0, steps


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,64,256,1024,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model-streams", type=int, default=256, help="0: skip the model run")
    ap.add_argument("--quick", action="store_true", help="sizes 64,1024,4096, one repeat")
    ap.add_argument("--no-compile", action="store_true", help="time the eager VM only")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.repeat = "64,1024,4096", 1
    torch.set_grad_enabled(False)
    sizes = [int(s) for s in args.sizes.split(",")]
    length = compile_workflow(compile_file(PROGRAM).ir).length
    per_step: dict[int, float] = {}
    # The VM's ops are small; on a shared CPU, intra-op threads spin and wait on each other (at
    # B=4096 one thread is ~50x faster than two under load). The baseline is one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    compile = not args.no_compile
    for b in sizes:
        table = tokens_table(b, length)
        built = 0.0
        if compile:  # build the graphs of this size first (a run's first steps compile)
            t0 = time.perf_counter()
            time_vm(b, table, compile=True)
            built = time.perf_counter() - t0
        vm_t, comp_t, base_t = [], [], []
        for _ in range(args.repeat):  # interleaved, the minimum kept
            t, vsteps = time_vm(b, table)
            vm_t.append(t / vsteps)
            if compile:
                t, csteps = time_vm(b, table, compile=True)
                comp_t.append(t / csteps)
                assert csteps == vsteps, (csteps, vsteps)
            t, bsteps = time_baseline(b, table)
            base_t.append(t / bsteps)
        assert vsteps == bsteps, (vsteps, bsteps)
        best = min(comp_t) if compile else min(vm_t)
        per_step[b] = best
        line = {
            "benchmark": "vm",
            "case": "vm_step",
            "bench": "vm_step",
            "streams": b,
            "steps": vsteps,
            "vm_s": round(min(vm_t), 6),
            "compiled_s": round(min(comp_t), 6) if compile else None,
            "baseline_s": round(min(base_t), 6),
            "ratio": round(min(base_t) / best, 2),
            "ratio_eager": round(min(base_t) / min(vm_t), 2),
            "compile_s": round(built, 2),
            "goal_ratio_at_1024": 100,
        }
        print(json.dumps(line), flush=True)
    torch.set_num_threads(threads)
    if args.model_streams:
        print(json.dumps(model_share(args.model_streams, compile)), flush=True)
    if 64 in per_step and 4096 in per_step:
        print(
            json.dumps(
                {
                    "benchmark": "vm",
                    "case": "scaling",
                    "bench": "scaling",
                    "streams": [64, 4096],
                    "vm_s": [round(per_step[64], 6), round(per_step[4096], 6)],
                    "growth": round(per_step[4096] / per_step[64], 2),
                    "streams_growth": 64,
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
