"""CUDA backend: same results as CPU, dispatch returns before the device finishes. Needs a GPU."""

from __future__ import annotations

import pytest
import torch

from lmpm.errors import ModelError
from lmpm.workers import Ref, WorkItem, get_backend, rng

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _mlp_items() -> list[WorkItem]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)
    ).double()

    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = inputs["x"].to(next(mlp.parameters()).device)
        mlp.to(x.device)
        return {"logits": mlp(x * inputs["x_mask"][..., None]).sum(1)}

    gen = torch.Generator().manual_seed(1)
    return [
        WorkItem(
            "r",
            model,
            {"x": torch.randn(3, k, 8, generator=gen, dtype=torch.float64)},
            torch.arange(3 * i, 3 * i + 3),
            vocab=5,
            group=f"g{i % 2}",
        )
        for i, k in enumerate((2, 4, 3))
    ]


def test_cpu_and_cuda_identical() -> None:
    items = _mlp_items()
    cpu = get_backend("cpu").collect(get_backend("cpu").dispatch(items))
    gpu_be = get_backend("cuda")
    gpu = gpu_be.collect(gpu_be.dispatch(items))
    for a, b in zip(cpu, gpu):
        assert torch.equal(a.proposal, b.proposal)
        assert torch.allclose(
            a.score, b.score.double() if a.score.dtype == torch.float64 else b.score
        )


def test_rng_bit_identical_on_cuda() -> None:
    cells = torch.arange(10_000)
    cpu = rng.gumbel(5, "v", cells, 3, "r", draws=4)
    gpu = rng.gumbel(5, "v", cells.cuda(), 3, "r", draws=4).cpu()
    assert torch.equal(cpu, gpu)
    assert torch.equal(
        rng.bits(5, "v", cells, 3, "r"), rng.bits(5, "v", cells.cuda(), 3, "r").cpu()
    )


def test_dispatch_returns_before_gpu_work_ends() -> None:
    be = get_backend("cuda")

    def heavy(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        y = inputs["x"]
        for _ in range(200):
            y = torch.tanh(y @ y.T / 64.0)
        return y.sum(-1)

    item = WorkItem("heavy", heavy, {"x": torch.randn(2048, 2048)}, torch.arange(2048))
    be.collect(be.dispatch(item))
    h = be.dispatch(item)
    assert not be.ready(h)
    assert be.collect(h)[0].proposal.shape == (2048,)


def test_resident_update_and_ref_on_device() -> None:
    be = get_backend("cuda")
    be.put("v", torch.zeros(4))
    item = WorkItem("r", lambda inputs: inputs["v"] + 1, {"v": Ref("v")}, torch.arange(4))
    h = be.dispatch(item)
    be.update("v", torch.tensor([1]), torch.tensor([5.0]))
    assert be.collect(h)[0].proposal.tolist() == [1.0] * 4
    assert be.get("v").device.type == "cuda" and be.get("v").cpu().tolist() == [0.0, 5.0, 0.0, 0.0]


def test_nan_on_device_raises_at_collect() -> None:
    be = get_backend("cuda", worker="gpu-w1")
    item = WorkItem(
        "bad", lambda inputs: inputs["x"] / 0.0 * 0.0, {"x": torch.ones(3)}, torch.tensor([4, 5, 6])
    )
    h = be.dispatch(item)
    with pytest.raises(ModelError, match="gpu-w1"):
        be.collect(h)
