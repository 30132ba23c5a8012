"""LMPM with a Hugging Face causal LM (lmpm.models.hf) vs HF generate, per token, one process.

The model: ``GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=50257)``, seeded random
weights, greedy. Per N (prompt 8 tokens, N - 8 new ones):

- LMPM: ``GPT(context, k=1, pick="top")`` bound through :class:`~lmpm.models.hf.HFCausalLM` (its KV
  cache reused by the worker's clocks), raster schedule, ``--trace off``-equivalent (no run dir);
- HF ``generate(use_cache=True, do_sample=False)``;
- the no-cache loop: a full forward of the prefix per token;
- outlines, when installed (skipped otherwise).

With ``--constraint`` both sides carry ``require Txt[t] in Set(0..19999)`` (LMPM: the program's
constraint; HF: a LogitsProcessor masking the same ids; the worker lowers the set constraint into
a vocabulary mask, so k=1 is exact). Then LMPM's own time per token beside the model's forward, a
run directory written (the log included), at N = 128 under the constraint, beside the floor
under it: a hand-written greedy loop's own time per token (the masked argmax, its log-prob, three
host writes; no log, checks or agreement), alternated with LMPM's runs, tokens asserted identical;
then a batch of 16
prompts of different lengths: a real run of a ``Grid2D(16, N)`` under the ``frontier`` schedule
(every row's next cell each epoch) vs HF's left-padded batched generate.

Prints one JSON line per case: ms per token of each, the ratio LMPM/HF, LMPM's (and, single,
HF generate's) time per token outside the model's forward, and whether the tokens were identical
(asserted). The minimum of
``--repeats`` alternated runs (the issue's method: on a shared CPU the least disturbed run is the
closest to the cost itself; at N <= 128 at least 5). ``--quick``: N = 64, 128 and 2 repeats
(scripts/bench.sh).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

PROGRAM = """
param N = {n}
value Txt : Token[50257] shape Seq(N) clock Lamport
value MaskPlan : Event shape Set() clock Lamport
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Next:
  on Txt[t]
  read {{context = Txt[0..t-1]}}
  emit proposal Txt[t] := GPT(context, k=1, pick="top")
{constraint}
commit Txt[*] using satisfy(max_constraints_then_score)
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="raster", k=1)
"""
CONSTRAINT = """constraint Small:
  require Txt[t] in Set(0..19999) priority 10
"""
ALLOWED = 20000
PROMPT = 8
SHORT, SHORT_REPEATS = 128, 5  # N up to SHORT: at least SHORT_REPEATS alternated runs (single)


DEVICE = "cpu"  # --device


def make_model(n_positions: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=50257, n_positions=n_positions)
    return GPT2LMHeadModel(cfg).eval().to(DEVICE)


def processors(constrained: bool) -> Any:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Allowed(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            scores[:, ALLOWED:] = float("-inf")
            return scores

    return LogitsProcessorList([Allowed()] if constrained else [])


def lmpm_run(
    net: Any, prompt: list[int], n: int, constrained: bool
) -> tuple[list[int], float, float]:
    import lmpm
    from lmpm.models.hf import HFCausalLM

    src = PROGRAM.format(n=n, constraint=CONSTRAINT if constrained else "")
    run = lmpm.compile(text=src).runner(bindings={"GPT": HFCausalLM(net)}, backend=DEVICE)
    ids = torch.zeros(n, dtype=torch.int64)
    ids[:PROMPT] = torch.tensor(prompt)
    run.set_input("Txt", ids, torch.arange(n) < PROMPT)
    with _Forwards(net) as fw:  # the model's own forward (hooks): the rest is LMPM's
        t0 = time.perf_counter()
        run.run(until_stable=True)
        wall = time.perf_counter() - t0
    model = fw.seconds
    out = run.outputs()["Txt"].tolist()
    run.close()
    return out, wall, model


def hf_generate(
    net: Any, prompt: list[int], n: int, constrained: bool
) -> tuple[list[int], float, float]:
    """HF's tokens, wall seconds and the seconds of its model's forwards (hooks, as for LMPM)."""
    x = torch.tensor([prompt], device=DEVICE)
    with _Forwards(net) as fw:
        t0 = time.perf_counter()
        out = _generate(net, x, n, constrained)
        wall = time.perf_counter() - t0
    return out[0].tolist(), wall, fw.seconds


def _generate(net: Any, x: torch.Tensor, n: int, constrained: bool) -> Any:
    return net.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n - PROMPT,
        min_new_tokens=n - PROMPT,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        logits_processor=processors(constrained),
    )


def no_cache(net: Any, prompt: list[int], n: int, constrained: bool) -> tuple[list[int], float]:
    ids = list(prompt)
    t0 = time.perf_counter()
    with torch.no_grad():
        while len(ids) < n:
            logits = net(torch.tensor([ids], device=DEVICE)).logits[0, -1]
            if constrained:
                logits[ALLOWED:] = float("-inf")
            ids.append(int(logits.argmax()))
    return ids, time.perf_counter() - t0


def outlines_time(net: Any, prompt: list[int], n: int) -> float | None:
    try:
        import outlines  # noqa: F401
    except ImportError:
        return None
    return None  # (outlines is not installed here; a run with it would go here)


def single(n: int, repeats: int, constrained: bool, loop: bool = True) -> dict[str, Any]:
    net = make_model(max(n, 64))
    gen = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, ALLOWED, (PROMPT,), generator=gen).tolist()
    new = n - PROMPT
    # a short N's runs last about a second each: one burst of the others' load can cover every
    # run of one side, and its forward is the shortest, so the fixed costs per token weigh most;
    # more alternated runs there (they are cheap)
    repeats = max(repeats, SHORT_REPEATS) if n <= SHORT else repeats
    lm, hf, nc, outside, hf_outside = [], [], [], [], []
    for _ in range(repeats):  # alternated
        a, wall, model = lmpm_run(net, prompt, n, constrained)
        b, t_hf, hf_model = hf_generate(net, prompt, n, constrained)
        c, t_nc = no_cache(net, prompt, n, constrained) if loop else (b, 0.0)
        assert a == b == c, "LMPM, HF generate and the no-cache loop must commit the same tokens"
        lm.append(wall / new)
        hf.append(t_hf / new)
        nc.append(t_nc / new)
        outside.append((wall - model) / new)
        hf_outside.append((t_hf - hf_model) / new)
    ms = lambda xs: 1e3 * min(xs)  # noqa: E731
    return {
        "case": "single",
        "N": n,
        "constraint": constrained,
        "lmpm_ms_per_token": round(ms(lm), 3),
        "hf_generate_ms_per_token": round(ms(hf), 3),
        "no_cache_ms_per_token": round(ms(nc), 3) if loop else None,
        "outlines_ms_per_token": outlines_time(net, prompt, n),
        "ratio": round(ms(lm) / ms(hf), 3),
        "lmpm_outside_forward_ms_per_token": round(ms(outside), 3),
        # HF generate's own time per token beside the same forwards (its loop, the processor)
        "hf_outside_forward_ms_per_token": round(ms(hf_outside), 3),
        "identical": True,
        "goal": 1.10,
        "repeats": repeats,
        "note": "min of alternated runs; the CPU is shared (loaded by others)",
    }


# rows of prompts generated side by side (the `frontier` schedule), GPT-2's vocabulary: the
# program tests/models/test_hf.py checks against generate
BATCH_PROGRAM = Path(__file__).resolve().parents[1] / "examples" / "hf" / "rows.lmpm"


def batch(rows: int, new: int, repeats: int) -> dict[str, Any]:
    """``rows`` prompts of 4-23 tokens, each row of a ``Grid2D(rows, N)`` generated to N tokens by
    a real run (the ``frontier`` schedule: the next cell of every row each epoch) vs HF's
    left-padded batched generate of ``N - shortest prompt`` new tokens (the same number of steps;
    its longer rows run past N and are cut there). ``N``: the longest prompt plus ``new``."""
    import lmpm
    from lmpm.models.hf import HFCausalLM

    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(4, 24, (rows,), generator=gen).tolist()
    prompts = [torch.randint(0, ALLOWED, (n,), generator=gen).tolist() for n in lengths]
    n = max(lengths) + new  # every row generates at least ``new`` tokens
    steps = n - min(lengths)  # HF's steps: its shortest row reaches N
    net = make_model(max(lengths) + steps)  # (HF's left-padded rows run past N)
    ids = torch.zeros(rows, n, dtype=torch.int64)
    given = torch.zeros(rows, n, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        given[i, : len(p)] = True
    width = max(lengths)
    x = torch.zeros(rows, width, dtype=torch.int64)
    att = torch.zeros(rows, width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        x[i, width - len(p) :] = torch.tensor(p)
        att[i, width - len(p) :] = 1
    compiled = lmpm.compile(BATCH_PROGRAM, N=n, B=rows, BPE=50257)
    lm, hf, outside = [], [], []
    for _ in range(repeats):  # alternated
        run = compiled.runner(bindings={"GPT": HFCausalLM(net)}, backend=DEVICE)
        run.set_input("Txt", ids, given)
        with _Forwards(net) as fw:
            t0 = time.perf_counter()
            run.run(until_stable=True)
            wall = time.perf_counter() - t0
        out = run.outputs()["Txt"]
        run.close()
        lm.append(wall)
        outside.append(wall - fw.seconds)
        t0 = time.perf_counter()
        ref = net.generate(
            x.to(DEVICE),
            attention_mask=att.to(DEVICE),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
        hf.append(time.perf_counter() - t0)
        for i, p in enumerate(prompts):
            row = ref[i, width - len(p) :][:n].tolist()
            assert out[i].tolist() == row, "the run's rows differ from HF's batched generate"
    tokens = sum(n - len(p) for p in prompts)  # the tokens both sides must produce
    ms = lambda xs: 1e3 * min(xs) / tokens  # noqa: E731
    return {
        "case": "batch",
        "rows": rows,
        "N": n,
        "prompt_lengths": lengths,
        "steps": steps,
        "lmpm_ms_per_token": round(ms(lm), 3),
        "hf_generate_ms_per_token": round(ms(hf), 3),
        "ratio": round(min(lm) / min(hf), 3),
        "lmpm_outside_forward_ms_per_token": round(ms(outside), 3),
        "identical": True,
        "goal": 1.10,
        "repeats": repeats,
        "note": "a real run of a Grid2D(rows, N) under the frontier schedule; per token of the "
        "rows' common output (HF's longer rows run past N); min of alternated runs; shared CPU",
    }


def bare_loop(net: Any, prompt: list[int], n: int) -> tuple[list[int], float]:
    """A hand-written greedy decode loop with a KV cache under the same constraint: its tokens,
    and its own time per token beside the model's forward (hooks, as for LMPM). Per token the
    least a committed token needs: the masked argmax, its log-prob, the token, its score and its
    clock written into host arrays, the next input made. No log, no checks, no trace: the floor
    under any runtime's time beside the forward on this machine (right after a forward that
    streamed the model's ~64 MB of weights, every cache level is cold)."""
    import numpy as np
    from transformers import DynamicCache

    cache = DynamicCache()  # (filled in place)
    ids, score, clock = np.zeros(n, np.int64), np.zeros(n), np.zeros(n, np.int64)
    ids[:PROMPT] = prompt
    with torch.inference_mode(), _Forwards(net) as fw:
        t0 = time.perf_counter()
        out = net(input_ids=torch.tensor([prompt], device=DEVICE), cache=cache, use_cache=True)
        for pos in range(PROMPT, n):
            logits = out.logits[:, -1].float()
            row = logits[0].cpu().numpy()
            t = int(row[:ALLOWED].argmax())
            ids[pos], clock[pos] = t, pos
            score[pos] = torch.log_softmax(logits, dim=-1)[0, t].item()
            if pos + 1 < n:
                nxt = torch.tensor([[t]], device=DEVICE)
                out = net(input_ids=nxt, cache=cache, use_cache=True)
        wall = time.perf_counter() - t0
    return ids.tolist(), (wall - fw.seconds) / (n - PROMPT)


class _Forwards:
    """Sums the wall time of ``net``'s forward calls (hooks around the module call)."""

    def __init__(self, net: Any) -> None:
        self.net = net
        self.seconds = 0.0
        self.calls = 0
        self._t0 = 0.0

    def __enter__(self) -> _Forwards:
        def before(*_: Any) -> None:
            self._t0 = time.perf_counter()

        def after(*_: Any) -> None:
            self.seconds += time.perf_counter() - self._t0
            self.calls += 1

        self._hooks = [
            self.net.register_forward_pre_hook(before),
            self.net.register_forward_hook(after),
        ]
        return self

    def __exit__(self, *_: Any) -> None:
        for h in self._hooks:
            h.remove()


def outside(n: int, repeats: int, trace: str) -> dict[str, Any]:
    """LMPM's own time per token beside the model's forward, log included: a run writing its run
    directory (``trace`` as ``--trace``), greedy under ``require Txt[t] in Set(0..19999)`` at
    V = 50257; the forward's time is measured by hooks on the model and taken out, and the
    start-up (the first epoch: the run directory made, the prompt fed) is left out."""
    import tempfile

    import lmpm
    from lmpm.models.hf import HFCausalLM

    net = make_model(max(n, 64))
    gen = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, ALLOWED, (PROMPT,), generator=gen)
    ids = torch.zeros(n, dtype=torch.int64)
    ids[:PROMPT] = prompt
    compiled = lmpm.compile(text=PROGRAM.format(n=n, constraint=CONSTRAINT))
    got, forward, ends, bare = [], [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            run = compiled.runner(
                bindings={"GPT": HFCausalLM(net)},
                backend=DEVICE,
                run_dir=Path(tmp) / "run",
                trace=trace,
            )
            run.set_input("Txt", ids, torch.arange(n) < PROMPT)
            run.run(1)  # start-up excluded: the run directory made, the prompt's prefill
            with _Forwards(net) as fw:
                t0 = time.perf_counter()
                run.run(until_stable=True)  # (its end: the final checkpoint, the outputs)
                t1 = time.perf_counter()
                tokens_lmpm = run.outputs()["Txt"].tolist()
                run.close()  # the logs closed (SQLite moves their WAL into the database)
                wall = time.perf_counter() - t0
        tokens = n - PROMPT - 1
        got.append((wall - fw.seconds) / tokens)
        forward.append(fw.seconds / tokens)
        ends.append(wall - (t1 - t0))
        toks, seconds = bare_loop(net, prompt.tolist(), n)  # (alternated with LMPM's runs)
        if toks != tokens_lmpm:
            raise AssertionError("the bare loop's tokens differ from LMPM's")
        bare.append(seconds)
    return {
        "case": "outside",
        "N": n,
        "vocab": 50257,
        "trace": trace,
        "outside_forward_ms_per_token": round(1e3 * min(got), 3),
        "forward_ms_per_token": round(1e3 * min(forward), 3),
        # the floor: a hand-written greedy loop's own time per token beside the same forward
        "bare_loop_outside_ms_per_token": round(1e3 * min(bare), 3),
        "ratio_to_bare_loop": round(min(got) / min(bare), 2),
        # of the run's time beside the forwards, once per run: closing the logs (ms)
        "close_ms": round(1e3 * min(ends), 1),
        "goal_ms": 0.3,
        "repeats": repeats,
        "note": "run dir written (the log included), the model's forward taken out by hooks, "
        "start-up excluded; min of runs; shared CPU",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--constraint", action="store_true", help="require Txt[t] in Set(0..19999)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the model and LMPM's worker)")
    ap.add_argument("--sizes", type=int, nargs="*", help="N values (default: 128 512 1024 2048)")
    ap.add_argument("--no-loop", action="store_true", help="skip the (slow) no-cache loop")
    ap.add_argument(
        "--only", choices=("single", "outside", "batch"), help="one case (default: every one)"
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    ap_sizes = args.sizes or ((64, 128) if args.quick else (128, 512, 1024, 2048))
    sizes = tuple(ap_sizes)
    repeats = 2 if args.quick else args.repeats
    if args.only in (None, "single"):
        for n in sizes:
            print(json.dumps(single(n, repeats, args.constraint, not args.no_loop)), flush=True)
    if args.sizes and args.only is None:
        return
    if args.only in (None, "outside"):
        print(json.dumps(outside(128, max(repeats, 3), "summary")), flush=True)
    if args.only in (None, "batch"):
        print(json.dumps(batch(16, 16 if args.quick else 64, repeats)), flush=True)


if __name__ == "__main__":
    main()
