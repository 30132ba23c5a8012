"""The clocks protocol (lmpm.runtime.data.reads): a model that keeps a cache keyed on (generation,
cell, clock) is never handed a stale entry — a cell overwritten by a commit, a state replaced (what
resume and a rollback do: ``load``), a payload write the worker did not stamp, a new worker — and
its per-call delta and dense layout agree with the slots. Every call checks the cache against the
inputs themselves (a full recompute)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

import lmpm
from lmpm.errors import BindError

V = 7
PROGRAM = """
param N = 12
value Txt : Token[7] shape Seq(N) clock Lamport
value MaskPlan : Event shape Set() clock Lamport
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Next:
  on Txt[t]
  read {context = Txt[0..t-1]}
  emit proposal Txt[t] := Cached(context)
commit Txt[*] using satisfy(max_constraints_then_score)
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="all")
"""


class CachingModel:
    """Random proposals; keeps (generation, cell) -> (clock, token) and checks it every call."""

    lmpm_reads = frozenset({"clocks", "dense"})

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int], tuple[int, int]] = {}
        self.generations: list[int] = []
        self.hits = 0
        self.changed_seen = 0
        self._last: dict[tuple[int, int], int] = {}  # the previous call's clocks

    def __call__(
        self, inputs: dict[str, torch.Tensor], *, epoch: int, generation: int = 0, **_: Any
    ) -> Any:
        if not self.generations or self.generations[-1] != generation:
            self.generations.append(generation)
        data, mask, index = inputs["context"], inputs["context_mask"], inputs["context_index"]
        clock, changed = inputs["context_clock"], inputs["context_changed"]
        last: dict[tuple[int, int], int] = {}
        for row in range(mask.shape[0]):
            for slot in mask[row].nonzero().flatten().tolist():
                key = (generation, int(index[row, slot]))
                c, tok = int(clock[row, slot]), int(data[row, slot])
                assert c > 0
                hit = self.cache.get(key)
                if hit is not None and hit[0] == c:
                    assert hit[1] == tok, f"stale cache entry for cell {key[1]}"
                    self.hits += 1
                prev = self._last.get(key)
                if prev is not None:  # seen in the previous call: changed <=> a new clock
                    assert bool(changed[row, slot]) == (prev != c)
                    self.changed_seen += int(prev != c)
                self.cache[key] = (c, tok)
                last[key] = c
            # the dense layout: the visible slots in order
            n = int(inputs["context_length"][row])
            assert inputs["context_dense"][row, :n].tolist() == data[row][mask[row]].tolist()
            assert inputs["context_dense_index"][row, :n].tolist() == index[row][mask[row]].tolist()
        self._last = last
        cells = inputs["cells"]  # a new token every epoch, scored above the last one
        return {
            "proposal": (cells + epoch) % V,
            "score": torch.full(cells.shape, float(epoch), device=cells.device),
        }


def _run(model: CachingModel, **kw: Any) -> Any:
    run = lmpm.compile(text=PROGRAM).runner(bindings={"Cached": model}, **kw)
    ids = torch.zeros(12, dtype=torch.int64)
    run.set_input("Txt", ids, torch.arange(12) < 2)
    return run


def test_overwritten_cells_reach_the_model_as_changed() -> None:
    model = CachingModel()
    run = _run(model)
    run.run(8)
    run.close()
    assert model.hits > 0 and model.changed_seen > 0  # both cases occurred
    assert len(model.generations) == 1


def test_a_replaced_state_and_an_unstamped_write_draw_a_new_generation() -> None:
    model = CachingModel()
    run = _run(model)
    run.run(4)
    dp = run.dataplane
    payload, committed = dp.read("Txt")
    # what resume and a rollback do: the value's state replaced (same clocks could repeat)
    dp.load("Txt", (payload + 1) % V, committed, torch.zeros_like(committed))
    run.run(6)  # (epochs in total)
    assert len(model.generations) == 2
    # a write the worker did not stamp (a path that forgot to): caught by the tensor's version
    with torch.no_grad():
        dp.payload["Txt"][1] = (dp.payload["Txt"][1] + 1) % V
    run.run(8)
    run.close()
    assert len(model.generations) == 3


def test_a_new_worker_has_its_own_generation() -> None:
    model = CachingModel()
    for _ in range(2):
        run = _run(model)
        run.run(2)
        run.close()
    assert len(model.generations) == 2


def test_two_workers_stamp_the_halo_they_receive() -> None:
    model = CachingModel()
    run = _run(model, workers=2, driver="process")
    run.run(6)
    run.close()
    assert model.hits > 0


def test_a_model_that_asks_for_an_unknown_read_extra_is_refused() -> None:
    model = CachingModel()
    model.lmpm_reads = frozenset({"clocks", "kv"})  # type: ignore[misc]
    with pytest.raises(BindError, match="kv"):
        _run(model)


def test_a_model_that_does_not_opt_in_costs_nothing() -> None:
    run = lmpm.compile(text=PROGRAM).runner(
        bindings={"Cached": lambda inputs, **_: {"logits": torch.zeros(len(inputs["cells"]), V)}}
    )
    assert not run.dataplane.read_clocks  # no clocks kept
    run.close()


def test_the_adapter_without_transformers_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from lmpm.errors import BindError\n"
        "try:\n    import lmpm.models.hf\nexcept BindError as e:\n"
        "    print(e.code, e.hint)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("B101") and "pip install 'lmpm[hf]'" in out
