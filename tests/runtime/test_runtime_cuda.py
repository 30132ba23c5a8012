"""Payload resident on a GPU for the whole run (``--backend cuda``): every example commits the same
as on the CPU (token values bit-identical, float values within a tolerance). Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_runtime_dataplane import ENGINE_EXAMPLES, _examples

from lmpm.runtime.session import Run


@pytest.mark.gpu
@pytest.mark.parametrize("name", ENGINE_EXAMPLES)
def test_every_example_on_cuda_commits_as_on_cpu(name: str, tmp_path: Path) -> None:
    prog, params, inputs, epochs = _examples(tmp_path)[name]
    runs = {}
    for backend in ("cpu", "cuda"):
        run = Run.from_file(prog, params=params, inputs=inputs, seed=3, backend=backend)
        run.run(epochs)
        runs[backend] = run
    cpu, gpu = runs["cpu"], runs["cuda"]
    for v in gpu.plan.values.values():
        assert gpu.dataplane.payload[v.name].device.type == "cuda"  # resident, not copied back
    for value, vp in cpu.plan.values.items():
        a, b = cpu.engine.state[value], gpu.engine.state[value]
        assert torch.equal(a.committed, b.committed), value
        if vp.vocab is not None:
            for f in ("clock", "rule", "epoch"):
                assert torch.equal(getattr(a, f), getattr(b, f)), (value, f)
            assert torch.equal(cpu.payload(value), gpu.payload(value)), value
        else:
            assert torch.allclose(cpu.payload(value), gpu.payload(value), atol=1e-4), value
