"""Fixtures of the runtime tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    """One local Ray instance for a module's Ray tests (each worker group then starts only its
    actors): our own instance, never the cluster another test started beside."""
    ray = pytest.importorskip("ray")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level=logging.ERROR,
        _node_ip_address="127.0.0.1",
    )
    yield ray
    ray.shutdown()
