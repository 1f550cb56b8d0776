"""A pool of unprivileged uids, one per live workspace, shared safely between processes.

RLIMIT_NPROC counts the processes of one real uid and does not bind root, so as root every workspace's
commands run as their own uid (``setpriv`` inside the sandbox): a fork bomb hits its own cap and no one
else's. A uid is held by an ``flock`` on ``<lock_dir>/<uid>.lock`` until released. The uids belong to
the host, so the lock directory does too (``host_lock_dir``), whatever each runtime's ``root_dir``:
runtimes in several processes (rollout workers, two jobs on one machine) never share one. Two sandboxes
on one uid would share a process cap, and closing one kills every process of its uid.

A uid's kernel keyrings (``@u``, ``@us``, its persistent keyring) outlive every process of the uid, so the
pool empties them when it hands a uid out and when it takes it back (``keyrings.clear_user_keyrings``):
what one episode stored there never reaches the next episode that draws the uid.

When every uid is held, ``acquire`` raises ``ResourceBusy``: the runtime queues the workspace until one is
given back (``envs/queue.py``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import tempfile
from pathlib import Path

from arborl.envs.base import InfraError, ResourceBusy, is_transient
from arborl.envs.keyrings import clear_user_keyrings

log = logging.getLogger(__name__)


def host_lock_dir() -> Path:
    """One directory per host for the pool's locks: ``/run`` (root's, cleared at boot) where it exists."""
    run = Path("/run")
    base = run if run.is_dir() and os.access(run, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"arborl-sandbox-uids-{os.geteuid()}"


class UidPool:
    def __init__(self, base: int, size: int) -> None:
        self.lock_dir, self.base, self.size = host_lock_dir(), base, size
        self._held: dict[int, int] = {}  # uid -> lock fd

    def acquire(self) -> int:
        """A free uid, held until ``release``; ResourceBusy where none is free now."""
        self.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        start = random.randrange(self.size)
        for i in range(self.size):
            uid = self.base + (start + i) % self.size
            if uid in self._held:
                continue
            try:
                fd = os.open(self.lock_dir / f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError as e:
                if is_transient(e):
                    raise ResourceBusy(f"cannot open sandbox uid {uid}'s lock: {e}") from e
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                clear_user_keyrings(uid)  # a holder that crashed before releasing it left them as they were
            except OSError as e:
                os.close(fd)
                raise InfraError(f"cannot clear the kernel keyrings of sandbox uid {uid}: {e}") from e
            self._held[uid] = fd
            return uid
        raise ResourceBusy(
            f"all {self.size} sandbox uids from {self.base} are in use: raise rollout.envs.sandbox_uids or close workspaces"
        )

    def release(self, uid: int) -> None:
        fd = self._held.pop(uid, None)
        if fd is not None:
            try:
                clear_user_keyrings(uid)
            except OSError as e:  # the next acquire clears them before anyone runs as the uid
                log.warning("cannot clear the kernel keyrings of sandbox uid %d on release: %s", uid, e)
            finally:
                os.close(fd)

    def in_use(self) -> int:
        return len(self._held)
