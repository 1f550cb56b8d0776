"""Parallel runs (`pytest -n 2 --dist loadfile`, what `make test` does): each test file runs whole on
one worker, so its module fixtures (a vLLM server, a Ray session) start once. The files that start a
local Ray cluster take a machine-wide lock for their whole module, so two never overlap and each "no
Ray process left" check sees only its own cluster.

``ARBORL_TEST_PACE=slow|fast`` runs tests with the engine made slow or fast (``tests/pace.py``).

No process outlives the suite: each pytest process marks its environment (``ARBORL_TEST_SESSION``, which
children inherit) and at its end fails if a process it started is still running: one of its
descendants, or one carrying its mark that was reparented (a ``setsid`` daemon). Such processes are
killed and listed. Processes that were running before it started, and other sessions' processes, are
never counted."""

from __future__ import annotations

import fcntl
import os
import secrets
import select
import signal
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


SESSION_VAR = "ARBORL_TEST_SESSION"
LEFTOVER_GRACE_S = 5.0  # how long a process already on its way out (killed, being reaped) may take to go


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks since boot) of ``pid``, or None if it is gone."""
    try:
        raw = open(f"/proc/{pid}/stat", "rb").read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def _marked(pid: int, mark: bytes) -> bool:
    try:
        return mark in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def started_here(me: int, since: int, before: set[tuple[int, int]], mark: bytes) -> list[int]:
    """Running (not zombie) processes this pytest process started: descendants of ``me``, or processes
    with ``mark`` in their environment, that began at or after ``since`` and were not in ``before``."""
    procs = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        st = _stat(int(name))
        if st is not None:
            procs[int(name)] = st
    out = []
    for pid, (state, ppid, start) in procs.items():
        if pid == me or state in ("Z", "X") or start < since or (pid, start) in before:
            continue
        parent, seen = ppid, set()
        while parent not in (0, 1, me) and parent in procs and parent not in seen:
            seen.add(parent)
            parent = procs[parent][1]
        if parent == me or _marked(pid, mark):
            out.append(pid)
    return out


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Those of ``pids`` still running after ``timeout_s``: each exit is awaited on its pidfd (an event,
    not a guess at how long reaping takes)."""
    deadline = time.monotonic() + timeout_s
    left = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            continue
        try:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            st = _stat(pid)
            if not ready and st is not None and st[0] not in ("Z", "X"):
                left.append(pid)
        finally:
            os.close(fd)
    return left


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the session (at its last teardown) if a process this pytest process started still runs."""
    me, mark = os.getpid(), request.config._arborl_session_mark  # type: ignore[attr-defined]
    since, before = request.config._arborl_session_since, request.config._arborl_session_before  # type: ignore[attr-defined]
    yield
    left = wait_gone(started_here(me, since, before, mark), LEFTOVER_GRACE_S)
    if left:
        shown = [f"{pid} (parent {(_stat(pid) or ('', '?'))[1]}): {_cmdline(pid)[:200]}" for pid in left]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail("processes started by this test session were still running at its end (now killed):\n  "
                    + "\n  ".join(shown), pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    if pace.MODE == "slow":
        pace.install_slow_engine()
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    os.environ[SESSION_VAR] = token  # children inherit it; a reparented daemon still carries it
    config._arborl_session_mark = f"{SESSION_VAR}={token}".encode()  # type: ignore[attr-defined]
    own = _stat(os.getpid())
    config._arborl_session_since = own[2] if own else 0  # type: ignore[attr-defined]
    config._arborl_session_before = {  # type: ignore[attr-defined]
        (int(p), st[2]) for p in filter(str.isdigit, os.listdir("/proc")) if (st := _stat(int(p))) is not None
    }


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if pace.MODE == "fast":
        for module in {item.module for item in items if getattr(item, "module", None) is not None}:
            pace.stretch_test_waits(module)
        pace.stretch_loaded_helpers()
