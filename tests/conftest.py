"""Shared fixtures and the --runslow / gpu switches."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# Tests assert behaviour, never time (benchmarks/ measures it): no per-example deadline, which a
# busy machine would turn into failures of a test whose behaviour is right.
settings.register_profile("lmpm", deadline=None)
settings.load_profile("lmpm")

# A fast-parser internal failure must fail the test suite, not be retried with lark silently
# (subprocesses inherit it). See lmpm.lang.fast.STRICT_ENV.
os.environ["LMPM_STRICT_FAST_PARSER"] = "1"

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--runslow"):
        skip = pytest.mark.skip(reason="slow: run with --runslow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing entirely
        has_cuda = False
    if not has_cuda:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


@pytest.fixture
def examples() -> Path:
    return EXAMPLES


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
