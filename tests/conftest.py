"""Parallel runs (`pytest -n 2 --dist loadgroup`, what `make test` does): each test file runs whole on
one worker, so its module fixtures (a vLLM server, a Ray session) start once; every file that starts
Ray shares one group, so one worker runs them in turn and the "no Ray process left" checks see only
their own cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

SERIAL_GROUPS = {"test_cluster_": "ray"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        stem = Path(str(item.fspath)).stem
        group = next((g for prefix, g in SERIAL_GROUPS.items() if stem.startswith(prefix)), stem)
        item.add_marker(pytest.mark.xdist_group(group))
