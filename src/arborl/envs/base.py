"""The environment protocol: a fresh workspace per episode, commands run in it, hidden tests after.

An episode's life in an environment:

    ws = await runtime.prepare(template_dir, episode_id=...)     # E1: a fresh copy, never leftovers
    res = await runtime.run(ws, ["python", "-m", "pytest"], timeout_s=30)   # the agent's commands
    verdict = await runtime.evaluate(ws, hidden_tests_dir, ["python", "-m", "pytest", "-q"], timeout_s=60)
    await runtime.close(ws)                                       # the workspace is deleted

``evaluate`` (E2) runs in a *separate* sandbox over a copy of the final workspace with the hidden tests
added; the agent's sandbox never sees them. Runtimes are registered by name (``ENV_RUNTIMES``):
``bwrap`` (bubblewrap; the default) and ``local`` (no isolation: an explicit, loudly labelled opt-in).
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from arborl.registry import Registry
from arborl.types import ArborlError


class EnvError(ArborlError):
    """An environment could not do what was asked (bad template, bad command): the caller's mistake."""


class SandboxUnavailableError(EnvError):
    """The sandbox cannot run on this machine (bubblewrap missing or refused); says how to fix it."""


class InfraError(ArborlError):
    """The environment itself failed (sandbox did not start, worker died): not the agent's fault.

    Episodes that end in an ``InfraError`` are marked infrastructure failures, kept out of the group
    statistics, and retried."""


class ResourceBusy(InfraError):
    """A host resource a sandbox takes (a pooled uid, processes, file descriptors, memory) is used up for
    now; what was begun has been undone. The runtime's queue (``envs/queue.py``) waits and tries again."""


# the errors of fork, clone, pipe and open that say "not now" rather than "never"
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def is_transient(e: BaseException) -> bool:
    """Whether ``e`` (or the error it was raised from) is one of ``TRANSIENT_ERRNOS``."""
    return any(isinstance(x, OSError) and x.errno in TRANSIENT_ERRNOS for x in (e, e.__cause__))


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed command."""

    wall_s: float = 30.0  # wall clock; the whole process tree is killed after it
    cpu_s: int = 30  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    processes: int = 64  # most processes/threads at once
    file_size_mb: int = 64  # largest file one process may write (RLIMIT_FSIZE)
    disk_mb: int = 256  # most bytes the workspace may hold


@dataclass
class Workspace:
    """One episode's writable directory (``path``, on the host) and what the runtime keeps about it."""

    episode_id: str
    path: Path
    template: Path
    runtime: str
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class CommandResult:
    """What a sandboxed command did."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    killed: str | None = None  # why the runtime killed it (timeout, output cap, ...), None if it exited
    queued_s: float = 0.0  # how long its start waited for the host (processes, file descriptors, memory)


class Runtime(Protocol):
    """An environment runtime (bwrap or local)."""

    name: str

    async def prepare(self, template: Path, *, episode_id: str) -> Workspace:
        """A fresh workspace holding a copy of ``template`` (raises InfraError if it cannot be made)."""

    async def run(
        self,
        ws: Workspace,
        argv: Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        unix_sockets: Sequence[Path] = (),
    ) -> CommandResult:
        """Run ``argv`` with the workspace as the current and only writable directory.

        ``unix_sockets`` are host socket files bound into the sandbox at the same path (the gateway's,
        for an agent that runs inside); there is no other network."""

    async def evaluate(
        self,
        ws: Workspace,
        tests: Path,
        argv: Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        mounts: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run ``argv`` in a separate sandbox over a copy of the final workspace with ``tests`` (a
        directory on the host) copied in; the agent's workspace is not changed. ``mounts`` maps absolute
        paths in the sandbox to directories of that copy (made if missing): ``{"/tests": "tests"}`` shows
        the tests at ``/tests`` as well (bwrap only; a runtime that cannot remap paths raises EnvError)."""

    async def close(self, ws: Workspace) -> None:
        """Kill what is left of the workspace's processes and delete it."""


ENV_RUNTIMES: Registry[type] = Registry("environment runtime")
