"""The compiled epoch step (``--compile``, lmpm.runtime.data.compiled) commits exactly what the eager
epoch commits: the payload, the clocks and provenance, why cells stay unset, and every epoch's
record (candidates, scores, verdicts, winners), on the examples and on random programs.

Each distinct step (value × shape bucket) is compiled once per process and found in inductor's
on-disk cache afterwards; the programs here are small so the whole file stays within a couple
of minutes on two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from lmpm.bindings import COMPILE_ATTR
from lmpm.errors import UsageError
from lmpm.ir import compile_file, compile_source
from lmpm.models import text
from lmpm.models.null import random_tokens, zero_score
from lmpm.runtime.data.compiled import Graph, bucket, eligibility
from lmpm.runtime.records import RunResult
from lmpm.runtime.session import Run, resume
from lmpm.workers.simcuda import simulated_cuda

sys.path.insert(0, str(Path(__file__).parent))
from test_runtime_differential import BINDINGS, programs, used

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"
FIELDS = (
    "cells",
    "valid",
    "score",
    "col_rule",
    "violated",
    "constraint_ids",
    "winner",
    "changed",
    "new_clock",
    "was_committed",
    "applies",
    "checksum",
)


# Compiled built-in models score within this of their eager scores (docs/models.md)
SCORE_TOL = 1e-4


def _equal(p: torch.Tensor, q: torch.Tensor, scores: bool, tol: float) -> bool:
    if scores and tol:
        return bool(torch.allclose(p, q, rtol=0.0, atol=tol, equal_nan=True))
    return torch.equal(p, q)


def same_runs(a: Run, ra: RunResult, b: Run, rb: RunResult, tol: float = 0.0) -> None:
    """Two runs of one program committed the same things, epoch by epoch (``tol``: scores may
    differ by this much, everything else is exact)."""
    assert (ra.epochs, ra.commits, ra.attempts) == (rb.epochs, rb.commits, rb.attempts)
    assert len(ra.records) == len(rb.records)
    for x, y in zip(ra.records, rb.records):
        assert (x.epoch, x.open_cells, x.commits, x.attempts, x.violations) == (
            y.epoch,
            y.open_cells,
            y.commits,
            y.attempts,
            y.violations,
        )
        assert [v.value for v in x.values] == [v.value for v in y.values]
        for vx, vy in zip(x.values, y.values):
            for f in FIELDS:
                p, q = getattr(vx, f), getattr(vy, f)
                assert (p is None) == (q is None), (x.epoch, vx.value, f)
                if p is not None:
                    assert _equal(p, q, f == "score", tol), (x.epoch, vx.value, f, p, q)
    for name in a.plan.values:
        assert torch.equal(a.payload(name), b.payload(name)), name
        for f in ("committed", "clock", "rule", "epoch", "score"):
            p, q = getattr(a.engine.state[name], f), getattr(b.engine.state[name], f)
            assert _equal(p, q, f == "score", tol), (name, f)
    for name, why in a.engine.why.items():
        assert torch.equal(why, b.engine.why[name]), name


def both(
    make: Any, epochs: int | None = None, tol: float = 0.0
) -> tuple[Run, RunResult, Run, RunResult]:
    eager, compiled = make(False), make(True)
    assert compiled.engine.compiled is not None and eager.engine.compiled is None
    re_, rc = eager.run(epochs), compiled.run(epochs)
    same_runs(eager, re_, compiled, rc, tol)
    return eager, re_, compiled, rc


def step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile the epoch step, not the built-in text models: their compiled forward moves the
    float scores in the last bits (tokens stay identical: tests/models/test_model_compile.py)."""
    for fn in (text.byte_lm, text.text_score):
        monkeypatch.delattr(fn, COMPILE_ATTR)


def test_text_example(monkeypatch: pytest.MonkeyPatch) -> None:
    step_only(monkeypatch)
    front = compile_file(EX / "text.lmpm")
    prompt = str(EX / "text" / "prompt.txt")
    _, _, run, res = both(lambda c: Run(front, inputs={"Txt": prompt}, compile=c))
    stats = run.engine.compiled.stats  # type: ignore[union-attr]
    assert stats.steps == res.epochs - 1  # every epoch but the last (nothing left to open)
    assert stats.eager_epochs == 0
    assert stats.buckets == {"Txt": {1}}  # one open cell: one graph, no recompilation
    assert run.engine.compiled.summary().startswith("compiled 1 of 1 values")  # type: ignore[union-attr]


def test_step_holds_its_inputs_and_checks_a_new_tensor_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step's graph asserts no input shape per call (compile_graph(guarded=True)): its Graph
    holds the run's tensors by identity. A new tensor there (a restore) with the same signature
    is checked once and held, nothing recompiled, the commits unchanged; the held tensor is the
    one the step then writes."""
    step_only(monkeypatch)
    front = compile_file(EX / "text.lmpm")
    prompt = str(EX / "text" / "prompt.txt")
    _, _, run, _ = both(lambda c: Run(front, inputs={"Txt": prompt}, compile=c), epochs=12)
    again = Run(front, inputs={"Txt": prompt}, compile=True)
    again.run(6)
    compiled = again.engine.compiled
    assert compiled is not None
    compiles = compiled.stats.compiles
    st = again.engine.dataplane.owner.state["Txt"]
    st.clock = st.clock.clone()  # as a restore replaces it: same shape, another tensor
    assert again.run(12).epochs == 6  # (run(n): up to epoch n)
    assert compiled.stats.compiles == compiles
    (g,) = compiled._fns.values()
    assert any(t is st.clock for t in g.held)
    assert torch.equal(st.clock, run.engine.dataplane.owner.state["Txt"].clock)
    assert torch.equal(again.engine.dataplane.payload["Txt"], run.engine.dataplane.payload["Txt"])


def test_graph_refuses_inputs_of_another_signature() -> None:
    """A Graph held to its inputs: the same tensors hold; a new one of the same signature is
    held after one full check; one of another shape or stride is refused (the caller compiles a
    graph for it)."""
    args = [torch.zeros(4), torch.ones(8, dtype=torch.int64), torch.ones(3, 2)]
    g = Graph(lambda *ts: ts, args, 1)
    assert g.holds([torch.zeros(4), *args[1:]])  # (the per-call head is not held)
    other = [args[0], args[1].clone(), args[2]]
    assert not g.holds(other)
    assert g.check(other) and g.holds(other) and not g.holds(args)
    assert not g.check([args[0], torch.ones(9, dtype=torch.int64), args[2]])
    assert not g.check([args[0], args[1], torch.ones(2, 3).t()])  # same shape, another stride
    assert g.holds(other)  # a refused check holds nothing new


def test_a_graph_holding_a_constant_keeps_its_wrappers() -> None:
    """A traced step that makes a tensor constant (``torch.tensor`` inside the trace) compiles to a
    graph whose ``call`` takes the constant as an extra input only the wrappers pass: it is kept
    wrapped (called bare it would read past its inputs) and computes what eager computes."""
    from lmpm.runtime.data.compiled import compile_graph

    def make() -> Any:
        def step(x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x * torch.tensor([2.0, 3.0, 5.0]),)

        return step

    x = torch.arange(3, dtype=torch.float32)
    fn, gm, _ = compile_graph(("test-constant", 3), make, [x])
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    assert getattr(fn, "__name__", "") != "direct"
    assert torch.equal(fn(x)[0], torch.tensor([0.0, 3.0, 10.0]))


VIDEO = {"Model": random_tokens, "CoarseGen": random_tokens, "ModelScore": zero_score}


def _video(t: int, w: int, h: int, seed: int, backend: str = "cpu") -> Any:
    p = {"T": t, "W": w, "H": h, "N": 16, "x1": 0, "x2": 1, "y1": 0, "y2": 1}
    front = compile_file(EX / "video.lmpm", overrides=p)

    def make(compile: bool) -> Run:
        run = Run(front, params=p, bindings=VIDEO, seed=seed, compile=compile, backend=backend)
        text = torch.tensor(list(b"a red square under a blue sky"[:16]))
        run.set_input("Txt", text, torch.ones(16, dtype=torch.bool))
        return run

    return make


def test_video_example_padded_buckets() -> None:
    """3 frames of 8×8: red-black opens 96 of 192 cells (padded to 128), the coarse plan 1 or 2
    of 3."""
    _, res, run, _ = both(_video(3, 8, 8, seed=1), epochs=6)
    assert res.commits > 0
    stats = run.engine.compiled.stats  # type: ignore[union-attr]
    assert stats.buckets["Vid"] == {bucket(96)} == {128}
    assert stats.eager_epochs == 0
    # the run calls each graph itself, not through compile_fx's Python wrappers (checked equal
    # once on copies; a torch upgrade that moves the graph falls back to the wrappers silently)
    fns = run.engine.compiled._fns.values()  # type: ignore[union-attr]
    assert fns and all(getattr(g.fn, "__name__", "") == "direct" for g in fns)
    # ... and its C++ entry itself, past the Python loop over the inputs of inductor's `call`
    assert all(g.call is not None and g.call.__name__ == "bare" for g in fns)


def test_compiled_read_gathers_give_the_model_what_eager_gathers() -> None:
    """Under --compile LMPM's own models get their non-uniform reads from one compiled graph per
    rule and open-cell bucket: the same tensors as the eager gathers, padded buckets included."""
    run = _video(3, 8, 8, seed=1)(True)
    run.run(3)  # some cells committed, some not: masks differ across reads
    dp = run.engine.dataplane
    g = dp.inputs
    assert g.read_gathers is not None
    gathers, g.read_gathers = g.read_gathers, None
    assert g.trusted == {rp.id for rp in run.plan.rules}  # LMPM's own models: no copies
    for rp in run.plan.rules:
        n = run.plan.values[rp.target].ncells
        for cells in (torch.arange(0, n, 2), torch.arange(n), torch.tensor([1, 5, 6])):
            g.read_gathers = None
            want = g.gather(rp, cells)
            g.read_gathers = gathers
            got = g.gather(rp, cells)
            assert want.keys() == got.keys()
            for k in want:
                assert torch.equal(want[k], got[k]), (rp.name, k)
    assert gathers.stats is run.engine.compiled.stats  # type: ignore[union-attr]
    assert gathers._fns


def test_sudoku_mixed_eager_and_compiled_values(tmp_path: Path) -> None:
    """Grid's constraints are Python predicates (eager); Cand compiles: the values commit in
    program order either way, so the clocks Grid reads from Cand agree."""
    front = compile_file(EX / "sudoku.lmpm")
    puzzle = json.loads((EX / "sudoku" / "puzzles.json").read_text())[0]["puzzle"]
    (tmp_path / "p.json").write_text(json.dumps(puzzle))

    def make(compile: bool) -> Run:
        return Run(front, seed=0, inputs={"Grid": tmp_path / "p.json"}, compile=compile)

    _, res, run, _ = both(make)
    ce = run.engine.compiled
    assert ce is not None and set(ce.specs) == {"Cand"}
    assert "predicate" in str(ce.reasons["Grid"])
    assert res.stable


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs(case: tuple[str, dict[str, Any]]) -> None:
    src, kw = case
    front = compile_source(src, raise_errors=False)
    assert not front.errors
    bindings = used(front, BINDINGS)
    both(lambda c: Run(front, bindings=bindings, seed=kw["seed"], compile=c), kw["epochs"])


def test_tracing_candidates_runs_those_epochs_eagerly(tmp_path: Path) -> None:
    """`--trace cells` records every candidate table: those epochs run eagerly, and the logs of
    a compiled and an eager run hold the same commits and candidates."""
    make = _video(2, 8, 8, seed=2)
    logs = {}
    for compile in (False, True):
        run = make(compile)
        run.log_to(tmp_path / str(compile), source="", trace="cells")
        run.run(3)
        run.finish()
        if compile:
            assert run.engine.compiled.stats.eager_epochs == 3  # type: ignore[union-attr]
        import sqlite3

        conn = sqlite3.connect(tmp_path / str(compile) / "lmpm.db")
        logs[compile] = [
            conn.execute(f"select * from {t} order by 1, 2, 3").fetchall()
            for t in ("commits", "trace_candidates")
        ]
        conn.close()
    assert logs[False] == logs[True] and logs[False][0]


def test_resume_a_compiled_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled run stopped after 10 epochs and resumed compiled ends where an eager run does
    (the step writes the payload store and the log like the eager epoch)."""
    step_only(monkeypatch)
    program = EX / "text.lmpm"
    front = compile_file(program)
    prompt = {"Txt": str(EX / "text" / "prompt.txt")}
    first = Run(front, inputs=prompt, compile=True)
    first.log_to(tmp_path / "r", source=program.read_text(), checkpoint_every=4)
    first.run(10)
    first.finish()
    again = resume(tmp_path / "r", compile=True)
    assert again.restored is not None and again.restored.epoch == 10
    res = again.run(until_stable=True)
    again.finish()
    eager = Run(front, inputs=prompt)
    want = eager.run()
    assert again.engine.epoch == want.epochs and res.stable
    assert torch.equal(again.payload("Txt"), eager.payload("Txt"))
    for f in ("committed", "clock", "rule", "epoch", "score"):
        assert torch.equal(
            getattr(again.engine.state["Txt"], f), getattr(eager.engine.state["Txt"], f)
        )


def test_eligibility_names_why_a_value_runs_eagerly() -> None:
    """Several rules compile (latent's M); a bound Python predicate is an eager island (Z)."""
    src = (EX / "latent.lmpm").read_text()
    front = compile_source(src)
    run = Run(front, compile=True)
    reasons = run.engine.compiled.reasons  # type: ignore[union-attr]
    assert reasons["M"] is None
    assert "predicate" in str(reasons["Z"])
    assert eligibility(run.plan, "Z") == reasons["Z"]


def test_a_user_policy_is_an_eager_island(monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy the user registered is Python code: the value runs eagerly (alone or inside a
    quorum), and coverage counts it as allowed and names the island."""
    from lmpm.resolve import policies
    from lmpm.runtime.data.coverage import coverage

    monkeypatch.setitem(
        policies.POLICIES,
        "first_proposal",
        lambda a, *_: policies.Decision(torch.where(a.valid[:, 1:].any(dim=1), 1, 0)),
    )
    for using in ("first_proposal", "quorum(2, first_proposal)"):
        src = (
            "value A : Token[4] shape Seq(3)\n"
            "rule R:\n  on A[t]\n  emit proposal A[t] := Uniform()\n"
            f"commit A[*] using {using}\n"
        )
        run = Run(compile_source(src), compile=True)
        assert "`first_proposal` is user Python code" in str(eligibility(run.plan, "A")), using
        cov = coverage(run.plan)
        assert cov.holds and not cov.values[0].compiled
        assert "policy first_proposal (commit A, decides A)" in [i.text() for i in cov.islands]
        run.run(3)
        run.close()


def test_compile_needs_one_worker_in_this_process() -> None:
    front = compile_file(EX / "text.lmpm")
    with pytest.raises(UsageError) as err:
        Run(front, workers=2, driver="process", compile=True)
    assert err.value.code == "U101"


def test_cli_compile_writes_what_eager_writes(tmp_path: Path) -> None:
    prompt = str(EX / "text" / "prompt.txt")
    out = {}
    for flag in ([], ["--compile"]):
        d = tmp_path / ("c" if flag else "e")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "lmpm.cli",
                "run",
                str(EX / "text.lmpm"),
                "--input",
                f"Txt={prompt}",
                "--out",
                str(d),
                "--quiet",
                *flag,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        if flag:
            assert "compiled 1 of 1 values" in proc.stderr
        out[bool(flag)] = (d / "Txt.json").read_text()
    assert out[True] == out[False]


@pytest.mark.parametrize(
    ("program", "inputs", "epochs"),
    [
        ("gpt.lmpm", {"Txt": "text/prompt.txt"}, 6),
        ("text_free.lmpm", {"Txt": "text/prompt.txt"}, 8),
        ("video.lmpm", {"Txt": "video/caption.txt", "Vid": "video/patch.npy"}, 3),
        ("video_free.lmpm", {"Txt": "video/caption.txt"}, 3),
        ("latent.lmpm", {"Z": "latent/z0.npy"}, 3),
    ],
)
def test_the_other_examples(program: str, inputs: dict[str, str], epochs: int) -> None:
    """Every example program with its own models and inputs, the built-in text models compiled
    too (their scores within SCORE_TOL, every committed token the same; latent's values both
    run eagerly: an aggregating policy and a Python predicate)."""
    front = compile_file(EX / program)
    paths = {k: str(EX / v) for k, v in inputs.items()}
    both(lambda c: Run(front, inputs=paths, seed=0, compile=c), epochs, SCORE_TOL)


_SEVERAL = """param N = 8
value Txt : Token[3] shape Seq(N)
value MaskPlan : Event shape Set()
visible Txt[t] <- Txt[0..t-1] when t > 0
rule A:
  on Txt[t]
  read {r = Txt[0..t-1]}
  emit proposal Txt[t] := Uniform(r, k=2)
rule B:
  on Txt[t] when t > 3
  emit proposal Txt[t] := Uniform()
constraint Low: forbid Txt[t] in Set(0) priority 5
commit Txt[*] using POLICY
rule S:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="raster", epoch=e, k=3)
"""


def _several_rules(policy: str, seed: int, compile: bool, backend: str) -> Run:
    front = compile_source(_SEVERAL.replace("POLICY", policy))
    return Run(front, bindings=used(front, BINDINGS), seed=seed, compile=compile, backend=backend)


def _several_rules_agree(policy: str, backend: str) -> int:
    """Compiled and eager runs of two rules (one guarded: it fires on some open cells only) under
    ``policy`` record the same epochs, disagreements and outvoted replicas; how many of the
    latter the runs recorded."""
    outvoted = 0
    for seed in range(3):
        eager = _several_rules(policy, seed, False, "cpu")
        compiled = _several_rules(policy, seed, True, backend)
        ce = compiled.engine.compiled
        assert ce is not None and ce.compiles("Txt")
        re_, rc = eager.run(6), compiled.run(6)
        same_runs(eager, re_, compiled, rc)
        assert ce.stats.steps and not ce.stats.eager_epochs
        for x, y in zip(re_.records, rc.records):
            # (the worker is named after its device: cpu:0, simcuda:0)
            assert [(d.value, d.replica, d.cells) for d in x.dissent] == [
                (d.value, d.replica, d.cells) for d in y.dissent
            ], (seed, x.epoch)
            outvoted += len(x.dissent)
            for vx, vy in zip(x.values, y.values):
                dx, dy = vx.disagreed, vy.disagreed
                assert (dx is None) == (dy is None) and (dx is None or torch.equal(dx, dy))
    return outvoted


@pytest.mark.parametrize(
    "policy",
    [
        "satisfy(max_constraints_then_score)",
        "winner_takes_all",
        "quorum(2 of 3, satisfy)",
        "quorum(2, winner_takes_all)",
    ],
)
def test_several_rules_and_quorum_replicas_compile(policy: str) -> None:
    """Several rules per value and a quorum's replicas inside the compiled step (captured on the
    simulated GPU): the records, metadata, why-codes, disagreements (NO_QUORUM) and outvoted
    replicas equal eager's; Uniform's replicas draw differently, so 2 of 3 outvotes some (2 of 2
    cannot: a commit needs both)."""
    with simulated_cuda():
        outvoted = _several_rules_agree(policy, "simcuda")
    assert outvoted > 0 if " of " in policy else outvoted == 0


@pytest.mark.slow
def test_several_rules_and_quorum_compiled_by_inductor() -> None:
    """The same with inductor's step on the CPU, which writes the owner's metadata itself."""
    assert _several_rules_agree("quorum(2 of 3, satisfy)", "cpu") > 0
