"""The simulated CUDA device (lmpm.workers.simcuda): it computes what the CPU computes, raises what
a real GPU raises for device mixing and .numpy(), and records what makes the host wait."""

from __future__ import annotations

import pytest
import torch

from lmpm.errors import BackendUnavailable
from lmpm.workers import WorkItem, get_backend
from lmpm.workers.simcuda import SimTensor, SimulatedDeviceError, simulated_cuda


def test_factories_copies_and_modules_land_on_the_simulated_device() -> None:
    with simulated_cuda():
        made = [
            torch.zeros(3, device="cuda"),
            torch.arange(3, device=torch.device("cuda", 0)),
            torch.tensor([1, 2], device="cuda"),
            torch.as_tensor([1.0], device="cuda"),
            torch.ones(2).cuda(),
            torch.ones(2).to("cuda"),
            torch.ones(2).to("cuda", torch.float64),
        ]
        m = torch.nn.Linear(3, 2).cuda()
        y = m(made[0])
        back = y.cpu()
    for t in [*made, m.weight, y]:
        assert isinstance(t, SimTensor) and t.device == torch.device("cuda", 0) and t.is_cuda
    assert made[6].dtype == torch.float64
    assert isinstance(m.weight, torch.nn.Parameter)
    assert type(back) is torch.Tensor and back.device.type == "cpu"


def test_values_are_real_and_equal_to_the_cpu() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(4, 5), torch.randn(7, 5)
    ref = torch.softmax(x @ w.T, -1).argmax(-1)
    with simulated_cuda():
        got = torch.softmax(x.cuda() @ w.cuda().T, -1).argmax(-1)
        n = int(got.max())  # data-dependent Python: runs, with real values
    assert torch.equal(got.cpu(), ref) and n == int(ref.max())


def test_autograd_and_an_optimizer_step_run_on_it() -> None:
    with simulated_cuda():
        m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3)).cuda()
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        before = m[1].weight.detach().clone()
        m(torch.tensor([1, 2, 3], device="cuda")).sum().backward()
        assert isinstance(m[1].weight.grad, SimTensor)
        opt.step()
        assert not torch.equal(m[1].weight.detach().cpu(), before.cpu())


@pytest.mark.parametrize(
    "mix",
    [
        lambda c: c + torch.ones(4),  # an elementwise op
        lambda c: torch.cat([c, torch.ones(4)]),
        lambda c: torch.where(c > 1, c, torch.zeros(4)),
        lambda c: torch.arange(10.0)[c.long()],  # a CPU table indexed by CUDA indices
        lambda c: torch.arange(10.0).index_select(0, c.long()),
        lambda c: torch.nn.functional.embedding(c.long(), torch.randn(10, 3)),
        lambda c: torch.nn.Linear(4, 2)(c),  # a module left on the CPU
    ],
)
def test_device_mixing_raises_as_on_a_gpu(mix: object) -> None:
    with simulated_cuda() as sim:
        c = torch.arange(4.0, device="cuda")
        with pytest.raises(SimulatedDeviceError, match="device"):
            mix(c)  # type: ignore[operator]
    assert len(sim.errors) == 1 and sim.errors[0].kind == "error"


def test_what_a_gpu_allows_is_allowed() -> None:
    with simulated_cuda() as sim:
        c = torch.arange(4.0, device="cuda")
        assert (c + torch.tensor(2.0)).device.type == "cuda"  # a 0-dim CPU tensor is a scalar
        assert c[torch.tensor([1, 3])].tolist() == [1.0, 3.0]  # CUDA indexed by CPU indices
        c[torch.tensor([0])] = torch.tensor(9.0)
        host = torch.zeros(4)
        host.copy_(c)  # copies between devices are fine
    assert host.tolist() == [9.0, 1.0, 2.0, 3.0] and not sim.errors


def test_numpy_of_a_device_tensor_raises_as_on_a_gpu() -> None:
    with simulated_cuda(), pytest.raises(SimulatedDeviceError, match=r"Use Tensor\.cpu\(\)"):
        torch.ones(2, device="cuda").numpy()


def test_host_syncs_are_recorded_with_the_line_that_did_them() -> None:
    with simulated_cuda() as sim:
        c = torch.arange(4.0, device="cuda")
        _ = float(c.sum())  # line A: a value read on the host
        _ = c[c > 1]  # line B: a mask whose count the host waits for
        _ = c.tolist()
        _ = c.cpu()
    kinds = [w.kind for w in sim.warnings]
    assert kinds[:1] == ["sync"] and {"data-dependent", "tolist", "host-copy"} <= set(kinds)
    assert all(w.file == __file__ for w in sim.warnings)


def test_the_simulated_backend_runs_work_and_needs_the_block() -> None:
    with pytest.raises(BackendUnavailable, match="simulated_cuda"):
        get_backend("simcuda")
    item = WorkItem("r", lambda inputs: inputs["x"] * 2, {"x": torch.ones(3)}, torch.arange(3))
    with simulated_cuda():
        # the CUDA backend itself (streams, events, pinned copies) on the simulated device
        resident = get_backend("simcuda", results_to_host=False)
        res = resident.collect(resident.dispatch(item))
        assert res[0].proposal.device.type == "cuda"
        assert res[0].proposal.cpu().tolist() == [2.0, 2.0, 2.0]
        to_host = get_backend("simcuda")  # as CudaBackend: results copied to the host
        res = to_host.collect(to_host.dispatch(item))
        assert res[0].proposal.device.type == "cpu" and res[0].proposal.tolist() == [2.0] * 3


def test_blocks_do_not_nest_and_restore_torch() -> None:
    available = torch.cuda.is_available
    with simulated_cuda(), pytest.raises(BackendUnavailable, match="nest"), simulated_cuda():
        pass
    assert torch.cuda.is_available is available
