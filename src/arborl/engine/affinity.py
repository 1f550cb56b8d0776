"""Session-affinity placement of the engine pool: a session's calls stay on one engine, load is the fallback.

A session stays on one engine so its growing prompt finds its prefix in that engine's KV cache.
When that engine has ``affinity_max_load`` or more requests in flight and another engine has
fewer, the call goes to the least-loaded engine and the session's affinity moves with it (the
cache there warms from this call on). New sessions start on the least-loaded engine (round robin
among equals). Engines that were shut down are skipped. Load counts the requests the gateway
routed and not yet finished, so a burst is spread before the engines have even admitted it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from arborl.engine.face import EngineClosedError, EngineFace


class AffinityRouter:
    def __init__(self, engines: Sequence[EngineFace], affinity_max_load: int) -> None:
        if not engines:
            raise ValueError("a gateway needs at least one engine")
        self.engines = list(engines)
        self.affinity_max_load = affinity_max_load
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._routed = [0] * len(self.engines)  # engine requests routed here and not finished yet
        self.down: set[int] = set()
        self.moves = 0  # affinity moves because of load

    def load(self, index: int) -> int:
        """Requests in flight on an engine: what it reports, or what we sent it and it has not
        admitted yet (its own count lags behind a burst), whichever is larger."""
        return max(self.engines[index].load(), self._routed[index])

    def routed(self, index: int, n: int) -> None:
        """``n`` engine requests were sent to engine ``index`` (negative: that many finished)."""
        with self._lock:
            self._routed[index] += n

    def mark_down(self, index: int) -> None:
        with self._lock:
            self.down.add(index)

    def pick(self, current: int | None) -> tuple[int, str]:
        """(engine index, how): how is 'affinity', 'new' or 'fallback'."""
        with self._lock:
            alive = [i for i in range(len(self.engines)) if i not in self.down]
            if not alive:
                raise EngineClosedError("no engine is serving (all were shut down); restart the gateway")
            loads = {i: self.load(i) for i in alive}
            least = min(loads.values())
            start = next(self._rr)
            ring = alive[start % len(alive) :] + alive[: start % len(alive)]
            best = next(i for i in ring if loads[i] == least)
            if current is None or current not in loads:
                return best, "new"
            if loads[current] >= self.affinity_max_load and least < loads[current]:
                self.moves += 1
                return best, "fallback"
            return current, "affinity"
