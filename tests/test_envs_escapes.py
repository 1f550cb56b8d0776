"""Every way out of the sandbox in arborl.envs.escapes is tried for real against bubblewrap and must
fail; the same attempts against the unsandboxed local runtime get out (so each check can see an escape)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from arborl.config import EnvsConfig
from arborl.envs import escapes, make_runtime

SMALL = dict(disk_mb=16, file_size_mb=8, processes=32, tmp_mb=8, wall_s=20)


@pytest.fixture(scope="module")
def bwrap_ctx(tmp_path_factory):
    root = tmp_path_factory.mktemp("envs-root")
    rt = make_runtime(EnvsConfig(runtime="bwrap", root_dir=str(root), **SMALL))
    return escapes.make_context(rt, tmp_path_factory.mktemp("escape-work"))


def test_there_are_at_least_twelve_attempts():
    assert len(escapes.ESCAPES) >= 12


@pytest.mark.parametrize("attempt", escapes.ESCAPES, ids=lambda f: f.__name__)
def test_bwrap_contains(bwrap_ctx, attempt):
    outcome = asyncio.run(attempt(bwrap_ctx))
    assert not outcome.escaped, f"{outcome.name} got out: {outcome.detail}"


def test_the_gateway_socket_is_reachable_and_nothing_else(bwrap_ctx):
    outcome = asyncio.run(escapes.other_local_port_than_gateway(bwrap_ctx))
    assert "'gateway': 'open'" in outcome.detail
    assert not outcome.escaped


# the checks are real: without a sandbox these attempts succeed (the harmful ones are never run there)
SEEN_ESCAPING_LOCALLY = [
    escapes.hidden_tests_by_path,
    escapes.hidden_tests_via_proc,
    escapes.hidden_tests_via_parents,
    escapes.write_outside_workspace,
    escapes.network_host_loopback,
    escapes.other_local_port_than_gateway,
    escapes.outlive_timeout,
    escapes.read_host_secrets,
    escapes.symlink_exfiltration,
]


def test_without_a_sandbox_the_attempts_get_out(tmp_path):
    rt = make_runtime(EnvsConfig(runtime="local", root_dir=str(tmp_path / "root"), **SMALL))
    ctx = escapes.make_context(rt, tmp_path / "work")

    async def go():
        return [await attempt(ctx) for attempt in SEEN_ESCAPING_LOCALLY]

    try:
        outcomes = asyncio.run(go())
    finally:
        left = _kill_outliving_loops()  # what outlive_timeout left running unsandboxed: nothing may outlive the suite
    assert [o.name for o in outcomes if not o.escaped] == []
    assert left, "outlive_timeout escaped, so its loops must have been found and killed here"


def _kill_outliving_loops() -> list[int]:
    """Kill the shell loops ``escapes.outlive_timeout`` starts (they escape the local runtime by design)."""
    killed = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"while :; do date +%s%N > beat" in cmd and int(pid) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
    return killed


def test_the_harmful_attempts_are_never_run_unsandboxed():
    assert escapes.UNSAFE_UNSANDBOXED <= set(escapes.ESCAPES)
    assert escapes.signal_host_process in escapes.UNSAFE_UNSANDBOXED  # it runs `kill -9 -1`
    assert escapes.fork_bomb in escapes.UNSAFE_UNSANDBOXED
