"""Models that opt in to compilation (``lmpm_compile``) run compiled under ``Run(compile=True)``
and never otherwise, commit what the eager run commits, and fall back to eager, with one warning
line naming the rule, when they cannot compile (lmpm.models.compile, docs/models.md).

Most tests compile through dynamo with a counting backend (no code generation: fast); one compiles
a small module with inductor, and one the built-in ByteLM on its smallest bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import lmpm
from lmpm.bindings import COMPILE_ATTR, Bindings, compile_flag, load_module
from lmpm.errors import BindError, ModelError
from lmpm.ir import compile_file, compile_source
from lmpm.models import text, video
from lmpm.models.compile import CompiledModel
from lmpm.runtime.session import Run

ROOT = Path(__file__).resolve().parents[2]

PROG = """param N = 8
value Txt : Token[Byte] shape Seq(N)
visible Txt[t] <- Txt[0..t-1] when t > 0
rule Gen:
  on Txt[t]
  read {ctx = Txt[0..t-1]}
  emit proposal Txt[t] := Tiny(ctx)
  score TinyScore(...)
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="raster", k=1)
value MaskPlan : Event shape Set() clock Lamport
"""


class Tiny(nn.Module):
    """Next byte = a deterministic function of the committed context (integer arithmetic only,
    so inductor computes exactly what eager does); its score = the mean of the read bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 4)
        self.register_buffer("mult", torch.tensor([3, 5, 7, 11]))

    def forward(self, inputs: dict[str, Tensor], **_: Any) -> dict[str, Tensor]:
        ctx, mask = inputs["ctx"].long(), inputs["ctx_mask"]
        seen = torch.where(mask, ctx, torch.zeros_like(ctx))
        mixed = (seen[:, :, None] * self.mult + inputs["cells"][:, None, None]).sum((1, 2))
        return {"proposal": 97 + mixed % 26, "score": seen.float().mean(1)}


def tiny_score(inputs: dict[str, Tensor], **_: Any) -> Tensor:
    return inputs["proposal"].float() * 0.5


def run_tiny(model: Any, score: Any = tiny_score, *, compile: bool) -> tuple[Run, Any]:
    front = compile_source(PROG, bound_names={"Tiny", "TinyScore"})
    run = Run(front, bindings={"Tiny": model, "TinyScore": score}, compile=compile)
    return run, run.run(until_stable=True)


class Counting:
    """A dynamo backend that counts the graphs it is handed and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example: Any) -> Callable[..., Any]:
        self.graphs += 1
        return gm.forward


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Counting:
    """``torch.compile`` as the worker calls it, with a counting backend instead of inductor."""
    backend = Counting()
    compile_ = torch.compile

    def with_backend(fn: Any, **kw: Any) -> Any:
        return compile_(fn, backend=backend, **kw)

    monkeypatch.setattr(torch, "compile", with_backend)
    torch._dynamo.reset()
    return backend


def test_flag_by_decorator_and_by_attribute() -> None:
    def plain(inputs: dict[str, Tensor], **_: Any) -> Tensor:
        return inputs["cells"]

    assert compile_flag(plain) is False

    @lmpm.bind("Flagged", compile=True)
    def flagged(inputs: dict[str, Tensor], **_: Any) -> Tensor:
        return inputs["cells"]

    def factory() -> Any:
        return plain

    @lmpm.bind("Built", compile=factory)
    def built(inputs: dict[str, Tensor], **_: Any) -> Tensor:
        return inputs["cells"]

    assert getattr(flagged, COMPILE_ATTR) is True and compile_flag(flagged) is True
    assert compile_flag(built) is factory
    by_hand = Tiny()
    by_hand.lmpm_compile = True  # what an LMPM_BINDINGS dict or bindings= mapping does
    assert compile_flag(by_hand) is True
    assert compile_flag(Bindings(mapping={"Tiny": by_hand}).get("Tiny")) is True
    with pytest.raises(BindError) as err:
        lmpm.bind("Len", compile=True)(len)
    assert err.value.code == "B015"


def test_flag_in_a_bind_module(tmp_path: Path) -> None:
    mod = tmp_path / "mine.py"
    mod.write_text(
        "import lmpm\n"
        "@lmpm.bind('A', compile=True)\n"
        "def a(inputs, **kw):\n    return inputs['cells']\n"
        "def b(inputs, **kw):\n    return inputs['cells']\n"
        "b.lmpm_compile = True\n"
        "def c(inputs, **kw):\n    return inputs['cells']\n"
        "LMPM_BINDINGS = {'B': b, 'C': c}\n"
    )
    names = load_module(str(mod))
    assert {k: compile_flag(v) for k, v in names.items()} == {"A": True, "B": True, "C": False}


def test_a_flagged_module_runs_compiled_only_under_compile(counting: Counting) -> None:
    model = Tiny()
    model.lmpm_compile = True
    eager, res_e = run_tiny(model, compile=False)
    assert counting.graphs == 0 and not eager.dataplane.models
    compiled, res_c = run_tiny(model, compile=True)
    wrapper, score = compiled.dataplane.models[compiled.plan.rules[0].id]
    assert isinstance(wrapper, CompiledModel) and score is tiny_score  # the score did not opt in
    assert wrapper.calls == res_c.epochs - 1 and wrapper.failed is None  # every epoch but the last
    assert counting.graphs >= 1  # dynamo traced the module's forward
    assert (res_e.epochs, res_e.commits) == (res_c.epochs, res_c.commits)
    assert torch.equal(eager.payload("Txt"), compiled.payload("Txt"))
    for a, b in zip(res_e.records, res_c.records):
        assert [torch.equal(x.score, y.score) for x, y in zip(a.values, b.values)] == [True] * len(
            a.values
        )


def test_a_flagged_score_runs_compiled(counting: Counting) -> None:
    score = lambda inputs, **kw: tiny_score(inputs)  # noqa: E731
    score.lmpm_compile = True  # type: ignore[attr-defined]
    run, res = run_tiny(Tiny(), score, compile=True)
    model, wrapper = run.dataplane.models[run.plan.rules[0].id]
    assert isinstance(model, Tiny)  # the model did not opt in
    assert isinstance(wrapper, CompiledModel) and wrapper.role == "score"
    assert wrapper.calls == res.epochs - 1 and counting.graphs >= 1


def test_inductor_compiles_a_module_and_commits_the_same() -> None:
    """The real thing: inductor generates code for the module (a few seconds)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = Tiny()
    eager, res_e = run_tiny(model, compile=False)
    model.lmpm_compile = True
    before = counters["frames"]["ok"]
    compiled, res_c = run_tiny(model, compile=True)
    assert counters["frames"]["ok"] > before
    wrapper = compiled.dataplane.models[compiled.plan.rules[0].id][0]
    assert wrapper.failed is None and wrapper.calls == res_c.epochs - 1
    assert torch.equal(eager.payload("Txt"), compiled.payload("Txt"))
    assert (res_e.epochs, res_e.commits) == (res_c.epochs, res_c.commits)


def test_a_model_that_cannot_compile_runs_eagerly_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(gm: torch.fx.GraphModule, example: Any) -> Any:
        raise RuntimeError("no code for this graph")

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend=broken, **kw))
    torch._dynamo.reset()
    model = Tiny()
    model.lmpm_compile = True
    eager, res_e = run_tiny(model, compile=False)
    run, res = run_tiny(model, compile=True)
    err = capsys.readouterr().err
    wrapper = run.dataplane.models[run.plan.rules[0].id][0]
    assert wrapper.failed is not None and wrapper.calls == 0
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1  # once, not every epoch
    assert "rule `Gen`" in warnings[0] and "Tiny" in warnings[0] and "runs eagerly" in warnings[0]
    assert "no code for this graph" in warnings[0]  # what dynamo's error wraps
    assert torch.equal(eager.payload("Txt"), run.payload("Txt"))
    assert res.commits == res_e.commits


def test_a_factory_that_fails_runs_eagerly_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def fails() -> Any:
        raise NotImplementedError("no compiled version on this machine")

    model = Tiny()
    model.lmpm_compile = fails
    run, res = run_tiny(model, compile=True)
    err = capsys.readouterr().err
    assert "rule `Gen`: its model" in err and "NotImplementedError" in err
    assert run.dataplane.models[run.plan.rules[0].id][0].failed is not None
    assert res.commits > 0


def test_the_models_own_error_is_a_model_error_not_a_fallback(
    counting: Counting, capsys: pytest.CaptureFixture[str]
) -> None:
    class Raises(Tiny):
        def forward(self, inputs: dict[str, Tensor], **_: Any) -> dict[str, Tensor]:
            raise ValueError("bad context")

    model = Raises()
    model.lmpm_compile = True
    with pytest.raises(ModelError) as err:
        run_tiny(model, compile=True)
    assert err.value.code == "R050" and "rule 'Gen'" in str(err.value)
    assert "bad context" in str(err.value)
    assert "warning:" not in capsys.readouterr().err


def test_builtin_flags() -> None:
    """ByteLM and TextScore opt in (faster in the text example); the video models do not (their
    compiled forward is slower in the video example: docs/models.md)."""
    assert compile_flag(text.byte_lm) is text.compiled_byte_lm
    assert compile_flag(text.text_score) is text.compiled_text_score
    for fn in (video.local_gen, video.model_score, video.coarse_gen):
        assert compile_flag(fn) is False


def test_compiled_bytelm_commits_the_same_bytes() -> None:
    """The text example with ByteLM compiled: the same bytes, scores within 1e-4 (6 epochs: one
    context bucket, one graph)."""
    front = compile_file(ROOT / "examples" / "text.lmpm")
    prompt = {"Txt": str(ROOT / "examples" / "text" / "prompt.txt")}
    eager, compiled = Run(front, inputs=prompt), Run(front, inputs=prompt, compile=True)
    re_, rc = eager.run(6), compiled.run(6)
    model, score = compiled.dataplane.models[compiled.plan.rules[0].id]
    assert model.calls == 6 and model.failed is None and score.failed is None
    assert torch.equal(eager.payload("Txt"), compiled.payload("Txt"))
    for a, b in zip(re_.records, rc.records):
        for x, y in zip(a.values, b.values, strict=True):
            assert torch.equal(x.winner, y.winner)
            assert torch.allclose(x.score, y.score, atol=1e-4, rtol=0)
    es, cs = eager.engine.state["Txt"].score, compiled.engine.state["Txt"].score
    assert torch.allclose(es, cs, atol=1e-4, rtol=0)


def test_compiled_video_model_matches_eager() -> None:
    """The video factories (not opted in by default) pad the cells to a power of two and give
    the eager log-probs within 1e-4."""
    g = torch.Generator().manual_seed(0)
    n = 5  # bucket 8: three padding rows
    inputs = {
        "cells": torch.arange(n),
        "coords": torch.randint(0, 8, (n, 3), generator=g),
        "neighbors": torch.randint(0, 16, (n, 8), generator=g),
        "neighbors_mask": torch.rand(n, 8, generator=g) < 0.5,
        "prev_frame": torch.randint(0, 16, (n, 1), generator=g),
        "prev_frame_mask": torch.ones(n, 1, dtype=torch.bool),
        "txt": torch.tensor(list(b"a red square")).expand(n, -1),
        "txt_mask": torch.ones(n, 12, dtype=torch.bool),
    }
    eager = video.local_gen(inputs, vocab=16)["logits"]
    again = {k: v.clone() for k, v in inputs.items()}  # fresh tensors: no cached forward
    compiled = video.compiled_local_gen()(again, vocab=16)["logits"]
    assert compiled.shape == (n, 16)
    assert torch.allclose(eager, compiled, atol=1e-4, rtol=0)
