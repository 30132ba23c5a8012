"""The owners' exchanges inside a group's epoch (lmpm.runtime.data.shard): typed parts that cross a
process boundary as themselves, and the lockstep that keeps every owner at the same exchange."""

from __future__ import annotations

import pickle
from collections.abc import Generator

import pytest
import torch

from lmpm.runtime.data.shard import (
    Commits,
    Exchange,
    Gather,
    Part,
    WouldCommit,
    Written,
    lockstep,
    parts_of,
)
from lmpm.runtime.protocol import EpochReport, from_wire, to_wire


def _wired(part: Part) -> Part:
    """``part`` as another process receives it (transport.exchange_objects)."""
    return from_wire(pickle.loads(pickle.dumps(to_wire(part), protocol=5)))  # type: ignore[no-any-return]


def test_every_part_crosses_the_wire_as_its_record() -> None:
    commits = Commits(
        torch.tensor([3, 5]), torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0.5, 1.0])
    )
    parts: list[Part] = [
        WouldCommit(torch.tensor([1, 4]), torch.tensor([0.25, -1.0], dtype=torch.float64)),
        Written(torch.tensor([0, 2]), torch.tensor([True, False]), None),
        commits,
        {"A": commits},
        None,
    ]
    for part in parts:
        got = _wired(part)
        assert type(got) is type(part)
        if isinstance(part, dict):
            assert isinstance(got, dict) and torch.equal(got["A"].cells, part["A"].cells)
        elif part is not None:
            for name in part.__dataclass_fields__:
                want, have = getattr(part, name), getattr(got, name)
                assert (want is None and have is None) or torch.equal(want, have), name
    # a record's pickle names its class with two bytes (copyreg extension codes), not its path
    assert b"WouldCommit" not in pickle.dumps(to_wire(parts[0]), protocol=5)


def test_parts_of_refuses_a_part_of_another_exchange() -> None:
    w = WouldCommit(torch.tensor([1]), torch.tensor([0.0]))
    assert parts_of([w, None], WouldCommit) == [w, None]
    with pytest.raises(TypeError, match="expected a Commits part, got WouldCommit"):
        parts_of([w], Commits)


def _owner(*asks: Gather) -> Generator[Gather, list[Part], EpochReport]:
    yield from asks
    raise AssertionError("lockstep stops at the first exchange the owners disagree on")


def test_lockstep_refuses_owners_at_different_exchanges() -> None:
    a = _owner(Gather(Exchange.META, "A", None))
    b = _owner(Gather(Exchange.QUOTA, "A", None))
    with pytest.raises(RuntimeError, match=r"different exchanges: \['meta:A', 'quota:A'\]"):
        lockstep([a, b])
    c = _owner(Gather(Exchange.META, None, {}))
    d = _owner(Gather(Exchange.META, "B", None))
    with pytest.raises(RuntimeError, match=r"\['meta', 'meta:B'\]"):
        lockstep([c, d])
