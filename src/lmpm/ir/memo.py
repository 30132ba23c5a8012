"""The process-wide caches of the static checker and of the index-expression compiler: facts kept
per clause, guard or expression *structure*, shared by every check in the process. A module makes
its cache with :func:`cache`; :func:`clear` forgets them all (a benchmark measuring a cold check).
"""

from __future__ import annotations

from typing import Any

_CACHES: list[dict[Any, Any]] = []


def cache() -> dict[Any, Any]:
    """A new empty cache that :func:`clear` empties."""
    d: dict[Any, Any] = {}
    _CACHES.append(d)
    return d


def clear() -> None:
    """Empty every cache made with :func:`cache`."""
    for d in _CACHES:
        d.clear()
