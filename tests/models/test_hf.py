"""lmpm.models.hf: a transformers causal LM bound as a rule's model commits what HF generate does.

A tiny seeded random GPT-2; LMPM's committed tokens are compared with ``model.generate(...,
do_sample=False)`` for one prompt, and the adapter's batched rows (different lengths) with HF's
left-padded batched generate. The KV cache is checked by what the adapter fed the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel

import lmpm
from lmpm.cli import main
from lmpm.models.hf import HFCausalLM
from lmpm.runtime.data.reads import dense_read

V = 97

PROGRAM = """
param N = {n}
value Txt : Token[{v}] shape {shape} clock Lamport
value MaskPlan : Event shape Set() clock Lamport
visible Txt[{cell}] <- Txt[{prefix}] when t > 0
rule Next:
  on Txt[{cell}]
  read {{context = Txt[{prefix}]}}
  emit proposal Txt[{cell}] := GPT(context, k=1, pick="top")
commit Txt[*] using satisfy(max_constraints_then_score)
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="raster", k={k})
"""


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(cfg).eval()


def hf_greedy(model: GPT2LMHeadModel, prompt: list[int], new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0].tolist()


def run_seq(model: HFCausalLM, prompt: list[int], n: int, **kw: object) -> np.ndarray:
    src = PROGRAM.format(n=n, v=V, shape="Seq(N)", cell="t", prefix="0..t-1", k=1)
    run = lmpm.compile(text=src).runner(bindings={"GPT": model}, **kw)
    ids = torch.full((n,), -1, dtype=torch.int64)
    ids[: len(prompt)] = torch.tensor(prompt)
    run.set_input("Txt", ids.clamp(min=0), ids >= 0)
    run.run(until_stable=True)
    out = run.outputs()["Txt"]
    run.close()
    return out


def test_a_run_commits_what_generate_does_and_feeds_each_token_once() -> None:
    net = tiny_gpt2()
    prompt = [5, 17, 3, 42, 8]
    n = 24
    adapter = HFCausalLM(net)
    out = run_seq(adapter, prompt, n)
    assert out.tolist() == hf_greedy(net, prompt, n - len(prompt))
    # the prompt once, then one new token per epoch: the cache was reused every call
    assert adapter.fed == len(prompt) + (n - len(prompt) - 1)


def test_the_process_driver_with_two_workers_commits_the_same() -> None:
    net = tiny_gpt2(1)
    prompt = [1, 2, 3]
    out = run_seq(HFCausalLM(net), prompt, 16, workers=2, driver="process")
    assert out.tolist() == hf_greedy(net, prompt, 13)


def _dense_inputs(rows: list[list[int]], clocks: list[list[int]] | None = None) -> dict:
    """The inputs the worker hands an opted-in model for rows of these prefixes."""
    width = max(len(r) for r in rows)
    data = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    index = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        data[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
        index[i, : len(r)] = torch.arange(len(r)) + 1000 * i
    clock = torch.ones_like(index) if clocks is None else torch.zeros_like(index)
    if clocks is not None:
        for i, c in enumerate(clocks):
            clock[i, : len(c)] = torch.tensor(c)
    clock = torch.where(mask, clock, 0)
    return {"cells": torch.arange(len(rows)), **dense_read("context", data, mask, index, clock)}


def test_rows_at_different_lengths_decode_as_hf_batched_generate() -> None:
    net = tiny_gpt2(2)
    prompts = [[4, 9, 1], [7, 7, 2, 30, 11, 5], [60], [3, 8, 8, 1, 2]]
    new = 6
    adapter = HFCausalLM(net)
    rows = [list(p) for p in prompts]
    for _ in range(new):
        out = adapter(_dense_inputs(rows), pick="top", generation=7)
        assert (out.k, out.pick) == (1, "top")  # the worker chooses: greedy here
        for r, tok in zip(rows, out.logits.argmax(dim=-1).tolist()):
            r.append(tok)
    for p, r in zip(prompts, rows):
        assert r == hf_greedy(net, p, new)
    assert adapter.fed == sum(len(p) for p in prompts) + len(prompts) * (new - 1)


def test_a_changed_cell_trims_the_cache_and_a_new_generation_drops_it() -> None:
    net = tiny_gpt2(3)
    adapter = HFCausalLM(net)
    base = [5, 6, 7, 8, 9, 10]
    ref = lambda r: net(torch.tensor([r])).logits[0, -1]  # noqa: E731
    out = adapter(_dense_inputs([base]), pick="sample", generation=1).logits
    torch.testing.assert_close(out[0], ref(base), rtol=1e-4, atol=1e-5)
    # cell 2 rewritten (a new clock): positions 2.. are fed again, 0..1 kept
    changed = [5, 6, 40, 8, 9, 10]
    fed = adapter.fed
    out = adapter(
        _dense_inputs([changed], [[1, 1, 2, 1, 1, 1]]), pick="sample", generation=1
    ).logits
    torch.testing.assert_close(out[0], ref(changed), rtol=1e-4, atol=1e-5)
    assert adapter.fed - fed == 4
    # a new generation (a resume, a rollback): everything again
    fed = adapter.fed
    out = adapter(
        _dense_inputs([changed], [[1, 1, 2, 1, 1, 1]]), pick="sample", generation=2
    ).logits
    torch.testing.assert_close(out[0], ref(changed), rtol=1e-4, atol=1e-5)
    assert adapter.fed - fed == 6


BIND = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import lmpm
from lmpm.models.hf import HFCausalLM

torch.manual_seed(0)
cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, bos_token_id=0, eos_token_id=0)
lmpm.bind("GPT")(HFCausalLM(GPT2LMHeadModel(cfg).eval()))
"""


def test_the_adapter_is_ready_for_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lmpm check --device cuda` (simulated where there is no GPU) runs the adapter's epochs."""
    prog = tmp_path / "prog.lmpm"
    prog.write_text(PROGRAM.format(n=12, v=V, shape="Seq(N)", cell="t", prefix="0..t-1", k=1))
    (tmp_path / "gpt.py").write_text(BIND)
    (tmp_path / "prompt.json").write_text(json.dumps([3, 5, 7] + [-1] * 9))
    args = ["check", str(prog), "--bind", str(tmp_path / "gpt.py"), "--device", "cuda"]
    code = main([*args, "--input", f"Txt={tmp_path / 'prompt.json'}", "--epochs", "3"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "ready for cuda" in err and "error[" not in err


def test_a_grid_of_rows_runs_as_one_batch_and_commits_what_generate_does() -> None:
    """``Grid2D(N, B)``: B rows, each causal along x; raster opens position x of every row at once
    (equal prompt lengths: a wavefront), and the adapter runs the rows as one batch."""
    net = tiny_gpt2(4)
    n, rows, p = 10, 3, 4
    src = PROGRAM.format(
        n=n, v=V, shape=f"Grid2D(N, {rows})", cell="x, y", prefix="0..x-1, y", k=rows
    )
    src = src.replace("when t > 0", "when x > 0")
    adapter = HFCausalLM(net)
    run = lmpm.compile(text=src).runner(bindings={"GPT": adapter})
    prompts = torch.randint(0, V, (p, rows), generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(n, rows, dtype=torch.int64)
    ids[:p] = prompts
    run.set_input("Txt", ids, (torch.arange(n) < p).unsqueeze(1).expand(n, rows))
    run.run(until_stable=True)
    out = run.outputs()["Txt"]
    run.close()
    for y in range(rows):
        assert out[:, y].tolist() == hf_greedy(net, prompts[:, y].tolist(), n - p)
    assert adapter.fed == rows * p + rows * (n - p - 1)  # one batch per epoch, cache reused


# rows of prompts generated side by side (the `frontier` schedule); benchmarks/hf.py times it
FRONTIER = Path(__file__).resolve().parents[2] / "examples" / "hf" / "rows.lmpm"


def test_the_frontier_schedule_generates_rows_of_different_lengths_as_generate_does() -> None:
    """``Grid2D(B, N)`` with prompts of different lengths: each epoch opens the next cell of
    every row still short of N; each row commits what ``generate`` does for its prompt, the rows
    run as one batch, and a row that is done leaves the others' caches in place (each token is
    fed once)."""
    net = tiny_gpt2(5)
    n, lengths = 12, [3, 7, 5, 11]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (p,), generator=gen).tolist() for p in lengths]
    adapter = HFCausalLM(net)
    run = lmpm.compile(FRONTIER, N=n, B=len(lengths), BPE=V).runner(bindings={"GPT": adapter})
    ids = torch.zeros(len(lengths), n, dtype=torch.int64)
    given = torch.zeros(len(lengths), n, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        given[i, : len(p)] = True
    run.set_input("Txt", ids, given)
    result = run.run(until_stable=True)
    out = run.outputs()["Txt"]
    run.close()
    opened = [r.open_cells for r in result.records if r.open_cells]
    assert opened == [sum(n > p + e for p in lengths) for e in range(n - min(lengths))]
    for i, p in enumerate(prompts):
        assert out[i].tolist() == hf_greedy(net, p, n - len(p))
    # the prompts once, then every generated token but each row's last once
    assert adapter.fed == sum(lengths) + sum(n - p - 1 for p in lengths)


@pytest.mark.parametrize("seed", range(12))
def test_the_dense_layout_is_the_visible_slots_in_order_then_zeros(seed: int) -> None:
    """dense_read, both ways it takes: visible slots anywhere (a scatter) and leading slots (the
    causal prefix, narrowed), rows of one length and of several, a cell of one token and of two."""
    g = torch.Generator().manual_seed(seed)
    n, k = 1 + seed % 3, 7
    if seed % 2:  # leading slots: a prefix per row (one length when seed % 4 == 1)
        lengths = (
            torch.full((n,), 4) if seed % 4 == 1 else torch.randint(0, k + 1, (n,), generator=g)
        )
        mask = torch.arange(k) < lengths.unsqueeze(1)
    else:
        mask = torch.rand(n, k, generator=g) < 0.5
    cell = () if seed % 3 else (2,)
    data = torch.randint(1, 50, (n, k, *cell), generator=g)
    index = torch.randint(1, 50, (n, k), generator=g)
    clock = torch.randint(1, 50, (n, k), generator=g)
    got = dense_read("x", data, mask, index, clock)
    width = int(mask.sum(1).max())
    assert got["x_length"].tolist() == mask.sum(1).tolist()
    for key, src in (("x_dense", data), ("x_dense_index", index), ("x_dense_clock", clock)):
        out = got[key]
        assert tuple(out.shape) == (n, width, *src.shape[2:])
        for row in range(n):
            seen = src[row][mask[row]]
            m = seen.shape[0]
            assert torch.equal(out[row, :m], seen)
            assert not out[row, m:].any()  # the rest is 0


def test_a_row_left_alone_after_a_batch_keeps_its_padding_masked() -> None:
    """A row decoded in a batch with a longer one has padding columns in its cache; carried on
    alone (the other row finished), its one-token steps still mask them: the logits of a full
    forward of its prefix, every step."""
    net = tiny_gpt2(4)
    adapter = HFCausalLM(net)
    rows = [[4, 9, 1], [7, 7, 2, 30, 11, 5, 6, 8]]
    for _ in range(2):
        out = adapter(_dense_inputs(rows), pick="top", generation=3).logits
        for r, tok in zip(rows, out.argmax(dim=-1).tolist()):
            r.append(tok)
    alone = rows[0]
    for _ in range(4):
        out = adapter(_dense_inputs([alone]), pick="top", generation=3).logits
        ref = net(torch.tensor([alone])).logits[0, -1]
        torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-5)
        alone.append(int(out[0].argmax()))
