"""CPU backend: eager compute, thread-pool groups, logits sampling through the counter-based RNG."""

from __future__ import annotations

import threading

import torch

from lmpm.workers import WorkItem, get_backend, rng


def test_cpu_computes_at_dispatch() -> None:
    calls: list[int] = []

    def model(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        calls.append(1)
        return inputs["x"]

    be = get_backend("cpu")
    h = be.dispatch(WorkItem("r", model, {"x": torch.ones(3)}, torch.arange(3)))
    assert calls == [1]  # already computed; collect only hands it back
    be.collect(h)
    assert calls == [1]


def test_thread_pool_runs_independent_groups_concurrently() -> None:
    barrier = threading.Barrier(2, timeout=10)

    def model(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        barrier.wait()  # deadlocks (times out) unless both groups run at the same time
        return inputs["x"] + 1

    be = get_backend("cpu", threads=2)
    items = [
        WorkItem("r", model, {"x": torch.zeros(2)}, torch.arange(2), group="lm0"),
        WorkItem("r", model, {"x": torch.ones(1)}, torch.arange(2, 3), group="lm1"),
    ]
    res = be.collect(be.dispatch(items))
    assert [r.proposal.tolist() for r in res] == [[1.0, 1.0], [2.0]]
    be.close()


def test_update_waits_for_pool_readers() -> None:
    from lmpm.workers import Ref

    be = get_backend("cpu", threads=2)
    be.put("v", torch.zeros(4))
    gate = threading.Event()

    def slow(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        gate.wait(10)
        return inputs["v"].clone()

    items = [
        WorkItem("r", slow, {"v": Ref("v")}, torch.arange(4), group="a"),
        WorkItem("r", lambda inputs: inputs["v"] * 0, {"v": Ref("v")}, torch.arange(4), group="b"),
    ]
    h = be.dispatch(items)
    threading.Timer(0.05, gate.set).start()
    be.update("v", torch.arange(4), torch.ones(4))  # must not race the queued read
    assert be.collect(h)[0].proposal.tolist() == [0.0] * 4
    assert be.get("v").tolist() == [1.0] * 4
    be.close()


def test_logits_are_sampled_with_counter_rng() -> None:
    be = get_backend("cpu")
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    cells = torch.arange(100, 106)
    item = WorkItem(
        "gen",
        lambda inputs: {"logits": inputs["l"]},
        {"l": logits},
        cells,
        vocab=11,
        seed=3,
        epoch=2,
        value="Tok",
    )
    r = be.collect(be.dispatch(item))[0]
    expect = rng.categorical(logits, seed=3, value="Tok", cells=cells, epoch=2, rule="gen")
    assert torch.equal(r.proposal, expect)
    assert torch.allclose(r.score, torch.log_softmax(logits, -1).gather(-1, expect[:, None])[:, 0])
    # The same cells dispatched in two items with other neighbours draw the same tokens.
    items = [
        WorkItem(
            "gen",
            lambda inputs: {"logits": inputs["l"]},
            {"l": logits[4:]},
            cells[4:],
            vocab=11,
            seed=3,
            epoch=2,
            value="Tok",
        ),
        WorkItem(
            "gen",
            lambda inputs: {"logits": inputs["l"]},
            {"l": logits[:4]},
            cells[:4],
            vocab=11,
            seed=3,
            epoch=2,
            value="Tok",
        ),
    ]
    res = be.collect(be.dispatch(items))
    assert torch.equal(torch.cat([res[1].proposal, res[0].proposal]), expect)


def test_items_with_different_epochs_share_a_call_but_not_noise() -> None:
    be = get_backend("cpu")
    logits = torch.zeros(4, 1000)
    f = lambda inputs: {"logits": inputs["l"]}  # noqa: E731
    items = [WorkItem("g", f, {"l": logits}, torch.arange(4), epoch=e) for e in (0, 1)]
    res = be.collect(be.dispatch(items))
    assert len(res.groups) == 1
    assert not torch.equal(res[0].proposal, res[1].proposal)
    solo = be.collect(be.dispatch(items[1]))[0].proposal
    assert torch.equal(solo, res[1].proposal)


def test_nn_module_and_kwargs() -> None:
    class Scale(torch.nn.Module):
        def forward(
            self, inputs: dict[str, torch.Tensor], *, factor: float
        ) -> dict[str, torch.Tensor]:
            y = inputs["x"] * factor
            return {"proposal": y, "score": -y.abs(), "double": y * 2}

    be = get_backend("cpu")
    m = Scale()
    items = [
        WorkItem("s", m, {"x": torch.ones(2)}, torch.arange(2), kwargs={"factor": f})
        for f in (2.0, 3.0)
    ]
    res = be.collect(be.dispatch(items))
    assert len(res.groups) == 2  # different kwargs: different calls
    assert res[1].proposal.tolist() == [3.0, 3.0] and res[1].aux["double"].tolist() == [6.0, 6.0]
