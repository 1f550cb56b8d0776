"""Run one host process for a runtime: wall-clock timeout that kills its process group, output capped.

Both runtimes start their command through this; the bwrap runtime's process is bubblewrap itself, whose
death takes the sandbox's PID namespace (and every process in it) down with it.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from arborl.envs.base import CommandResult, EnvError, Limits, ResourceBusy, is_transient

_READ = 65536
_DRAIN_AFTER_KILL_S = 1.0  # a process that escaped the group may hold the pipes open: stop waiting
_STOP_GRACE_S = 5.0  # after a kill_signal other than SIGKILL, before the group's SIGKILL
_OPEN_FILES_AT_START = resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit.

    Each running command holds about eight descriptors here (its pipes, bwrap's status pipe, the seccomp
    program, the uid lock), so the soft limit many systems start a job with (1024, kept low for select())
    ran out near 128 concurrent sandboxes: starts failed with EMFILE and closes could not delete their
    workspaces. Commands get back the limit the job started with (``rlimit_prefix``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        with open("/proc/sys/fs/nr_open") as f:  # the most a soft limit may be
            hard_n = int(f.read())
    else:
        hard_n = hard
    if soft != resource.RLIM_INFINITY and soft < hard_n:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard_n, hard))
        except (ValueError, OSError):
            pass


def check_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` as a list of strings, or an EnvError saying what is wrong with it."""
    if isinstance(argv, (str, bytes)):
        raise EnvError(f"argv must be a list of strings, not one string ({argv!r}): use ['sh', '-c', {argv!r}]")
    argv = list(argv)
    if not argv:
        raise EnvError("argv is empty: give the program and its arguments, e.g. ['python', '-m', 'pytest']")
    for a in argv:
        if not isinstance(a, str):
            raise EnvError(f"argv items must be strings, got {type(a).__name__} {a!r} in {argv!r}")
        if "\0" in a:
            raise EnvError(f"argv item {a!r} contains a NUL byte")
    if not argv[0]:
        raise EnvError(f"argv[0] is empty in {argv!r}: name the program to run")
    return argv


def check_descriptors_left() -> None:
    """ResourceBusy unless an eighth of this process's descriptors (at least 64) stay free after a start:
    commands queue before the limit, not at it, since the rest of the process (the gateway's connections
    from the very agents started, checkpoints, logs) needs descriptors too."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return
    left = soft - len(os.listdir("/proc/self/fd"))
    if left < max(64, soft // 8):
        raise ResourceBusy(f"only {left} of this process's {soft} file descriptors are free (RLIMIT_NOFILE)")


def rlimit_prefix(limits: Limits) -> list[str]:
    """``prlimit`` options that set ``limits`` (all but the process cap, which counts a whole uid here: the
    bwrap runtime sets it inside its sandbox) on the process it then executes, inherited by children.

    The caller runs it with POSIXLY_CORRECT set so option parsing stops at the command's name."""
    mb = 1024 * 1024
    soft, hard = (("unlimited" if n == resource.RLIM_INFINITY else str(n)) for n in _OPEN_FILES_AT_START)
    return [
        "prlimit",
        f"--cpu={limits.cpu_s}:{limits.cpu_s}",
        f"--as={limits.memory_mb * mb}:{limits.memory_mb * mb}",
        f"--fsize={limits.file_size_mb * mb}:{limits.file_size_mb * mb}",
        "--core=0:0",
        f"--nofile={soft}:{hard}",  # what the job started with, not what raise_open_files_limit made it
    ]


async def run_process(
    argv: list[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdin: str | None,
    wall_s: float,
    output_bytes: int,
    shown_argv: list[str],
    pass_fds: Sequence[int] = (),
    kill_signal: int = signal.SIGKILL,
) -> CommandResult:
    """Run ``argv`` in its own session; past ``wall_s`` or ``output_bytes`` the whole group gets
    ``kill_signal`` (SIGKILL; SIGTERM where ``argv`` is a supervisor that stops its tree on it, as the bwrap
    runtime's reaper does), and SIGKILL if it is still there ``_STOP_GRACE_S`` later. ResourceBusy where
    it could not start for want of processes, descriptors or memory."""
    t0 = time.perf_counter()
    check_descriptors_left()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=str(cwd),
            env=dict(env),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    except FileNotFoundError:
        return CommandResult(shown_argv, 127, "", f"command not found: {argv[0]}", time.perf_counter() - t0)
    except PermissionError as e:
        return CommandResult(shown_argv, 126, "", f"cannot execute {argv[0]}: {e}", time.perf_counter() - t0)
    except OSError as e:
        if is_transient(e):  # no process, pipe or memory for it now: nothing started, the runtime queues it
            raise ResourceBusy(f"cannot start {argv[0]}: {e}") from e
        raise
    bufs: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
    total = [0]
    killed: list[str] = []

    def kill(reason: str, sig: int = kill_signal) -> None:
        if not killed:
            killed.append(reason)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    async def stopped() -> None:
        try:
            await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)
        except asyncio.TimeoutError:
            kill(killed[0], signal.SIGKILL)
            await proc.wait()

    async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
        while chunk := await stream.read(_READ):
            room = output_bytes - total[0]
            if room > 0:
                buf += chunk[:room]
            total[0] += len(chunk)
            if total[0] > output_bytes:
                kill("output_limit")

    async def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write((stdin or "").encode())
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            proc.stdin.close()

    assert proc.stdout is not None and proc.stderr is not None
    pumps = [asyncio.ensure_future(pump(proc.stdout, bufs["out"])), asyncio.ensure_future(pump(proc.stderr, bufs["err"]))]
    feeder = asyncio.ensure_future(feed()) if stdin is not None else None
    try:
        await asyncio.wait_for(proc.wait(), wall_s)
    except asyncio.TimeoutError:
        kill("timeout")
        await stopped()
    except BaseException:  # cancelled: never leave the tree running
        kill("cancelled")
        await stopped()
        raise
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the command left behind in its group
        except (ProcessLookupError, PermissionError):
            pass
        done, pending = await asyncio.wait(pumps + ([feeder] if feeder else []), timeout=_DRAIN_AFTER_KILL_S)
        for p in pending:
            p.cancel()
    return CommandResult(
        argv=shown_argv,
        returncode=proc.returncode if proc.returncode is not None else -9,
        stdout=bufs["out"].decode("utf-8", "replace"),
        stderr=bufs["err"].decode("utf-8", "replace"),
        duration_s=time.perf_counter() - t0,
        timed_out=killed[:1] == ["timeout"],
        killed=killed[0] if killed else None,
    )
