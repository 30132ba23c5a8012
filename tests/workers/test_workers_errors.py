"""Error attribution: every kind of model fault is a ModelError naming rule, cells, backend, worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmpm.errors import ModelError
from lmpm.workers import WorkItem, get_backend

CELLS = torch.tensor([40, 41, 42, 43, 44, 45])


def run(model: Callable[..., Any], **item: Any) -> None:
    be = get_backend("cpu", worker="worker-3")
    h = be.dispatch(WorkItem("Txt.gen", model, {"x": torch.ones(6)}, CELLS, **item))  # never raises
    be.collect(h)


def assert_attributed(err: ModelError, cells: list[int]) -> None:
    text = str(err)
    assert err.where["rule"] == "Txt.gen" and "Txt.gen" in text
    assert err.where["backend"] == "cpu" and "backend=cpu" in text
    assert err.where["worker"] == "worker-3" and "worker-3" in text
    assert err.where["cells"] == cells and str(cells).rstrip("]") in text
    assert "Traceback" not in text


def with_row(value: float, row: int = 2) -> Callable[..., torch.Tensor]:
    def model(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        y = inputs["x"].clone()
        y[row] = value
        return y

    return model


@pytest.mark.parametrize("row", [0, 2, 5])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_proposal(value: float, row: int) -> None:
    # (first, middle and last row: the host's one-pass check must see each)
    with pytest.raises(ModelError, match="NaN/inf in 'proposal'") as e:
        run(with_row(value, row))
    assert_attributed(e.value, [40 + row])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_non_finite_proposal_any_float_dtype(dtype: torch.dtype) -> None:
    def model(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        y = inputs["x"].to(dtype)
        y[5] = float("nan")
        return y

    with pytest.raises(ModelError, match="NaN/inf in 'proposal'") as e:
        run(model, dtype=dtype)
    assert_attributed(e.value, [45])


def test_non_finite_score_names_only_bad_cells() -> None:
    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = torch.zeros(6)
        s[[1, 4]] = float("nan")
        return {"proposal": inputs["x"], "score": s}

    with pytest.raises(ModelError, match="NaN/inf in 'score' for 2 of 6 cells") as e:
        run(model)
    assert_attributed(e.value, [41, 44])


def test_wrong_leading_dim() -> None:
    with pytest.raises(ModelError, match="leading dim 6") as e:
        run(lambda inputs: inputs["x"][:5])
    assert_attributed(e.value, [40, 41, 42, 43])


def test_wrong_dtype_for_tokens() -> None:
    with pytest.raises(ModelError, match="must be an integer dtype") as e:
        run(lambda inputs: inputs["x"], vocab=10)
    assert_attributed(e.value, [40, 41, 42, 43])


def test_wrong_dtype_for_value() -> None:
    with pytest.raises(
        ModelError, match=r"dtype torch.float32; the value holds torch.float64"
    ) as e:
        run(lambda inputs: inputs["x"], dtype=torch.float64)
    assert_attributed(e.value, [40, 41, 42, 43])


@pytest.mark.parametrize(
    ("tokens", "bad"),
    [([0, 9, 10, 3, -1, 2], [42, 44]), ([0, 1, 2, 3, 4, 10], [45]), ([-1, 1, 2, 3, 4, 5], [40])],
)
def test_token_outside_vocab(tokens: list[int], bad: list[int]) -> None:
    def model(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tensor(tokens)

    with pytest.raises(ModelError, match=r"outside \[0, vocab\)") as e:
        run(model, vocab=10)
    assert_attributed(e.value, bad)


def test_bad_logits() -> None:
    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = torch.zeros(6, 10)
        logits[3] = float("nan")
        logits[5] = -float("inf")
        return {"logits": logits}

    with pytest.raises(ModelError, match="logits") as e:
        run(model, vocab=10)
    assert_attributed(e.value, [43, 45])


def test_logits_vocab_mismatch() -> None:
    with pytest.raises(ModelError, match="over 7 tokens; the vocabulary has 10"):
        run(lambda inputs: {"logits": torch.zeros(6, 7)}, vocab=10)


def test_model_exception_is_chained() -> None:
    def model(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise KeyError("missing weight")

    with pytest.raises(ModelError, match="raised KeyError") as e:
        run(model)
    assert isinstance(e.value.__cause__, KeyError)
    assert_attributed(e.value, [40, 41, 42, 43])


@pytest.mark.parametrize(
    "out",
    [
        None,
        "text",
        {"score": torch.zeros(6)},
        {"proposal": torch.zeros(6), "logits": torch.zeros(6, 2)},
    ],
)
def test_unusable_output(out: Any) -> None:
    with pytest.raises(ModelError, match=r"Txt\.gen") as e:
        run(lambda inputs: out)
    assert_attributed(e.value, [40, 41, 42, 43])


def test_bad_score_shape() -> None:
    with pytest.raises(ModelError, match="score"):
        run(lambda inputs: {"proposal": inputs["x"], "score": torch.zeros(6, 2)})


def test_fault_in_batched_call_names_global_cells() -> None:
    def model(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.log(inputs["x"])  # -inf where x == 0

    be = get_backend("cpu", worker="w")
    items = [
        WorkItem("r", model, {"x": torch.ones(3)}, torch.tensor([100, 101, 102])),
        WorkItem("r", model, {"x": torch.tensor([1.0, 0.0])}, torch.tensor([900, 901])),
    ]
    with pytest.raises(ModelError) as e:
        be.collect(be.dispatch(items))
    assert e.value.where["cells"] == [901]


def _exit(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    raise SystemExit(0)


@pytest.mark.parametrize(
    ("model", "item", "code"),
    [
        (lambda inputs: 1 / 0, {}, "R050"),
        (_exit, {}, "R051"),
        (lambda inputs: [1, 2], {}, "R052"),
        (lambda inputs: inputs["x"][:5], {}, "R053"),
        (lambda inputs: torch.zeros(6, 2, 3, dtype=torch.int64), {"vocab": 4}, "R054"),
        (lambda inputs: torch.tensor(1.0), {}, "R054"),
        (lambda inputs: inputs["x"], {"vocab": 10}, "R055"),
        (lambda inputs: inputs["x"] * float("nan"), {}, "R056"),
        (lambda inputs: torch.full((6,), 12), {"vocab": 10}, "R057"),
    ],
)
def test_every_model_fault_has_its_own_code(
    model: Callable[..., Any], item: dict[str, Any], code: str
) -> None:
    with pytest.raises(ModelError) as e:
        run(model, **item)
    assert e.value.code == code, str(e.value)
    assert e.value.where["rule"] == "Txt.gen" and e.value.where["worker"] == "worker-3"


def test_a_batch_of_cells_longer_than_shown_ends_with_an_ellipsis() -> None:
    """Issue 47: an error naming a batch of 6 cells listed 4 with no sign of the others."""
    with pytest.raises(ModelError) as err:
        run(lambda inputs: torch.ones(5))  # 5 rows for 6 cells: every cell of the call
    assert "cells=[40, 41, 42, 43, …] (6 cells)" in str(err.value)
    assert err.value.where["cells"] == [40, 41, 42, 43]
    with pytest.raises(ModelError) as one:
        run(with_row(float("nan"), row=2))  # one bad row: named in full
    assert "cells=[42]," in str(one.value)
