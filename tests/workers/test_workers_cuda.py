"""The worker protocol on the CUDA backend, each test beside its CPU variant.

Every test names what it compares. The bodies run on each backend here (``cpu`` everywhere, ``cuda``
gpu-marked and skipped without a device), so a CUDA test cannot drift from the protocol unseen: the
CPU variant of the same body runs in every test run.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lmpm.errors import ModelError
from lmpm.workers import Ref, WorkItem, get_backend, rng

BACKENDS = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),  # conftest skips it without a CUDA device
]
WIDTHS = (2, 4, 3)  # items 0 and 2 share group g0 (padded to 3, x_mask passed); item 1 is alone


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)
    ).double()


def _xs() -> list[Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, k, 8, generator=gen, dtype=torch.float64) for k in WIDTHS]


def _items(mlp: torch.nn.Module) -> list[WorkItem]:
    """Three items of ragged widths (3, width, 8) in two groups, logits over 5 tokens."""

    def model(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        per_entry = mlp(inputs["x"])  # (n, width, 5)
        mask = inputs.get("x_mask")  # (n, width): passed only where batch_items padded x
        if mask is not None:
            per_entry = per_entry * mask[..., None]
        return {"logits": per_entry.sum(1)}

    return [
        WorkItem("r", model, {"x": x}, torch.arange(3 * i, 3 * i + 3), vocab=5, group=f"g{i % 2}")
        for i, x in enumerate(_xs())
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_ragged_items_equal_per_item_reference(backend: str) -> None:
    """Ragged items batched per group on ``backend`` (the model's weights on its device) give,
    item by item, the tokens and scores of the unbatched model on the host: tokens equal (the same
    counter-based draws), log-prob scores within float32 rounding."""
    be = get_backend(backend)
    res = be.collect(be.dispatch(_items(_mlp().to(be.device))))
    assert len(res.groups) == 2 and len(res) == len(WIDTHS)
    host_mlp = _mlp()
    for i, (x, got) in enumerate(zip(_xs(), res, strict=True)):
        cells = torch.arange(3 * i, 3 * i + 3)
        with torch.no_grad():
            logits = host_mlp(x).sum(1)  # (3, 5)
        tokens = rng.categorical(logits, seed=0, value="r", cells=cells, epoch=0, rule="r")
        score = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None])[:, 0]
        assert torch.equal(got.cells.cpu(), cells)
        assert torch.equal(got.proposal.cpu(), tokens)
        assert torch.allclose(got.score.cpu(), score, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rng_draws_depend_on_the_cell_only(backend: str) -> None:
    """Gumbel noise and raw bits of 10,000 cells computed on ``backend``'s device, cells in reverse
    order, equal the host's draws for the same cells (bit for bit)."""
    device = get_backend(backend).device
    cells = torch.arange(10_000)
    flipped = cells.flip(0).to(device)
    host = rng.gumbel(5, "v", cells, 3, "r", draws=4)
    assert torch.equal(rng.gumbel(5, "v", flipped, 3, "r", draws=4).cpu().flip(0), host)
    host_bits = rng.bits(5, "v", cells, 3, "r")
    assert torch.equal(rng.bits(5, "v", flipped, 3, "r").cpu().flip(0), host_bits)


@pytest.mark.gpu
def test_dispatch_returns_before_gpu_work_ends_without_syncing() -> None:
    """CUDA only (the cpu backend computes inside dispatch): dispatching 200 chained 2048² matmuls
    returns while they still run, makes no host-device synchronisation (sync debug mode raises
    on one), and collect then hands back the result."""
    be = get_backend("cuda")

    def heavy(inputs: dict[str, Tensor]) -> Tensor:
        y = inputs["x"]
        for _ in range(200):
            y = torch.tanh(y @ y.T / 64.0)
        return y.sum(-1)

    item = WorkItem("heavy", heavy, {"x": torch.randn(2048, 2048)}, torch.arange(2048))
    be.collect(be.dispatch(item))  # warm-up: cuBLAS handles, pinned buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        handle = be.dispatch(item)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not be.ready(handle)
    assert be.collect(handle)[0].proposal.shape == (2048,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_after_dispatch_keeps_the_dispatched_read(backend: str) -> None:
    """A work item reading resident ``v`` (through a Ref) sees the value at dispatch, not an
    update made before collect; ``get`` then shows the update, on the backend's device."""
    be = get_backend(backend)
    be.put("v", torch.zeros(4))
    item = WorkItem("r", lambda inputs: inputs["v"] + 1, {"v": Ref("v")}, torch.arange(4))
    handle = be.dispatch(item)
    be.update("v", torch.tensor([1]), torch.tensor([5.0]))
    assert be.collect(handle)[0].proposal.tolist() == [1.0] * 4
    assert be.get("v").device.type == be.device.type
    assert be.get("v").cpu().tolist() == [0.0, 5.0, 0.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_from_a_model_raises_at_collect_naming_worker_and_cells(backend: str) -> None:
    """A model returning NaN: dispatch returns (no read-back), collect raises R056 with the
    worker's name and the faulty cells."""
    be = get_backend(backend, worker="w-nan")
    item = WorkItem(
        "bad", lambda inputs: inputs["x"] / 0.0 * 0.0, {"x": torch.ones(3)}, torch.tensor([4, 5, 6])
    )
    handle = be.dispatch(item)
    with pytest.raises(ModelError, match="w-nan") as err:
        be.collect(handle)
    assert err.value.code == "R056" and err.value.where["cells"] == [4, 5, 6]
