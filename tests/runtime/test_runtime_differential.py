"""The vectorized runtime against the plain reference interpreter on random small programs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmpm.ir import compile_source
from lmpm.runtime.session import Run

sys.path.insert(0, str(Path(__file__).parent))
from reference import Reference


def echo(
    inputs: dict[str, torch.Tensor], *, vocab: int, k: int = 2, **_: Any
) -> dict[str, torch.Tensor]:
    """Deterministic, mask-respecting: (sum of valid reads + cell + j) % vocab for j < k."""
    cells = inputs["cells"]
    total = cells.clone()
    for name, t in inputs.items():
        if name.endswith("_mask"):
            base = name.removesuffix("_mask")
            total = total + torch.where(t, inputs[base], 0).sum(dim=1)
    j = torch.arange(int(k))
    prop = (total[:, None] + j[None, :]) % vocab
    score = -((total[:, None] * 7 + j[None, :] * 3) % 5).to(torch.float64)
    return {"proposal": prop, "score": score}


BINDINGS = {"Echo": echo}

STENCILS_1D = [
    "Txt[0..t-1] when t > 0",
    "Txt[t-1] when t > 0",
    "Txt[t+1] when t < N-1",
    "Txt[t+dt] when dt in -2..2",
    "Txt[*]",
]
STENCILS_2D = [
    "G[x+dx, y+dy] when (dx,dy) in N4",
    "G[x+dx, y+dy] when (dx,dy) in N8",
    "G[x, *]",
    "G[*, y]",
    "G[x/2*2..x/2*2+1, y/2*2..y/2*2+1]",
]


@st.composite
def programs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    two_d = draw(st.booleans())
    vocab = draw(st.integers(3, 6))
    model = draw(st.sampled_from(["Uniform(k=2)", "Uniform", "Echo(k=2)", "Echo(k=3)"]))
    schedule = draw(st.sampled_from(["all", "red-black", "raster"]))
    # raster opens the first k unset cells: one cell (causal generation) or a few
    tiles = f", k={draw(st.integers(1, 3))}" if schedule == "raster" else ""
    if two_d:
        w, h = draw(st.integers(2, 4)), draw(st.integers(2, 4))
        clauses = draw(st.lists(st.sampled_from(STENCILS_2D), min_size=1, max_size=3, unique=True))
        src = [
            f"param W = {w}",
            f"param H = {h}",
            f"value G : Token[{vocab}] shape Grid2D(W, H)",
            "value MaskPlan : Event shape Set()",
        ]
        src += [
            f"visible G[x, y] <- {c.split(' when ')[0]}"
            + (f" when {c.split(' when ')[1]}" if " when " in c else "")
            for c in clauses
        ]
        read = clauses[0].split(" when ")[0]
        reads = "{nb in N4}" if "N4" in clauses[0] or "N8" in clauses[0] else f"{{r = {read}}}"
        args = "nb" if reads == "{nb in N4}" else "r"
        src += [
            "rule R:",
            "  on G[x, y]",
            f"  read {reads}",
            f"  emit proposal G[x, y] := {model.replace('(', f'({args}, ', 1) if '(' in model else f'{model}({args})'}",
        ]
        cons = draw(
            st.lists(
                st.sampled_from(
                    [
                        f"require G[x, y] in Set(0..{vocab - 2}) priority 5",
                        "forbid change(G[0..1, y]) priority 50",
                        f"forbid clash(G[x, y], {read if 'dx' not in read else 'G[x, *]'}) priority 20",
                        "forbid G[x, y] in Set(1) priority 7",
                    ]
                ),
                max_size=3,
                unique=True,
            )
        )
        target = "G"
    else:
        n = draw(st.integers(2, 7))
        clauses = draw(st.lists(st.sampled_from(STENCILS_1D), min_size=1, max_size=3, unique=True))
        src = [
            f"param N = {n}",
            f"value Txt : Token[{vocab}] shape Seq(N)",
            "value MaskPlan : Event shape Set()",
        ]
        src += [f"visible Txt[t] <- {c}" for c in clauses]
        read = clauses[0].split(" when ")[0]
        if "dt" in clauses[0]:
            read = "Txt[t]"  # a binder read is written as a neighbourhood; keep the read simple
            src.append("visible Txt[t] <- Txt[t]")
        src += [
            "rule R:",
            "  on Txt[t]",
            f"  read {{r = {read}}}",
            f"  emit proposal Txt[t] := {model.replace('(', '(r, ', 1) if '(' in model else f'{model}(r)'}",
        ]
        cons = draw(
            st.lists(
                st.sampled_from(
                    [
                        f"require Txt[t] in Set(0..{vocab - 2}) priority 5",
                        "forbid change(Txt[0..2]) priority 50",
                        f"forbid clash(Txt[t], {read}) priority 20",
                        "forbid Txt[t] in Set(1) priority 7",
                    ]
                ),
                max_size=3,
                unique=True,
            )
        )
        target = "Txt"
    src += [f"constraint C{i}: {c}" for i, c in enumerate(cons)]
    src.append(f"commit {target}[*] using satisfy(max_constraints_then_score)")
    src += [
        "rule S:",
        "  on MaskPlan",
        f'  emit proposal MaskPlan := SampleTiles(strategy="{schedule}", epoch=e{tiles})',
    ]
    return "\n".join(src) + "\n", {
        "target": target,
        "seed": draw(st.integers(0, 3)),
        "epochs": draw(st.integers(1, 5)),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_vectorized_runtime_equals_reference(case: tuple[str, dict[str, Any]]) -> None:
    src, info = case
    front = compile_source(src, raise_errors=False)
    assert not front.errors, (src, [d.render() for d in front.errors])
    run = Run(front, bindings=BINDINGS, seed=info["seed"])
    ref = Reference(front.ir, bindings=BINDINGS, seed=info["seed"])
    for _ in range(info["epochs"]):
        rec = run.engine.step()
        commits = ref.step()
        assert rec.commits == commits, src
    name = info["target"]
    state = run.engine.state[name]
    got = torch.where(state.committed, run.payload(name), -1).tolist()
    want = [p if c else -1 for p, c in zip(ref.payload[name], ref.committed[name])]
    assert got == want, src
    assert state.clock.tolist() == ref.clock[name], src


MULTI_READ = """
param W = 4
param H = 3
value G : Token[5] shape Grid2D(W, H)
value S : Token[5] shape Grid2D(W, H)
value MaskPlan : Event shape Set()
visible G[x, y] <- G[x+dx, y+dy] when (dx, dy) in N4
visible G[x, y] <- G[x, *]
visible G[x, y] <- S[x+1, y]
rule R:
  on G[x, y]
  read {nb in N4, col = G[x, *], s = S[x+1, y]}
  emit proposal G[x, y] := Echo(nb, col, s, k=2)
constraint Low: require G[x, y] in Set(0..3) priority 5
constraint Lock: forbid change(G[0..1, y]) priority 50
commit G[*] using satisfy(max_constraints_then_score)
rule Sch:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="{strategy}", epoch=e)
"""


@pytest.mark.parametrize("strategy", ["all", "red-black", "raster"])
def test_clocks_of_several_reads_of_one_source_equal_reference(strategy: str) -> None:
    # Two reads of G (merged into one clock gather, invalid entries pointing at the cell itself)
    # and one of S (an input with unset cells; out of bounds at x = W-1).
    front = compile_source(MULTI_READ.replace("{strategy}", strategy), raise_errors=False)
    assert not front.errors, [d.render() for d in front.errors]
    run = Run(front, bindings=BINDINGS, seed=1)
    ref = Reference(front.ir, bindings=BINDINGS, seed=1)
    given: list[int | None] = [None if i % 3 == 0 else i % 5 for i in range(12)]
    run.set_input(
        "S",
        torch.tensor([-1 if v is None else v for v in given]),
        torch.tensor([v is not None for v in given]),
    )
    ref.set_input("S", given)
    # Invalid entries of the gather tables hold index 0: a high clock there must not count (and
    # S[0, 0] is never read: no G[-1, 0]).
    for value in ("G", "S"):
        run.engine.state[value].clock[0] = 100
        ref.clock[value][0] = 100
    for _ in range(6):
        assert run.engine.step().commits == ref.step()
        state = run.engine.state["G"]
        got = torch.where(state.committed, run.payload("G"), -1).tolist()
        assert got == [p if c else -1 for p, c in zip(ref.payload["G"], ref.committed["G"])]
        assert state.clock.tolist() == ref.clock["G"]
