"""The model call's own parts per token beside a transformers forward (issue 43), CPU time.

The run of ``benchmarks/hf.py --only outside`` (GPT-2 of 4 layers, V = 50257, N = 128, greedy under
``require Txt[t] in Set(0..19999)``, a run directory written), timed by the calling thread's CPU
time (``time.thread_time``: the other jobs of a shared machine are not counted as ours, their
cache traffic is): the forward (hooks on the model), and, wrapped around LMPM's own functions,
the worker's model call less the adapter (``ModelCalls.run`` less ``HFCausalLM.__call__``), its
reads (``ModelInputs.gather``), the worker's ``execute`` beside the adapter, and the adapter
beside the forward. Prints one JSON line: µs per token of each (min of ``--repeats`` runs) and
the ratio of the model call's own part to the forward measured in the same runs.

Use it to compare two trees (``PYTHONPATH=OTHER/src python benchmarks/hf_parts.py``, alternated):
docs/models.md, "LMPM's own time per token with a run directory".
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hf  # benchmarks/hf.py: the model, the program, the constraint

PARTS = {  # name -> (module, class, method) timed by a wrapper
    "calls": ("lmpm.runtime.data.calls", "ModelCalls", "run"),
    "gather": ("lmpm.runtime.data.inputs", "ModelInputs", "gather"),
    "execute": ("lmpm.workers.batch", None, "execute"),
    "adapter": ("lmpm.models.hf", "HFCausalLM", "__call__"),
}


def _timed(spent: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.thread_time_ns() - t0

    return timed


def _wrap(spent: Counter[str]) -> None:
    import importlib

    import lmpm.workers.cpu as cpu

    for name, (module, cls, attr) in PARTS.items():
        mod = importlib.import_module(module)
        owner = getattr(mod, cls) if cls else mod
        setattr(owner, attr, _timed(spent, name, getattr(owner, attr)))
        if cls is None:  # (the backend imported the function itself)
            setattr(cpu, attr, getattr(owner, attr))


def parts(n: int, repeats: int) -> dict[str, Any]:
    import lmpm
    from lmpm.models.hf import HFCausalLM

    spent: Counter[str] = Counter()
    _wrap(spent)
    net = hf.make_model(max(n, 64))
    ids = torch.zeros(n, dtype=torch.int64)
    ids[: hf.PROMPT] = torch.randint(0, hf.ALLOWED, (hf.PROMPT,), generator=torch.Generator())
    compiled = lmpm.compile(text=hf.PROGRAM.format(n=n, constraint=hf.CONSTRAINT))
    best: dict[str, float] = {}
    forward = [0.0]

    def before(*_: Any) -> None:
        forward.append(-time.thread_time())

    def after(*_: Any) -> None:
        forward[-1] += time.thread_time()

    hooks = [net.register_forward_pre_hook(before), net.register_forward_hook(after)]
    tokens = n - hf.PROMPT - 1
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            run = compiled.runner(
                bindings={"GPT": HFCausalLM(net)}, backend="cpu", run_dir=Path(tmp) / "run"
            )
            run.set_input("Txt", ids, torch.arange(n) < hf.PROMPT)
            run.run(1)  # start-up excluded
            spent.clear()
            forward[:] = [0.0]
            run.run(until_stable=True)
            run.close()
        fw = sum(forward)
        got = {
            "forward": fw * 1e6,
            "call_beside_adapter": (spent["calls"] - spent["adapter"]) / 1e3,
            "reads": spent["gather"] / 1e3,
            "execute_beside_adapter": (spent["execute"] - spent["adapter"]) / 1e3,
            "adapter_beside_forward": spent["adapter"] / 1e3 - fw * 1e6,
        }
        for k, v in got.items():
            best[k] = min(best.get(k, float("inf")), v / tokens)
    for h in hooks:
        h.remove()
    own = best["call_beside_adapter"] + best["adapter_beside_forward"]
    return {
        "case": "hf_parts",
        "N": n,
        "vocab": 50257,
        **{f"{k}_us_per_token": round(v, 1) for k, v in best.items()},
        "own_us_per_token": round(own, 1),
        "ratio_own_to_forward": round(own / best["forward"], 4),
        "repeats": repeats,
        "note": "thread CPU time, min of runs; shared CPU: cache contention still counts",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(parts(args.n, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
