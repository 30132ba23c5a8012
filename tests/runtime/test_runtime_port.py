"""The one port between the planes (lmpm.runtime.port): the engine reaches the data plane through
it only, every data plane implements it, its request does not grow with the cells, and the payload
guard covers fused (``--compile``) epochs like eager ones."""

from __future__ import annotations

import ast
import inspect
import json
import pickle
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmpm.errors import RuntimeFault
from lmpm.ir import compile_file, compile_source
from lmpm.resolve.topology import partition
from lmpm.runtime.control import engine as engine_module
from lmpm.runtime.data.dataplane import DataPlane
from lmpm.runtime.data.group import WorkerGroup
from lmpm.runtime.data.guard import GuardedDataPlane, PayloadLeak
from lmpm.runtime.data.raygroup import RayGroup
from lmpm.runtime.port import DataPlanePort
from lmpm.runtime.protocol import EpochReport, EpochRequest, to_wire
from lmpm.runtime.records import CHECKSUM_POLICIES
from lmpm.runtime.session import Run, resume

sys.path.insert(0, str(Path(__file__).parent))
from test_runtime_differential import BINDINGS, rich_programs, used

EX = Path(__file__).resolve().parents[2] / "examples"


def _port_members() -> set[str]:
    methods = {name for name in vars(DataPlanePort) if not name.startswith("_")}
    return methods | set(DataPlanePort.__annotations__)


def test_the_engine_touches_no_payload_and_no_private_member_of_the_port() -> None:
    tree = ast.parse(inspect.getsource(engine_module))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
        if node.attr == "payload" or (node.attr.startswith("_") and not own):
            bad.append(f"line {node.lineno}: .{node.attr}")
    assert not bad, bad
    # and everything it asks of the data plane is declared by the port
    asked = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "dataplane"
    }
    assert asked and asked <= _port_members(), asked - _port_members()


def test_every_data_plane_implements_the_port() -> None:
    front = compile_file(EX / "sudoku.lmpm")
    one, group = Run(front).dataplane, Run(front, workers=2, driver="process").dataplane
    assert isinstance(one, DataPlane) and isinstance(group, WorkerGroup)
    for dp in (one, group):
        missing = [name for name in _port_members() if not hasattr(dp, name)]
        assert not missing, (type(dp).__name__, missing)
    # the Ray group is a WorkerGroup that reaches its workers in other processes
    assert issubclass(RayGroup, WorkerGroup)
    assert all(getattr(RayGroup, m) is getattr(WorkerGroup, m) for m in ("epoch", "compile"))


def test_the_epoch_request_does_not_grow_with_the_cells() -> None:
    sizes = []
    for side in (32, 64):
        front = compile_source(
            f"value G : Token[Byte] shape Grid2D({side}, {side})\n"
            "rule R:\n  on G[x, y]\n  emit proposal G[x, y] := Uniform(k=2)\n"
        )
        run = Run(front)
        req = run.engine._request(0)
        assert isinstance(req, EpochRequest)
        sizes.append(len(pickle.dumps(to_wire(req))))
        report = run.dataplane.epoch(req)
        assert isinstance(report, EpochReport) and report.commits == side * side
        counts = (report.opened, report.unset, report.commits, report.attempts)
        sizes.append(len(pickle.dumps(counts)))
    assert sizes[0] == sizes[2] and sizes[1] == sizes[3]


def test_the_guard_covers_fused_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    front = compile_file(EX / "text.lmpm")
    prompt = {"Txt": str(EX / "text" / "prompt.txt")}
    guarded = Run(front, inputs=prompt, compile=True, guard=True)
    assert isinstance(guarded.dataplane, GuardedDataPlane)
    guarded.run(6)
    stats = guarded.engine.compiled.stats
    assert stats.eager_epochs == 0  # every epoch ran the fused step, under the guard
    plain = Run(front, inputs=prompt, compile=True)  # the same compiled model (its floats)
    plain.run(6)
    assert torch.equal(guarded.payload("Txt"), plain.payload("Txt"))
    for f in ("committed", "clock", "rule", "epoch", "score"):
        assert torch.equal(
            getattr(guarded.engine.state["Txt"], f), getattr(plain.engine.state["Txt"], f)
        )

    # a negative control: payload smuggled into the report is caught at the port
    real = GuardedDataPlane.epoch

    def leaky(self: GuardedDataPlane, req: EpochRequest) -> EpochReport:
        report = real(self, req)
        report.values.append(self.payload["Txt"])
        return report

    monkeypatch.setattr(GuardedDataPlane, "epoch", leaky)
    with pytest.raises(PayloadLeak, match="epoch report"):
        guarded.run(7)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rich_programs(), st.sampled_from([1, 2]))
def test_the_reports_summary_is_the_owners_state(case: tuple[str, dict], workers: int) -> None:
    """The counts the control plane terminates on (kept up to date by each commit) are what a
    recount of the owner's cells gives, every epoch."""
    src, info = case
    front = compile_source(src, raise_errors=False)
    run = Run(front, bindings=used(front, BINDINGS), seed=info["seed"], epochs=info["epochs"])
    if workers > 1:
        topo = partition(run.plan, workers, replicate_bytes=0)
        run.engine.dataplane = WorkerGroup(
            run.plan, workers, topology=topo, seed=info["seed"], checksum_policies=CHECKSUM_POLICIES
        )
    for e in range(info["epochs"]):
        report = run.engine.dataplane.epoch(run.engine._request(e))
        recount = {v: int((~s.committed).count_nonzero()) for v, s in run.engine.state.items()}
        assert dict(report.unset) == recount
        assert report.commits == sum(int(ve.changed.count_nonzero()) for ve in report.values)


@pytest.mark.parametrize("how", ["eager", "compiled", "group"])
def test_an_epoch_is_logged_only_once_its_commits_are_acknowledged_durable(
    how: str, tmp_path: Path
) -> None:
    """The report carries the workers' acknowledgement that an epoch's commits are in their
    payload stores; the log writes the epoch (its "durable" mark) only on it. A worker that lost
    its store stops the run with R090 before the epoch is logged, and a resume redoes it."""
    program = EX / "text.lmpm"
    prompt = {"Txt": str(EX / "text" / "prompt.txt")}
    kw: dict[str, Any] = {"compile": how == "compiled"}
    if how == "group":
        kw.update(workers=2, driver="process")
    with pytest.raises(RuntimeFault) as err, Run(compile_file(program), inputs=prompt, **kw) as run:
        run.log_to(tmp_path / "r", source=program.read_text())
        assert [r.durable for r in run.run(3).records] == [True] * 3
        worker = run.dataplane.workers[0] if how == "group" else run.dataplane
        worker.store = None  # the worker lost its store: it can no longer keep what it commits
        run.run(6)
    assert err.value.code == "R090"
    conn = sqlite3.connect(tmp_path / "r" / "lmpm.db")
    logged = [e for (e,) in conn.execute("SELECT epoch FROM epochs ORDER BY epoch")]
    status = json.loads(conn.execute("SELECT value FROM meta WHERE key = 'status'").fetchone()[0])
    conn.close()
    assert logged == [0, 1, 2] and status == "failed"
    again = resume(tmp_path / "r", **kw)
    again.run(until_stable=True)
    again.finish()
    want = Run(compile_file(program), inputs=prompt).run()
    assert again.engine.epoch == want.epochs
