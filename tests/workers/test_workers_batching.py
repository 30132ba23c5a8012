"""batch_items: grouping, concatenation, ragged padding with masks, splitting results back."""

from __future__ import annotations

import pytest
import torch

from lmpm.errors import UsageError
from lmpm.workers import WorkItem, batch_items, get_backend


def ident(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs["x"]


def other(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs["x"]


def item(n: int, start: int = 0, **kw: object) -> WorkItem:
    return WorkItem(
        "r",
        kw.pop("model", ident),
        {"x": torch.arange(start, start + n, dtype=torch.float32)},
        torch.arange(start, start + n),
        **kw,
    )  # type: ignore[arg-type]


def test_groups_by_rule_model_kwargs_and_group() -> None:
    items = [
        item(1),
        item(2, 1),
        item(1, 3, model=other),
        item(1, 4, kwargs={"t": 1}),
        item(1, 5, kwargs={"t": 1}),
        item(1, 6, group="g"),
    ]
    calls = batch_items(items)
    assert [c.item_ids for c in calls] == [(0, 1), (2,), (3, 4), (5,)]
    assert calls[0].offsets == (0, 1, 3)
    assert calls[0].inputs["x"].tolist() == [0.0, 1.0, 2.0]
    assert calls[0].cells.tolist() == [0, 1, 2]


def test_ragged_inputs_are_padded_with_synthesized_mask() -> None:
    items = [
        WorkItem("r", ident, {"nbr": torch.ones(2, 3, 4)}, torch.arange(2)),
        WorkItem("r", ident, {"nbr": torch.ones(1, 5, 4) * 2}, torch.arange(2, 3)),
    ]
    (call,) = batch_items(items)
    assert call.inputs["nbr"].shape == (3, 5, 4)
    assert call.inputs["nbr_mask"].shape == (3, 5)
    assert call.inputs["nbr_mask"].sum(1).tolist() == [3, 3, 5]
    assert call.inputs["nbr"][:2, 3:].abs().sum() == 0  # padding is zeros
    assert call.inputs["nbr"][2].sum() == 40


def test_user_masks_are_padded_with_false_and_filled_where_missing() -> None:
    m = torch.tensor([[True, False]])
    items = [
        WorkItem("r", ident, {"nbr": torch.ones(1, 2), "nbr_mask": m}, torch.arange(1)),
        WorkItem("r", ident, {"nbr": torch.ones(1, 3)}, torch.arange(1, 2)),
    ]
    (call,) = batch_items(items)
    assert call.inputs["nbr_mask"].tolist() == [[True, False, False], [True, True, True]]


def test_inconsistent_inputs_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="numbers of dims"):
        batch_items(
            [
                WorkItem("r", ident, {"x": torch.ones(1, 2)}, torch.arange(1)),
                WorkItem("r", ident, {"x": torch.ones(1, 2, 3)}, torch.arange(1)),
            ]
        )
    with pytest.raises(UsageError, match="dtypes"):
        batch_items(
            [
                WorkItem("r", ident, {"x": torch.ones(1)}, torch.arange(1)),
                WorkItem("r", ident, {"x": torch.ones(1, dtype=torch.float64)}, torch.arange(1)),
            ]
        )


def test_one_item_is_its_own_call_keyed_as_in_a_group() -> None:
    """One item (an epoch's one rule firing) skips the grouping: its inputs go as they are, with
    the RNG keys, offsets and mask a group of it would have."""
    x, m = torch.ones(2, 3), torch.tensor([[True, False, True], [True, True, False]])
    one = WorkItem(
        "r", ident, {"x": x, "x_mask": m}, torch.arange(2), seed=5, epoch=3, value="V", replica=1
    )
    (call,) = batch_items([one])
    assert call.inputs["x"] is x and call.inputs["x_mask"] is m
    assert call.offsets == (0, 2) and call.item_ids == (0,)
    twin = WorkItem(
        "r", ident, {"x": x, "x_mask": m}, torch.arange(2, 4), seed=5, epoch=3, value="V", replica=1
    )
    (pair,) = batch_items([one, twin])
    assert call.keys == pair.keys  # ints: every row agrees
    with pytest.raises(UsageError, match="has shape"):
        batch_items([WorkItem("r", ident, {"x": torch.ones(3)}, torch.arange(2))])
    with pytest.raises(UsageError, match="int64"):
        batch_items([WorkItem("r", ident, {"x": torch.ones(2)}, torch.arange(2.0))])


def test_one_model_call_for_many_objects_and_split_back() -> None:
    calls: list[int] = []

    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(inputs["nbr"].shape[0])
        valid = inputs["nbr_mask"]
        s = (inputs["nbr"] * valid).sum(1)
        return {"proposal": s, "score": valid.sum(1).float(), "count": valid.sum(1)}

    gen = torch.Generator().manual_seed(0)
    items = []
    for obj in range(50):
        n, k = 1 + obj % 4, 1 + obj % 7
        items.append(
            WorkItem(
                "agg",
                model,
                {"nbr": torch.randn(n, k, generator=gen)},
                torch.arange(n) + 1000 * obj,
            )
        )
    be = get_backend("cpu")
    res = be.collect(be.dispatch(items))
    assert calls == [sum(it.n for it in items)]  # one call for all 50 objects
    for it, r in zip(items, res):
        assert torch.allclose(r.proposal, it.inputs["nbr"].sum(1))  # type: ignore[union-attr]
        assert r.aux["count"].tolist() == [it.inputs["nbr"].shape[1]] * it.n  # type: ignore[union-attr]
        assert torch.equal(r.cells, it.cells)
    assert [t.shape[0] for t in res.split("count")] == [it.n for it in items]


def test_candidates_and_vector_payloads() -> None:
    be = get_backend("cpu")
    k3 = WorkItem(
        "c", lambda inputs: torch.stack([inputs["x"]] * 3, 1), {"x": torch.ones(2)}, torch.arange(2)
    )
    r = be.collect(be.dispatch(k3))[0]
    assert r.proposal.shape == (2, 3) and r.score.shape == (2, 3)
    vec = WorkItem(
        "v",
        lambda inputs: {"proposal": torch.ones(2, 4), "score": torch.zeros(2)},
        {"x": torch.ones(2)},
        torch.arange(2),
    )
    r = be.collect(be.dispatch(vec))[0]
    assert r.proposal.shape == (2, 4) and r.score.shape == (2,)
