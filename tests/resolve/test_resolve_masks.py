"""Static set constraints lowered into a vocabulary mask: greedy with the mask at k=1 commits exactly
what k=V commits without it (lmpm.resolve.masks, lmpm.workers.choose), and the lowering refuses
where it would not be exact."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmpm.resolve.plan as plan_module
from lmpm import Logits
from lmpm.ir import compile_source
from lmpm.resolve.masks import lowering_of
from lmpm.runtime.session import Run

HEAD = """
param N = {n}
value T : Token[{v}] shape Seq(N)
value MaskPlan : Event shape Set()
visible T[t] <- T[0..t-1] when t > 0
rule R:
  on T[t]
  read {{ctx = T[0..t-1]}}
  emit proposal T[t] := Gen(ctx, k={k}, pick="{pick}")
commit T[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="{strategy}")
"""


@dataclass(frozen=True)
class Program:
    n: int
    vocab: int
    strategy: str
    constraints: tuple[str, ...]
    table: torch.Tensor  # (64, vocab) logits the model looks up by its context

    def source(self, k: int, pick: str = "top") -> str:
        head = HEAD.format(n=self.n, v=self.vocab, k=k, pick=pick, strategy=self.strategy)
        return head + "".join(self.constraints)

    def model(self) -> Any:
        table = self.table

        def gen(inputs: dict[str, torch.Tensor], k: int = 1, pick: str = "top", **_: Any) -> Any:
            ctx, seen = inputs["ctx"], inputs["ctx_mask"]
            row = ((ctx * seen).sum(1) * 7 + inputs["cells"] * 3 + seen.sum(1)) % table.shape[0]
            return Logits(table[row], k=int(k), pick=pick)

        return gen


@st.composite
def programs(draw: st.DrawFn) -> Program:
    n = draw(st.integers(2, 6))
    vocab = draw(st.integers(2, 12))
    constraints = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["require", "forbid"]))
        members = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=vocab, unique=True))
        lo = draw(st.integers(0, n - 1))
        hi = draw(st.integers(lo, n - 1))
        where = "T[t]" if draw(st.booleans()) else f"T[{lo}..{hi}]"
        prio = draw(st.sampled_from([1, 5, 10]))
        hard = " hard" if draw(st.integers(0, 6)) == 0 else ""
        constraints.append(
            f"constraint C{i}:\n  {kind} {where} in Set({', '.join(map(str, members))}) "
            f"priority {prio}{hard}\n"
        )
    if draw(st.integers(0, 3)) == 0:  # exact beside the mask: keep-current always satisfies it
        constraints.append(
            f"constraint Keep:\n  forbid change(T[t]) priority {draw(st.sampled_from([1, 7, 20]))}\n"
        )
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    table = torch.round(torch.randn(64, vocab, generator=g) * 2) / 2  # ties happen
    table[torch.rand(64, vocab, generator=g) < 0.15] = -torch.inf  # tokens the model rules out
    table[:, int(torch.randint(vocab, (1,), generator=g))] = 0.0  # every row allows some token
    strategy = draw(st.sampled_from(["all", "raster"]))
    return Program(n, vocab, strategy, tuple(constraints), table)


def _run(prog: Program, k: int, masks: bool) -> Run:
    with pytest.MonkeyPatch.context() as m:
        if not masks:  # the general semantics: every candidate checked after the model
            m.setattr(plan_module, "lower", lambda plan: {})
        run = Run.from_source(prog.source(k), bindings={"Gen": prog.model()})
    assert bool(run.plan.masks) == masks
    run.run(prog.n + 4)
    return run


def _committed(run: Run) -> tuple[list[int], list[bool], list[float]]:
    st = run.engine.state["T"]
    return run.outputs()["T"].tolist(), st.committed.tolist(), st.score.tolist()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(programs())
def test_greedy_k1_with_the_mask_commits_what_k_v_commits(prog: Program) -> None:
    masked = _committed(_run(prog, 1, True))
    everything = _committed(_run(prog, prog.vocab, False))
    assert masked == everything


def test_without_the_mask_k1_commits_what_the_mask_avoids() -> None:
    """The property is not empty: here k=1 without the mask commits a token the soft `require`
    forbids (keep-current, unset, violates it too), and the run says so."""
    table = torch.zeros(64, 6)
    table[:, 5] = 3.0  # the favourite, which the constraint forbids
    table[:, 2] = 1.0
    prog = Program(
        4, 6, "raster", ("constraint No5:\n  require T[t] in Set(0..4) priority 10\n",), table
    )
    assert _committed(_run(prog, 1, False))[0] == [5, 5, 5, 5]
    assert _committed(_run(prog, 1, True))[0] == [2, 2, 2, 2]
    assert _committed(_run(prog, 6, False))[0] == [2, 2, 2, 2]


@pytest.mark.parametrize(
    ("strategy", "driver"),
    [("raster", "process"), ("all", "process"), pytest.param("all", "ray", marks=pytest.mark.slow)],
)
def test_a_worker_group_applies_the_mask_too(strategy: str, driver: str) -> None:
    table = torch.zeros(64, 6)
    table[:, 5] = 3.0  # the favourite, which the constraint rules out
    table[::2, 2] = 1.0
    table[1::2, 3] = 1.0
    prog = Program(
        6, 6, strategy, ("constraint Low:\n  require T[t] in Set(0..4) priority 10\n",), table
    )
    outs = []
    for workers in (1, 2):
        group = {"workers": 2, "driver": driver} if workers > 1 else {}
        run = Run.from_source(prog.source(1), bindings={"Gen": prog.model()}, **group)
        run.run(10)
        outs.append(run.outputs()["T"].tolist())
        run.close()
    assert outs[0] == outs[1] and 5 not in outs[0]


@pytest.mark.slow  # inductor compiles two step graphs (~20 s)
def test_compile_applies_the_mask_as_eager_does() -> None:
    table = torch.round(torch.randn(64, 8, generator=torch.Generator().manual_seed(3)) * 2) / 2
    prog = Program(
        5, 8, "all", ("constraint Low:\n  require T[t] in Set(0..3) priority 10\n",), table
    )
    outs = []
    for compile in (False, True):
        run = Run.from_source(prog.source(1), bindings={"Gen": prog.model()}, compile=compile)
        run.run(8)
        outs.append(_committed(run))
    assert outs[0] == outs[1] and all(x <= 3 for x in outs[0][0])


def test_sampling_draws_from_the_constrained_distribution() -> None:
    """pick="sample" with the mask: every committed token satisfies the soft `require`."""
    table = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    prog = Program(
        24, 50, "raster", ("constraint Low:\n  require T[t] in Set(0..9) priority 10\n",), table
    )
    run = Run.from_source(prog.source(1, "sample"), bindings={"Gen": prog.model()})
    run.run(30)
    out = run.outputs()["T"].tolist()
    assert all(0 <= x <= 9 for x in out) and len(set(out)) > 1


def _lowering(src: str) -> Any:
    return lowering_of(compile_source(src, raise_errors=False).ir)["T"]


BASE = """
value T : Token[Byte] shape Seq(4) clock Lamport
rule R:
  on T[t]
  emit proposal T[t] := Gen(k=1){score}
constraint Low:
  require T[t] in Set(97..122) priority 10
"""


def test_lowered_where_exact() -> None:
    low = _lowering(BASE.format(score="") + "constraint K:\n  forbid change(T[t]) priority 100\n")
    assert low.lowered == ("Low",) and low.rules == ("R",)
    assert [name for name, _ in low.why_not] == ["K"]  # checked after the model, and exact


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ("commit T[*] using winner_takes_all()\n", "is not satisfy(max_constraints_then_score)"),
        ("commit T[*] using quorum(2, satisfy)\n", "is not satisfy(max_constraints_then_score)"),
        ("constraint C:\n  require change(T[t]) priority 1\n", "depends on more than the proposed"),
        ("constraint D:\n  forbid clash(T[t], T[0..3]) priority 1\n", "depends on more than"),
    ],
)
def test_lowering_refuses_where_not_exact(extra: str, why: str) -> None:
    low = _lowering(BASE.format(score="") + extra)
    assert low.lowered == ()
    assert any(why in text for _, text in low.why_not), low.why_not
    assert "Low" in dict(low.why_not)  # the set constraint says why it stays after the model


def test_a_rule_with_its_own_score_gets_no_mask() -> None:
    low = _lowering(BASE.format(score="\n  score S(...)"))
    assert low.lowered == () and "rule R" in dict(low.why_not)
    assert "own score" in dict(low.why_not)["rule R"]
