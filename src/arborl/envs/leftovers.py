"""What a runtime left on the host once its workspaces are closed: each count should be 0.

``leftovers(rt, shm_before)`` counts processes still running as one of its sandbox uids or inside its
root directory (a bwrap, a reaper, a command), mounts below its root, sandbox uids whose lock someone
still holds, workspace directories still in its root, and files in ``/dev/shm`` that were not there
before (``shm_files()`` taken at the start) and that a sandbox made: owned by one of its uids, or any
new file when the runtime does not drop to a uid of its own. Other processes of the host (another
test worker, an inference server) make files in ``/dev/shm`` meanwhile; those are not the runtime's.
The benchmark's concurrency sweep and the queue's tests check it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

SHM = Path("/dev/shm")


def shm_files() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def leftovers(rt, shm_before: set[str]) -> dict[str, int]:  # noqa: ANN001 - a HostRuntime
    root = str(rt.root)
    uids = range(rt.cfg.sandbox_uid_base, rt.cfg.sandbox_uid_base + rt.cfg.sandbox_uids) if rt.drop_uid else range(0)
    return {
        "processes": len(_processes(root, uids)),
        "mounts": sum(1 for m in _mount_points() if m.startswith(root + "/")),
        "uids": sum(_lock_held(rt.uids.lock_dir / f"{uid}.lock") for uid in uids),
        "workspaces": sum(1 for name in os.listdir(root) if not name.startswith(".")),
        "shm_files": sum(1 for name in shm_files() - shm_before if not uids or _owner(SHM / name) in uids),
    }


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except FileNotFoundError:  # removed since it was listed
        return None


def _processes(root: str, uids: range) -> list[int]:
    me, out = os.getpid(), []
    for name in filter(str.isdigit, os.listdir("/proc")):
        pid = int(name)
        try:
            if pid == me:
                continue
            if os.stat(f"/proc/{pid}").st_uid in uids:
                out.append(pid)
                continue
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # gone, or a kernel thread
            continue
        if root in cmdline or cwd == root or cwd.startswith(root + "/"):
            out.append(pid)
    return out


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4].replace("\\040", " ") for line in f]


def _lock_held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
