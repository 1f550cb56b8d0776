"""Parallel runs (`pytest -n 2 --dist loadfile`, what `make test` does): each test file runs whole on
one worker, so its module fixtures (a vLLM server, a Ray session) start once. The files that start a
local Ray cluster take a machine-wide lock for their whole module, so two never overlap and each "no
Ray process left" check sees only its own cluster.

``ARBORL_TEST_PACE=slow|fast`` runs tests with the engine made slow or fast (``tests/pace.py``)."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import pace

RAY_MODULE_PREFIX = "test_cluster_"
RAY_LOCK = Path(tempfile.gettempdir()) / "arborl-tests-ray.lock"


@pytest.fixture(scope="module", autouse=True)
def _one_ray_module_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    if not Path(str(request.fspath)).stem.startswith(RAY_MODULE_PREFIX):
        yield
        return
    fd = os.open(RAY_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the module's Ray session has shut down
        yield
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module of tiny-model tests (faster than two on a shared machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray cluster (2 CPUs) for one test module; afterwards no raylet / gcs_server is left."""
    ray = pytest.importorskip("ray")
    from arborl.cluster.session import leftover_processes

    # workers at the driver's priority, as `cluster.backend=ray` starts them (Ray's default nice 15 starves
    # the actors behind the other pytest worker)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", _system_config={"worker_niceness": 0})
    try:
        yield
    finally:
        ray.shutdown()
        deadline = time.monotonic() + 20
        while leftover_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert leftover_processes() == []


def pytest_configure(config: pytest.Config) -> None:
    if pace.MODE == "slow":
        pace.install_slow_engine()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if pace.MODE == "fast":
        for module in {item.module for item in items if getattr(item, "module", None) is not None}:
            pace.stretch_test_waits(module)
        pace.stretch_loaded_helpers()
