"""Every example on the simulated CUDA device (lmpm.workers.simcuda) commits what it commits on the
CPU, with its payload resident on the device, and nothing on the epoch's path mixes devices.

Before device discipline (the GPU report of 2026-11-26) this failed for each example the way the
H200 did: ByteLM's table on the CPU (gpt, text), LocalGen's index_select (video), the sudoku
model's digit tables (sudoku), the worker's fault mask on the CPU (latent)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_runtime_dataplane import ENGINE_EXAMPLES, _examples

from lmpm.runtime.session import Run
from lmpm.workers.simcuda import SimTensor, simulated_cuda


@pytest.mark.parametrize("name", ENGINE_EXAMPLES)
def test_every_example_on_the_simulated_gpu_commits_as_on_the_cpu(
    name: str, tmp_path: Path
) -> None:
    prog, params, inputs, epochs = _examples(tmp_path)[name]
    cpu = Run.from_file(prog, params=params, inputs=inputs, seed=3)
    cpu.run(epochs)
    with simulated_cuda() as sim:
        gpu = Run.from_file(prog, params=params, inputs=inputs, seed=3, backend="simcuda")
        gpu.run(epochs)
    assert not sim.errors
    for value, vp in cpu.plan.values.items():
        resident = gpu.dataplane.payload[value]
        assert isinstance(resident, SimTensor) and resident.device.type == "cuda", value
        a, b = cpu.engine.state[value], gpu.engine.state[value]
        for f in ("committed", "clock", "rule", "epoch"):
            assert torch.equal(getattr(a, f), getattr(b, f).cpu()), (value, f)
        assert torch.equal(cpu.payload(value), gpu.payload(value).cpu()), value
        assert vp.ncells == resident.shape[0]


def test_a_bound_module_is_moved_to_the_workers_device(tmp_path: Path) -> None:
    """A bound nn.Module (its weights on the CPU) is moved by LMPM once: the run works on the
    device, and the module's parameters are there after it."""
    src = """value Z : Tensor[3] shape Seq(4)
rule Step:
  on Z[i]
  emit proposal Z[i] := Net()
commit Z[*] using satisfy(max_constraints_then_score)
"""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(1, 3)

        def forward(self, inputs: dict[str, torch.Tensor], **_: object) -> dict[str, torch.Tensor]:
            cells = inputs["cells"]
            return {"proposal": self.lin(cells.float()[:, None]), "score": cells.double() * 0}

    net = Net()
    with simulated_cuda() as sim:
        run = Run.from_source(src, bindings={"Net": net}, backend="simcuda")
        run.run(1)
        assert bool(run.engine.state["Z"].committed.all())
    assert net.lin.weight.device.type == "cuda" and not sim.errors


def test_an_eager_text_epoch_on_the_gpu_waits_once_outside_the_model() -> None:
    """The candidates reach the owner on the host in one copy (Candidates.to_host packs them),
    the request's cells go up from pinned memory and the one-cell read takes its cell from the
    request on the host: outside the model, one wait for the device per epoch."""
    from lmpm.ir import compile_file

    ex = Path(__file__).resolve().parents[2] / "examples"
    with simulated_cuda() as sim:
        run = Run(
            compile_file(ex / "text.lmpm"),
            inputs={"Txt": str(ex / "text" / "prompt.txt")},
            backend="simcuda",
        )
        run.run(3)
        before = len(sim.warnings)
        run.run(13)
        ours = [w for w in sim.warnings[before:] if "/lmpm/runtime/" in w.file]
    assert sorted({(w.file.split("/lmpm/")[1], w.func) for w in ours}) == [
        ("runtime/protocol.py", "to_host")
    ]
    assert len(ours) == 10


@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.int64, torch.float64, torch.int32, torch.float32, torch.bool]),
            st.lists(st.integers(0, 4), min_size=0, max_size=3),
        ),
        max_size=6,
    )
)
def test_pack_and_unpack_give_back_every_tensor(specs: list[tuple[torch.dtype, list[int]]]) -> None:
    from lmpm.runtime.protocol import pack, unpack

    gen = torch.Generator().manual_seed(len(specs))
    tensors = [(torch.randn(shape, generator=gen) * 100).to(dtype) for dtype, shape in specs]
    flat, layout = pack(tensors)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    back = unpack(flat, layout)
    assert len(back) == len(tensors)
    for a, b in zip(tensors, back, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
