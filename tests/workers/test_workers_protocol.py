"""The backend protocol: discovery by naming convention, dispatch/collect, resident tensors."""

from __future__ import annotations

import pytest
import torch

from lmpm.errors import BackendUnavailable, UsageError
from lmpm.workers import (
    Backend,
    Handle,
    Proposal,
    Ref,
    Results,
    WorkBatch,
    WorkItem,
    available_backends,
    get_backend,
)


def test_backends_found_by_module_name() -> None:
    names = available_backends()
    assert "cpu" in names and "cuda" in names
    assert not {"base", "batch", "rng"} & set(names)


def test_unknown_backend_lists_available() -> None:
    with pytest.raises(UsageError, match=r"available backends: .*cpu"):
        get_backend("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_is_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        get_backend("cuda")


def test_cpu_satisfies_protocol() -> None:
    be = get_backend("cpu", worker="w7")
    assert isinstance(be, Backend)
    assert be.worker == "w7" and be.device == torch.device("cpu")


def test_dispatch_accepts_item_batch_and_sequence() -> None:
    be = get_backend("cpu")
    item = WorkItem("inc", lambda inputs: inputs["x"] + 1, {"x": torch.zeros(2)}, torch.arange(2))
    for work in (item, WorkBatch((item, item)), [item, item]):
        h = be.dispatch(work)
        assert isinstance(h, Handle) and be.ready(h)
        res = be.collect(h)
        assert isinstance(res, Results)
        assert all(r.proposal.tolist() == [1.0, 1.0] for r in res)
        assert be.collect(h)[0].proposal.tolist() == [1.0, 1.0]  # collect is repeatable


def test_results_keep_dispatch_order_across_groups() -> None:
    be = get_backend("cpu")
    a = lambda inputs: inputs["x"] * 2  # noqa: E731
    b = lambda inputs: Proposal(inputs["x"] * 3, torch.ones(inputs["x"].shape[0]))  # noqa: E731
    items = [
        WorkItem("a", a, {"x": torch.tensor([1.0])}, torch.tensor([0])),
        WorkItem("b", b, {"x": torch.tensor([1.0, 2.0])}, torch.tensor([1, 2])),
        WorkItem("a", a, {"x": torch.tensor([5.0])}, torch.tensor([3])),
    ]
    res = be.collect(be.dispatch(items))
    assert len(res.groups) == 2
    assert [r.proposal.tolist() for r in res] == [[2.0], [3.0, 6.0], [10.0]]
    assert [r.rule for r in res] == ["a", "b", "a"]
    assert res[1].score.tolist() == [1.0, 1.0] and res[0].score.tolist() == [0.0]
    assert [t.tolist() for t in res.split("cells")] == [[0], [1, 2], [3]]


def test_resident_put_get_update_in_place() -> None:
    be = get_backend("cpu")
    src = torch.zeros(4, 2)
    be.put("v", src)
    src.fill_(5.0)  # put copies: the caller's tensor is not aliased
    view = be.get("v")
    be.update("v", torch.tensor([0, 3]), torch.ones(2, 2))
    assert be.get("v").data_ptr() == view.data_ptr()  # updated in place, not reallocated
    assert view.sum().item() == 4.0
    be.delete("v")
    with pytest.raises(UsageError, match="no resident tensor 'v'"):
        be.get("v")


def test_ref_inputs_read_resident_rows() -> None:
    be = get_backend("cpu")
    be.put("emb", torch.arange(10.0).reshape(5, 2))
    item = WorkItem(
        "sum",
        lambda inputs: inputs["e"].sum(-1),
        {"e": Ref("emb", torch.tensor([4, 0]))},
        torch.tensor([7, 8]),
    )
    assert be.collect(be.dispatch(item))[0].proposal.tolist() == [17.0, 1.0]
    with pytest.raises(UsageError, match="never put"):
        be.dispatch(
            WorkItem("sum", lambda inputs: inputs["e"], {"e": Ref("nope")}, torch.arange(1))
        )


def test_malformed_work_raises_usage_error_at_dispatch() -> None:
    be = get_backend("cpu")
    f = lambda inputs: inputs["x"]  # noqa: E731
    with pytest.raises(UsageError, match="batched over cells"):
        be.dispatch(WorkItem("r", f, {"x": torch.zeros(3)}, torch.arange(2)))
    with pytest.raises(UsageError, match="int64"):
        be.dispatch(WorkItem("r", f, {"x": torch.zeros(2)}, torch.arange(2, dtype=torch.int32)))
    with pytest.raises(UsageError, match="WorkItems"):
        be.dispatch(["not an item"])  # type: ignore[list-item]
