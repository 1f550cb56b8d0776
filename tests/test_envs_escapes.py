"""Every way out of the sandbox in arborl_bench.escapes is tried for real against bubblewrap and must
fail, as the user running the suite and (when that is root) as a non-root user too; the same attempts
against the unsandboxed local runtime get out (so each check can see an escape)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from arborl.config import EnvsConfig
import arborl
import arborl_bench.escapes as escapes
from arborl.envs import SandboxUnavailableError, make_runtime, seccomp

SMALL = dict(disk_mb=16, file_size_mb=8, processes=32, tmp_mb=8, wall_s=20)
# the source roots of arborl and of the harness (benchmarks/), as a PYTHONPATH
SRC = f"{Path(arborl.__file__).resolve().parents[1]}:{Path(escapes.__file__).resolve().parents[1]}"
NON_ROOT_UID = EnvsConfig().sandbox_uid_base - 1  # below the pool: no workspace runs as it


@pytest.fixture(scope="module")
def bwrap_ctx(tmp_path_factory):
    root = tmp_path_factory.mktemp("envs-root")
    rt = make_runtime(EnvsConfig(runtime="bwrap", root_dir=str(root), **SMALL))
    return escapes.make_context(rt, tmp_path_factory.mktemp("escape-work"))


def test_there_are_at_least_thirty_attempts_with_both_keyring_channels():
    assert len(escapes.ESCAPES) >= 30
    assert len({f.__name__ for f in escapes.ESCAPES}) == len(escapes.ESCAPES)
    assert {escapes.keyring_host_session_read, escapes.keyring_host_session_write,
            escapes.keyring_uid_outlives_episode} <= set(escapes.ESCAPES)


@pytest.mark.parametrize("attempt", escapes.ESCAPES, ids=lambda f: f.__name__)
def test_bwrap_contains(bwrap_ctx, attempt):
    outcome = asyncio.run(attempt(bwrap_ctx))
    assert not outcome.escaped, f"{outcome.name} got out: {outcome.detail}"


def test_the_gateway_socket_is_reachable_and_nothing_else(bwrap_ctx):
    outcome = asyncio.run(escapes.other_local_port_than_gateway(bwrap_ctx))
    assert "'gateway': 'open'" in outcome.detail
    assert not outcome.escaped


def test_a_refused_call_is_a_clean_eperm_and_ordinary_programs_run(bwrap_ctx):
    """The filter refuses with EPERM (the program goes on) and leaves threads, fork, clone-based spawning
    (clone3 answers ENOSYS, libc falls back) and the personality query alone."""
    src = escapes._SYS + """
report("io_uring_setup", *sys_(425, 8, ctypes.create_string_buffer(120)))
import subprocess, threading
t = threading.Thread(target=lambda: None); t.start(); t.join()
print("spawned", subprocess.run(["sh", "-c", "echo $((6 * 7))"], capture_output=True, text=True).stdout.strip())
print("query", sys_(135, 0xffffffff))
"""

    async def go():
        ws = await bwrap_ctx.runtime.prepare(bwrap_ctx.template, episode_id="eperm")
        try:
            return await bwrap_ctx.runtime.run(ws, ["python3", "-c", src])
        finally:
            await bwrap_ctx.runtime.close(ws)

    r = asyncio.run(go())
    assert r.returncode == 0, r
    assert "refused io_uring_setup -1 Operation not permitted" in r.stdout
    assert "spawned 42" in r.stdout and "query (0, 0)" in r.stdout


def _escaped_with(tmp_path, names, **cfg):
    rt = make_runtime(EnvsConfig(runtime="bwrap", root_dir=str(tmp_path / "root"), **SMALL, **cfg))
    ctx = escapes.make_context(rt, tmp_path / "work")

    async def go():
        return {a.__name__: (await a(ctx)).escaped for a in escapes.ESCAPES if a.__name__ in names}

    return asyncio.run(go())


def test_seccomp_off_lets_the_listed_calls_through_and_the_keyrings_stay_closed(tmp_path):
    """rollout.envs.seccomp=false (the escape hatch) takes the filter away: the system-call probes get out;
    the keyring channels stay closed by the fresh session keyring and the uid pool's clearing alone."""
    calls = ["io_uring", "user_namespace" if os.geteuid() == 0 else "perf_events", "personality_flags"]
    keys = ["keyring_host_session_read", "keyring_host_session_write"]
    if os.geteuid() == 0:  # as another user @u is the job's own: only the filter closes it
        keys.append("keyring_uid_outlives_episode")
    off = _escaped_with(tmp_path / "off", calls + keys, seccomp=False)
    assert off == {**{n: True for n in calls}, **{n: False for n in keys}}
    assert not any(_escaped_with(tmp_path / "on", calls, seccomp=True).values())


def test_a_missing_libseccomp_fails_clearly_and_the_knob_turns_it_off(tmp_path, monkeypatch):
    seccomp.program.cache_clear()
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # as if the bindings were not installed
    try:
        with pytest.raises(SandboxUnavailableError, match=r"pip install pyseccomp.*rollout\.envs\.seccomp=false"):
            make_runtime(EnvsConfig(runtime="bwrap", root_dir=str(tmp_path / "a"), **SMALL))
        make_runtime(EnvsConfig(runtime="bwrap", root_dir=str(tmp_path / "b"), seccomp=False, **SMALL))
    finally:
        seccomp.program.cache_clear()


def _as_user(uid: int) -> list[str]:
    """Run as ``uid`` with no capability left (setpriv keeps them up to the exec otherwise)."""
    return ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs"]


def _python_for(uid: int) -> tuple[str, str] | None:
    """An interpreter ``uid`` can run with this suite's packages (PYTHONPATH), or None."""
    site = sysconfig.get_paths()["purelib"]
    # the packages, and the interpreter's own installation readable (the sandbox binds it in)
    probe = "import pydantic, pyseccomp, typer, rich; from arborl.envs.bwrap import _python_dirs; _python_dirs()"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if not os.path.exists(exe):
            continue
        r = subprocess.run([*_as_user(uid), exe, "-c", probe],
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{SRC}:{site}"}, capture_output=True)
        if r.returncode == 0:
            return exe, f"{SRC}:{site}"
    return None


def _as_non_root(args: list[str]) -> dict:
    """``python ARGS WORK_DIR`` run as ``NON_ROOT_UID`` in a fresh directory it owns: its last stdout line, as JSON."""
    found = _python_for(NON_ROOT_UID)
    if found is None:
        pytest.skip(f"no Python this machine's uid {NON_ROOT_UID} can run with the suite's packages")
    exe, path = found
    work = Path(tempfile.mkdtemp(prefix="arborl-escapes-nonroot-"))
    try:
        os.chown(work, NON_ROOT_UID, NON_ROOT_UID)
        r = subprocess.run([*_as_user(NON_ROOT_UID), exe, *args, str(work)],
                           env={"PATH": "/usr/bin:/bin", "HOME": str(work), "PYTHONPATH": path},
                           capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0, reason="the suite already runs as a non-root user")
def test_bwrap_contains_every_attempt_as_a_non_root_user():
    """The whole list, run by ``python -m arborl_bench.escapes`` as an unprivileged uid (bwrap in a user
    namespace, no uid pool): none gets out."""
    result = _as_non_root(["-m", "arborl_bench.escapes"])
    assert result["uid"] == NON_ROOT_UID and result["attempts"] == len(escapes.ESCAPES)
    assert result["escaped"] == [], result["details"]



# as NON_ROOT_UID: 3x `processes` threads in the runtime's own process, then a command that forks all it can
_CAP_PER_COMMAND = r"""
import asyncio, json, sys, threading
from pathlib import Path
from arborl.config import EnvsConfig
from arborl.envs import make_runtime

work = Path(sys.argv[1])
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(48)]
for t in threads:
    t.start()
fork = ("import os, time\nn = 0\ntry:\n    while n < 100:\n        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)")


async def main():
    rt = make_runtime(EnvsConfig(runtime="bwrap", root_dir=str(work / "envs"), processes=16))
    (work / "t").mkdir()
    ws = await rt.prepare(work / "t", episode_id="cap")
    try:
        r = await rt.run(ws, ["python3", "-c", fork])
    finally:
        await rt.close(ws)
    return {"returncode": r.returncode, "forked": r.stdout.strip(), "stderr": r.stderr[-500:]}

try:
    print(json.dumps(asyncio.run(main())))
finally:
    stop.set()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the suite already runs as a non-root user")
def test_as_a_non_root_user_the_process_cap_counts_the_command_not_the_users_threads():
    """As another user the cap is per command: a trainer with more threads than ``processes`` still starts
    its sandboxes (with the cap on bwrap the namespace itself failed: EAGAIN), and a fork loop in one still
    stops below the cap."""
    result = _as_non_root(["-c", _CAP_PER_COMMAND])
    assert result["returncode"] == 0, result["stderr"]
    assert 8 < int(result["forked"]) < 16

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
    escapes.keyring_host_session_read,
    escapes.keyring_host_session_write,
    escapes.keyring_calls,
    escapes.proc_keys_lists_host_keys,
    escapes.proc_sys_writable,
    escapes.proc_kernel_files,
    escapes.user_namespace,
    escapes.clone_new_namespaces,
    escapes.io_uring,
    escapes.perf_events,
    escapes.userfaultfd,
    escapes.personality_flags,
    escapes.foreign_abi,
    escapes.trace_own_children,
]


def _beating_loops() -> list[int]:
    """Processes running ``escapes.outlive_timeout``'s shell loops."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"while :; do date +%s%N > beat" in cmd and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


def test_without_a_sandbox_the_attempts_get_out_and_leave_nothing_running(tmp_path):
    rt = make_runtime(EnvsConfig(runtime="local", root_dir=str(tmp_path / "root"), **SMALL))
    ctx = escapes.make_context(rt, tmp_path / "work")

    async def go():
        return [await attempt(ctx) for attempt in SEEN_ESCAPING_LOCALLY]

    outcomes = asyncio.run(go())
    assert [o.name for o in outcomes if not o.escaped] == []
    # outlive_timeout's daemons got out while it ran; the local runtime's close killed them
    assert _beating_loops() == []


def test_the_harmful_attempts_are_never_run_unsandboxed():
    assert escapes.UNSAFE_UNSANDBOXED <= set(escapes.ESCAPES)
    assert escapes.signal_host_process in escapes.UNSAFE_UNSANDBOXED  # it runs `kill -9 -1`
    assert escapes.fork_bomb in escapes.UNSAFE_UNSANDBOXED
    assert escapes.keyring_uid_outlives_episode in escapes.UNSAFE_UNSANDBOXED  # it writes this user's keyrings


def test_no_attempt_names_a_path_of_one_machine(tmp_path):
    """The attempts aim at places computed on the host they run on (home, checkout, working directory)."""
    text = Path(escapes.__file__).read_text()
    fixed = re.findall(r"""["'](/(?:root|work|home/|srv|opt)[^"']*)""", text)
    assert fixed == [], f"escapes.py names {fixed}: compute the paths instead"
    paths = escapes._host_secret_paths(escapes.make_context(None, tmp_path))
    assert str(Path.home()) in paths and str(Path.cwd() / "runs") in paths
