"""Sandbox starts wait for the host, never fail on it: a queue in front of every resource a sandbox takes.

Making a workspace takes a pooled uid (as root); starting a command takes processes, file descriptors and
memory. When one of them is used up for now, the step raises ``ResourceBusy`` (``envs/base.py``) having
undone what it did, and ``SandboxQueue.take`` tries it again when the runtime frees something (a
workspace closed, a command ended: ``freed``), or after a growing pause for what this process cannot
see being freed (another job's uids, the host's memory), until ``rollout.envs.sandbox_wait_s``; only
then is it an ``InfraError``. The seconds each start waited are returned to the caller and counted in
``stats()``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from arborl.envs.base import InfraError, ResourceBusy

T = TypeVar("T")

_FIRST_PAUSE_S = 0.05
_LAST_PAUSE_S = 1.0


class SandboxQueue:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self.waiting = 0  # starts waiting now
        self.waits = 0  # starts that waited at all
        self.wait_s_total = 0.0
        self.wait_s_max = 0.0
        self.gave_up = 0  # starts still refused after wait_s (raised InfraError)

    def freed(self) -> None:
        """Something a sandbox takes was given back: wake every waiting start (safe from any thread)."""
        with self._lock:
            waiters, self._waiters = self._waiters, set()
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that loop has closed; its waiter is gone with it
                pass

    async def take(self, attempt: Callable[[], Awaitable[T]], what: str) -> tuple[T, float]:
        """``attempt()``'s result once it no longer raises ResourceBusy, and the seconds spent waiting."""
        t0 = time.monotonic()
        pause, queued = _FIRST_PAUSE_S, False
        loop = asyncio.get_running_loop()
        try:
            while True:
                woken = loop.create_future()
                with self._lock:  # registered before the attempt: a release during it still wakes this start
                    self._waiters.add((loop, woken))
                try:
                    result = await attempt()
                    return result, self._done(t0) if queued else 0.0
                except ResourceBusy as e:
                    left = self.wait_s - (time.monotonic() - t0)
                    if left <= 0:
                        self.gave_up += 1
                        raise InfraError(
                            f"{what}: {e} (waited {time.monotonic() - t0:.1f}s, rollout.envs.sandbox_wait_s={self.wait_s})"
                        ) from e
                    if not queued:
                        queued, self.waiting, self.waits = True, self.waiting + 1, self.waits + 1
                    try:
                        await asyncio.wait_for(woken, min(pause, left))
                    except asyncio.TimeoutError:
                        pause = min(2 * pause, _LAST_PAUSE_S)
                finally:
                    with self._lock:
                        self._waiters.discard((loop, woken))
        finally:
            if queued:
                self.waiting -= 1

    def _done(self, t0: float) -> float:
        waited = time.monotonic() - t0
        self.wait_s_total += waited
        self.wait_s_max = max(self.wait_s_max, waited)
        return waited

    def stats(self) -> dict[str, float | int]:
        return {"waiting": self.waiting, "waits": self.waits, "wait_s_total": round(self.wait_s_total, 3),
                "wait_s_max": round(self.wait_s_max, 3), "gave_up": self.gave_up}


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
