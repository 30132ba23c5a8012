"""The OR-Set behind Set() values: merge is commutative, associative and idempotent."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmpm.runtime.control.crdt import ORSet

ops = st.lists(st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 4)), max_size=12)


def replica(name: str, script: list[tuple[str, int]]) -> ORSet:
    s = ORSet(name)
    for op, x in script:
        s.add(x) if op == "add" else s.remove(x)
    return s


@given(ops, ops, ops)
def test_merge_is_a_join(
    a: list[tuple[str, int]], b: list[tuple[str, int]], c: list[tuple[str, int]]
) -> None:
    x, y, z = replica("a", a), replica("b", b), replica("c", c)
    assert x.merge(y).state() == y.merge(x).state()
    assert x.merge(y).merge(z).state() == x.merge(y.merge(z)).state()
    assert x.merge(x).state() == x.state()
    assert sorted(x.merge(y).elements()) == sorted(y.merge(x).elements())  # type: ignore[type-var]


def test_concurrent_add_survives_remove() -> None:
    a, b = ORSet("a"), ORSet("b")
    a.add("open")
    b = b.merge(a)
    b.remove("open")  # b removes the add it observed...
    a.add("open")  # ...while a adds again concurrently
    assert "open" in a.merge(b)
    assert "open" not in b
