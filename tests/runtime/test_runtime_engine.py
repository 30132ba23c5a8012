"""The epoch loop: schedules, Lamport clocks, snapshot semantics, faults, inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmpm.errors import ConstraintEvalError, InputError, LmpmError, ModelError
from lmpm.resolve.schedules import color_graph
from lmpm.runtime.data.checks import CandidateTable
from lmpm.runtime.session import Run
from lmpm.visibility.gather import visible_union

GRID = """
param W = 6
param H = 5
value G : Token[4] shape Grid2D(W, H)
value MaskPlan : Event shape Set()
visible G[x, y] <- G[x+dx, y+dy] when (dx, dy) in N8
rule R:
  on G[x, y]
  read {nb in N8}
  emit proposal G[x, y] := {model}
commit G[*] using satisfy(max_constraints_then_score)
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="{strategy}", epoch=e)
"""


def grid(strategy: str, model: str = "RandomTokens(nb)", **kw: Any) -> Run:
    return Run.from_source(GRID.replace("{strategy}", strategy).replace("{model}", model), **kw)


def test_red_black_never_opens_axis_neighbours_together() -> None:
    run = grid("red-black")
    for e in range(4):
        m = torch.zeros(30, dtype=torch.bool)
        m[run.engine.open_cells(e)["G"]] = True
        m = m.view(6, 5)
        assert not bool((m[1:, :] & m[:-1, :]).any()) and not bool((m[:, 1:] & m[:, :-1]).any())


def test_independent_never_opens_mutually_visible_cells_together() -> None:
    run = grid("independent")
    g = visible_union(run.plan.program, run.plan.env, "G", "G")
    colors = run.plan.colors["G"]
    for i in range(g.index.shape[0]):
        for j, ok in zip(g.index[i].tolist(), g.valid[i].tolist()):
            if ok and j != i:
                assert colors[i] != colors[j]
    assert int(colors.max()) + 1 <= 9  # an N8 grid needs 4; the greedy colouring stays small


def test_color_graph_handles_isolated_and_empty() -> None:
    idx = torch.zeros(3, 0, dtype=torch.int64)
    assert color_graph(idx, idx.bool()).tolist() == [0, 0, 0]


def test_all_cells_commit_and_clocks_follow_reads() -> None:
    run = grid("all")
    res = run.run(until_stable=True, max_epochs=20)
    assert res.stable
    st = run.engine.state["G"]
    assert bool(st.committed.all())
    # Epoch 0 reads only unset cells (clock 0): every clock becomes 1; later commits are 1 + max.
    assert int(st.clock.min()) >= 1


def test_lamport_clock_is_one_plus_max_of_reads() -> None:
    src = """
param N = 4
value A : Token[8] shape Seq(N)
visible A[t] <- A[t-1] when t > 0
rule R:
  on A[t]
  read {p = A[t-1]}
  emit proposal A[t] := Inc(p)
"""

    def inc(inputs: dict[str, torch.Tensor], *, epoch: int, **_: Any) -> dict[str, torch.Tensor]:
        p, m = inputs["p"], inputs["p_mask"]
        prop = torch.where(m[:, 0], p[:, 0] + 1, torch.zeros_like(p[:, 0])) % 8
        # Later opinions score higher, so they beat the committed value (keep wins ties).
        return {"proposal": prop, "score": torch.full(prop.shape, float(epoch))}

    run = Run.from_source(src, bindings={"Inc": inc})
    run.run(6)
    # A chain: each epoch one more cell sees its committed predecessor's final value.
    assert run.outputs()["A"].tolist() == [0, 1, 2, 3]
    assert run.engine.state["A"].clock.tolist()[0] >= 1
    clocks = run.engine.state["A"].clock.tolist()
    assert all(clocks[i + 1] > clocks[i] for i in range(3))


def test_snapshot_reads_make_epochs_order_independent() -> None:
    # Two rules on two values read each other; results must not depend on rule order.
    a = """
value A : Token[5] shape Seq(3)
value B : Token[5] shape Seq(3)
visible A[t] <- B[t]
visible B[t] <- A[t]
rule RA:
  on A[t]
  read {b = B[t]}
  emit proposal A[t] := Plus(b)
rule RB:
  on B[t]
  read {a = A[t]}
  emit proposal B[t] := Plus(a)
"""
    b = a.replace("rule RA:", "rule RX:").split("rule RB:")
    swapped = "rule RB:" + b[1] + "\n" + b[0][b[0].index("rule RX:") :]
    swapped = b[0][: b[0].index("rule RX:")] + swapped

    def plus(inputs: dict[str, torch.Tensor], **_: Any) -> torch.Tensor:
        (name,) = [k for k in inputs if k in ("a", "b")]
        v, m = inputs[name][:, 0], inputs[f"{name}_mask"][:, 0]
        return torch.where(m, v + 1, torch.ones_like(v)) % 5

    r1 = Run.from_source(a, bindings={"Plus": plus})
    r2 = Run.from_source(swapped, bindings={"Plus": plus})
    r1.run(3)
    r2.run(3)
    assert r1.outputs()["A"].tolist() == r2.outputs()["A"].tolist()
    assert r1.outputs()["B"].tolist() == r2.outputs()["B"].tolist()


def test_same_seed_same_commits_different_seed_differs() -> None:
    outs = []
    for seed in (1, 1, 2):
        run = grid("red-black", seed=seed)
        run.run(4)
        outs.append(run.outputs()["G"].tolist())
    assert outs[0] == outs[1] and outs[0] != outs[2]


@pytest.mark.parametrize("bad", ["nan", "shape", "vocab"])
def test_bad_model_output_is_attributed_and_commits_nothing(bad: str) -> None:
    def model(inputs: dict[str, torch.Tensor], **_: Any) -> Any:
        n = inputs["cells"].shape[0]
        if bad == "nan":
            return {"logits": torch.full((n, 4), float("nan"))}
        if bad == "shape":
            return torch.zeros(n + 1, dtype=torch.int64)
        return torch.full((n,), 9, dtype=torch.int64)

    run = grid("all", model="Bad(nb)", bindings={"Bad": model})
    with pytest.raises(ModelError) as info:
        run.run(1)
    assert "R" in str(info.value) and "cells" in str(info.value)
    assert not bool(run.engine.state["G"].committed.any())
    assert run.engine.epoch == 0


def test_raising_predicate_names_the_constraint_and_its_line() -> None:
    src = GRID.replace("{strategy}", "all").replace("{model}", "RandomTokens(nb)")
    src += "constraint Odd: forbid Boom(G[x, y]) priority 3\n"

    def boom(ctx: Any) -> torch.Tensor:
        raise ValueError("kaput")

    run = Run.from_source(src, "prog.lmpm", bindings={"Boom": boom})
    with pytest.raises(ConstraintEvalError) as info:
        run.run(1)
    msg = str(info.value)
    assert "Odd" in msg and "kaput" in msg and "prog.lmpm:15" in msg


def test_input_errors_name_the_value_and_expected_shape(tmp_path: Path) -> None:
    bad = tmp_path / "g.json"
    bad.write_text(json.dumps([[0, 1]]))
    with pytest.raises(InputError, match=r"`G`.*6 entries"):
        grid("all", inputs={"G": str(bad)})
    big = tmp_path / "g.npy"
    np.save(big, np.full((6, 5), 7))
    with pytest.raises(InputError, match="outside the vocabulary"):
        grid("all", inputs={"G": str(big)})


def test_unknown_params_and_bindings_list_what_exists() -> None:
    with pytest.raises(LmpmError, match="H, W"):
        grid("all", params={"Q": 3})
    # an unbound model is found before epoch 0, located at the call (the strict checks of a run)
    with pytest.raises(LmpmError, match=r"E207.*`Nope` \(model\) is not bound"):
        grid("all", model="Nope(nb)")


def test_inputs_are_committed_and_locked_by_change() -> None:
    src = GRID.replace("{strategy}", "all").replace("{model}", "RandomTokens(nb)")
    src += "constraint Lock: forbid change(G[inputs()]) priority 9\n"
    given = torch.full((6, 5), -1)
    given[0, 0], given[3, 2] = 2, 1
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".npy", delete=False) as f:
        np.save(f, given.numpy())
    run = Run.from_source(src, inputs={"G": f.name})
    run.run(5)
    out = run.outputs()["G"]
    assert out[0, 0] == 2 and out[3, 2] == 1


def test_on_when_guard_limits_the_cells_a_rule_fires_on() -> None:
    src = """
value A : Token[4] shape Seq(6)
rule R:
  on A[t] when t > 1 and e < 3
  emit proposal A[t] := RandomTokens()
"""
    run = Run.from_source(src)
    run.run(5)
    committed = run.engine.state["A"].committed.tolist()
    assert committed == [False, False, True, True, True, True]
    assert int(run.engine.state["A"].epoch.max()) < 3  # nothing fires from epoch 3 on


def test_quorum_runs_replicas_and_commits_only_what_they_agree_on() -> None:
    src = """
value A : Token[50] shape Seq(8)
rule R:
  on A[t]
  emit proposal A[t] := {model}
commit A[*] using quorum(2, satisfy)
"""
    agreeing = Run.from_source(src.replace("{model}", "RandomTokens()"))
    assert [rp.replicas for rp in agreeing.plan.rules] == [2]
    agreeing.run(1)
    assert bool(agreeing.engine.state["A"].committed.all())  # deterministic replicas agree
    sampled = Run.from_source(src.replace("{model}", "Uniform()"))  # replicas draw their own noise
    sampled.run(1)
    assert not bool(sampled.engine.state["A"].committed.all())


def test_score_call_gets_the_inputs_the_rules_model_got() -> None:
    # Two rules: each score sees the very tensors its own model saw this epoch (models that
    # remember their last forward, like ByteLM and LocalGen, then need no second one).
    src = """
value A : Token[4] shape Seq(5)
value B : Token[4] shape Seq(5)
visible A[t] <- B[t]
visible B[t] <- A[t]
rule RA:
  on A[t]
  read {b = B[t]}
  emit proposal A[t] := Seen(b, k=2)
  score Check(...)
rule RB:
  on B[t]
  read {a = A[t]}
  emit proposal B[t] := Seen(a, k=2)
  score Check(...)
"""
    seen: dict[str, dict[str, torch.Tensor]] = {}
    checked: list[str] = []

    def model(inputs: dict[str, torch.Tensor], **_: Any) -> dict[str, torch.Tensor]:
        (name,) = [k for k in inputs if k in ("a", "b")]
        seen[name] = dict(inputs)
        n = inputs["cells"].shape[0]
        return {"proposal": torch.ones(n, 2, dtype=torch.int64), "score": torch.zeros(n, 2)}

    def check(inputs: dict[str, torch.Tensor], **_: Any) -> torch.Tensor:
        (name,) = [k for k in inputs if k in ("a", "b")]
        for key in ("cells", name, f"{name}_mask", f"{name}_index"):
            assert inputs[key] is seen[name][key], key
        checked.append(name)
        return torch.zeros(inputs["proposal"].shape, dtype=torch.float64)

    Run.from_source(src, bindings={"Seen": model, "Check": check}).run(2)
    assert checked == ["b", "a", "b", "a"]


SCORED = """
value A : Token[4] shape Seq(3)
rule R:
  on A[t]
  emit proposal A[t] := RandomTokens(k=2)
  score S(...)
"""


def test_scores_with_an_overflowing_sum_are_finite_and_nan_is_not() -> None:
    def scores(value: float) -> Any:
        def score(inputs: dict[str, torch.Tensor], **_: Any) -> torch.Tensor:
            return torch.full(inputs["proposal"].shape, value, dtype=torch.float64)

        return score

    run = Run.from_source(SCORED, bindings={"S": scores(1e308)})  # the sum overflows to inf
    run.run(1)
    assert bool(run.engine.state["A"].committed.all())
    with pytest.raises(ModelError, match=r"NaN/inf in .score."):
        Run.from_source(SCORED, bindings={"S": scores(float("nan"))}).run(1)


@pytest.mark.parametrize(
    ("bad", "code", "text"),
    [("raise", "R030", "raised ValueError: boom"), ("shape", "R031", "must be a float tensor")],
)
def test_a_failing_score_names_the_rule_and_the_worker_and_commits_nothing(
    bad: str, code: str, text: str
) -> None:
    def score(inputs: dict[str, torch.Tensor], **_: Any) -> torch.Tensor:
        if bad == "raise":
            raise ValueError("boom")
        return torch.zeros(inputs["proposal"].shape[0], dtype=torch.float64)  # (n,), not (n, k)

    run = Run.from_source(SCORED, bindings={"S": score})
    with pytest.raises(ModelError) as info:
        run.run(1)
    assert info.value.code == code and text in str(info.value)
    assert info.value.where["rule"] == "R" and info.value.where["worker"] == "cpu:0"
    span = info.value.span  # the `score S(...)` call in the source
    assert (
        span is not None
        and span.line == 6
        and SCORED.splitlines()[span.line - 1][span.col - 1 :].startswith("S(")
    )
    assert not bool(run.engine.state["A"].committed.any()) and run.engine.epoch == 0


def test_the_worker_scores_all_replicas_of_a_rule_in_one_call() -> None:
    calls: list[tuple[int, ...]] = []

    def score(inputs: dict[str, torch.Tensor], **kw: Any) -> torch.Tensor:
        calls.append((kw["epoch"], *inputs["proposal"].shape))
        return inputs["proposal"].double()  # the higher token wins

    src = SCORED + "commit A[*] using quorum(2, satisfy)\n"
    run = Run.from_source(src, bindings={"S": score})
    run.run(2)
    assert calls == [(0, 6, 2), (1, 6, 2)]  # 2 replicas x 3 cells, k=2 candidates, per epoch


@pytest.mark.parametrize("kind", ["require", "forbid"])
def test_set_constraints_put_out_of_vocabulary_payloads_in_no_set(kind: str) -> None:
    src = f"""
value A : Token[6] shape Seq(2)
rule R:
  on A[t]
  emit proposal A[t] := RandomTokens()
constraint S: {kind} A[t] in Set(0, 5) priority 3
"""
    run = Run.from_source(src)
    worker = run.dataplane
    cp = worker.tables["A"].constraints[0]
    table = worker.tables["A"].tables[0]
    payload = torch.tensor([[0, -7, -1, 5, 6, 99], [4, 0, 5, 1, 2, 3]])
    committed = torch.tensor([True, False])
    ct = CandidateTable(
        "A",
        run.plan.values["A"],
        0,
        torch.tensor([0, 1]),
        payload,
        torch.ones_like(payload, dtype=torch.bool),
        payload[:, 0],
        committed,
        True,
        True,
    )
    viol = worker.checks.violations(cp, ct, table)
    member = [[True, False, False, True, False, False], [False, True, True, False, False, False]]
    want = [[m == (kind == "forbid") for m in row] for row in member]
    want[1][0] = kind == "require"  # keep-current of the unset cell: in no set
    assert viol.tolist() == want
