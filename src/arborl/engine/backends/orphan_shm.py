"""Shared memory that a killed server leaves in /dev/shm, removed once no process uses it.

vLLM's server and its engine processes talk through Python's ``multiprocessing.shared_memory``
segments (``psm_*``, 160-250 MB each for vLLM's CPU build) and named semaphores (``sem.mp-*``); the
process that made one unlinks it when it exits cleanly. A server killed with its process group (a
crash, SIGKILL, a restart's kill) unlinks nothing, and /dev/shm is memory: each killed vLLM left
~420 MB behind. ``ServerProcess`` notes what /dev/shm held before it started a server and, once the
server's group is gone, unlinks what appeared since that no live process maps or holds open (a
segment another program made in between stays while that program uses it). Linux only; elsewhere
nothing is removed.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")  # multiprocessing's shared memory and named semaphores


def shm_names(root: Path = SHM) -> set[str]:
    """The multiprocessing segments and semaphores in ``root`` now."""
    try:
        return {p.name for p in root.iterdir() if p.name.startswith(PREFIXES)}
    except OSError:
        return set()


def _proc_dirs() -> list[Path]:
    return [p for p in Path("/proc").iterdir() if p.name.isdigit()] if Path("/proc").is_dir() else []


def in_use(root: Path = SHM) -> set[str]:
    """Names under ``root`` that a live process maps (``/proc/*/maps``) or holds open (``/proc/*/fd``)."""
    prefix = f"{root}/"
    used: set[str] = set()
    for proc in _proc_dirs():
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                at = line.find(prefix)
                if at >= 0:
                    used.add(line[at + len(prefix):].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(prefix):
                        used.add(target[len(prefix):])
    return used


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie."""
    for proc in _proc_dirs():
        with contextlib.suppress(OSError, ValueError, IndexError):
            # /proc/PID/stat: "pid (comm) state ppid pgrp ...", comm may hold spaces and parentheses
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def remove_orphans(pgid: int, before: set[str], *, root: Path = SHM, wait_s: float = 5.0) -> list[str]:
    """Once process group ``pgid`` is gone (waiting up to ``wait_s`` for its members to exit), unlink
    the segments and semaphores that are in ``root`` now but were not in ``before`` and that no live
    process uses. Returns the names removed."""
    deadline = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    new = shm_names(root) - before
    if not new:
        return []
    removed = []
    for name in sorted(new - in_use(root)):
        with contextlib.suppress(FileNotFoundError, PermissionError):  # another user's (sticky /dev/shm): theirs
            (root / name).unlink()
            removed.append(name)
    return removed
