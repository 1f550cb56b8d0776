"""A pool of unprivileged uids, one per live workspace, shared safely between processes.

RLIMIT_NPROC counts the processes of one real uid and does not bind root, so as root every workspace's
commands run as their own uid (``setpriv`` inside the sandbox): a fork bomb hits its own cap and no one
else's. A uid is held by an ``flock`` on ``<lock_dir>/<uid>.lock`` until released, so runtimes in
several processes (rollout workers) never share one.
"""

from __future__ import annotations

import fcntl
import os
import random
from pathlib import Path

from arborl.envs.base import InfraError


class UidPool:
    def __init__(self, lock_dir: Path, base: int, size: int) -> None:
        self.lock_dir, self.base, self.size = lock_dir, base, size
        self._held: dict[int, int] = {}  # uid -> lock fd

    def acquire(self) -> int:
        self.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        start = random.randrange(self.size)
        for i in range(self.size):
            uid = self.base + (start + i) % self.size
            if uid in self._held:
                continue
            fd = os.open(self.lock_dir / f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._held[uid] = fd
            return uid
        raise InfraError(
            f"all {self.size} sandbox uids from {self.base} are in use: raise rollout.envs.sandbox_uids or close workspaces"
        )

    def release(self, uid: int) -> None:
        fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)

    def in_use(self) -> int:
        return len(self._held)
