"""Random programs (the differential test's strategy): W = 2 and 3 partitioned workers commit
exactly what one worker commits, every epoch, every value (payload, clocks, provenance)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmpm.ir import compile_source
from lmpm.resolve.topology import partition
from lmpm.runtime.data.group import WorkerGroup
from lmpm.runtime.records import CHECKSUM_POLICIES
from lmpm.runtime.session import Run

sys.path.insert(0, str(Path(__file__).parent))
from test_runtime_differential import BINDINGS, rich_programs, used


def _states(src: str, seed: int, epochs: int, workers: int) -> list[dict[str, Any]]:
    front = compile_source(src, raise_errors=False)
    assert not front.errors, src
    run = Run(front, bindings=used(front, BINDINGS), seed=seed, epochs=epochs)
    if workers > 1:
        topo = partition(run.plan, workers, replicate_bytes=0)
        group = WorkerGroup(
            run.plan, workers, topology=topo, seed=seed, checksum_policies=CHECKSUM_POLICIES
        )
        run.engine.dataplane = run.dataplane = group
    out = []
    for _ in range(epochs):
        run.engine.step()
        out.append(
            {
                v: (
                    run.payload(v),
                    s.committed.clone(),
                    s.clock.clone(),
                    s.rule.clone(),
                    s.epoch.clone(),
                )
                for v, s in run.engine.state.items()
            }
        )
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rich_programs(), st.sampled_from([2, 3]))
def test_random_programs_commit_alike_on_any_worker_count(
    case: tuple[str, dict[str, Any]], workers: int
) -> None:
    src, info = case
    one = _states(src, info["seed"], info["epochs"], 1)
    many = _states(src, info["seed"], info["epochs"], workers)
    for e, (a, b) in enumerate(zip(one, many, strict=True)):
        for v in a:
            for x, y in zip(a[v], b[v], strict=True):
                assert torch.equal(x, y), (e, v, workers, src)
