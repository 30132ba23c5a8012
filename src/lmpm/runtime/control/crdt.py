"""An observed-remove set (OR-Set), the CRDT behind `Set()` values such as MaskPlan and RuleSet.

Each add carries a unique tag ``(replica, counter)``; a remove deletes only the tags it has observed,
so a concurrent add survives. ``merge`` is a join: commutative, associative and idempotent.

>>> a, b = ORSet("a"), ORSet("b")
>>> a.add(("open", 0)); b.add(("open", 1))
>>> sorted(a.merge(b).elements())
[('open', 0), ('open', 1)]
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

Tag = tuple[str, int]


@dataclass
class ORSet:
    replica: str = "r0"
    adds: dict[Hashable, frozenset[Tag]] = field(default_factory=dict)
    removes: dict[Hashable, frozenset[Tag]] = field(default_factory=dict)
    counter: int = 0

    def add(self, element: Hashable) -> Tag:
        self.counter += 1
        tag = (self.replica, self.counter)
        adds = self.adds  # (the control plane adds one element an epoch: no dict.get call)
        adds[element] = adds[element] | {tag} if element in adds else frozenset((tag,))
        return tag

    def remove(self, element: Hashable) -> None:
        observed = self.adds.get(element, frozenset())
        self.removes[element] = self.removes.get(element, frozenset()) | observed

    def __contains__(self, element: Hashable) -> bool:
        return bool(self.adds.get(element, frozenset()) - self.removes.get(element, frozenset()))

    def elements(self) -> Iterable[Hashable]:
        return [e for e in self.adds if e in self]

    def merge(self, other: ORSet) -> ORSet:
        out = ORSet(self.replica, counter=max(self.counter, other.counter))
        for src in (self, other):
            for e, tags in src.adds.items():
                out.adds[e] = out.adds.get(e, frozenset()) | tags
            for e, tags in src.removes.items():
                out.removes[e] = out.removes.get(e, frozenset()) | tags
        return out

    def state(self) -> tuple[frozenset[tuple[Hashable, Tag]], frozenset[tuple[Hashable, Tag]]]:
        """The replica-independent content, for equality of merged states."""
        adds = frozenset((e, t) for e, ts in self.adds.items() for t in ts)
        rems = frozenset((e, t) for e, ts in self.removes.items() for t in ts)
        return adds, rems
