"""Engine instances as the rollout driver sees them, and the simulated one (cost model).

The driver (``arborl.sim.loop``) talks to every instance through ``Instance``: admit an assignment,
ask when its next event is, run to it, bring it up to a time before an outside change, abort a
request, load new weights. ``SimInstance`` answers from a ``CostModel``: continuous batching up to
``max_batch`` sequences, KV memory of ``kv_capacity_tokens`` shared by running sequences and a
prefix cache of finished ones (evicted least recently used), vLLM-like preemption of the newest
sequence (recomputed later) when the running ones outgrow the memory. Between two events the batch
is fixed, so a whole segment of decode steps is costed in closed form (no per-step loop).
``arborl.sim.engine_instance.EngineInstance`` answers the same calls by running a real built-in engine.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

from arborl.sim.cost import CostModel

ADMIT_WATERMARK = 0.95  # admit new sequences only while KV use is below this share of the capacity


@dataclass(slots=True)
class Admit:
    request_id: str
    lineage: str  # the episode whose KV this request extends (prefix-cache key)
    context: int  # context tokens before this assignment's first new token
    stop_after: int  # new tokens this assignment produces (its natural end or the chunk limit)
    home: int | None = None  # instance that holds this lineage's KV from its last assignment
    home_tokens: int = 0  # how many tokens of KV it holds there
    priority: int = 0
    seed: int = 0
    reserve: int = 0  # a bounded chunk: KV tokens the instance reserves for its growth (0 = unbounded, none)


@dataclass(slots=True)
class ChunkEnd:
    request_id: str
    tokens: int  # new tokens this assignment produced
    t: float  # instance clock when it ended
    min_version: int  # policy versions of those tokens
    max_version: int


class Instance(Protocol):
    index: int
    clock: float
    version: int

    def has_room(self) -> bool: ...

    def load(self) -> float: ...

    def admit(self, a: Admit, now: float) -> None: ...

    def next_event_time(self) -> float: ...

    def run_next(self) -> list[ChunkEnd]: ...

    def sync_to(self, t: float) -> list[ChunkEnd]: ...

    def abort(self, request_id: str) -> int: ...

    def update_weights(self, version: int, now: float) -> None: ...

    def stats(self) -> dict[str, float]: ...


@dataclass(slots=True)
class _Run:
    a: Admit
    ctx: int  # KV tokens (context + generated in this assignment)
    left: int
    done: int = 0
    order: int = 0
    vmin: int = 0
    recompute: bool = False  # preempted: its KV is gone
    res: int = 0  # KV still reserved for its growth


@dataclass
class InstanceStats:
    busy_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    batch_steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    transfer_tokens: int = 0
    update_s: float = 0.0


class SimInstance:
    def __init__(self, index: int, cost: CostModel, *, migration: str = "transfer") -> None:
        if migration not in ("transfer", "recompute"):
            raise ValueError(f"migration must be transfer or recompute, got {migration!r}")
        self.index = index
        self.cost = cost
        self.migration = migration
        self.clock = 0.0
        self.version = 0
        self.running: list[_Run] = []
        self.waiting: deque[_Run] = deque()
        self.kv_used = 0
        self._reserved = 0  # tokens bounded chunks may still add
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.cache_tokens = 0
        self._orders = 0
        self.st = InstanceStats()

    # -- driver interface -------------------------------------------------------------------------
    def has_room(self) -> bool:
        c = self.cost
        return not self.waiting and len(self.running) < c.max_batch and self._committed() < ADMIT_WATERMARK * c.kv_capacity_tokens

    def load(self) -> float:
        """Share of the batch slots or of the KV memory in use, whichever is higher (the driver fills the
        least loaded instance first)."""
        c = self.cost
        return max(len(self.running) / c.max_batch, self._committed() / c.kv_capacity_tokens)

    def admit(self, a: Admit, now: float) -> None:
        self.clock = max(self.clock, now)
        self.waiting.append(_Run(a, a.context, a.stop_after))
        self._admit_waiting()

    def next_event_time(self) -> float:
        if not self.running:
            return math.inf
        if self._overflowing():
            return self.clock
        return self.clock + self.cost.steps_s(len(self.running), self.kv_used, self._steps_to_event())

    def run_next(self) -> list[ChunkEnd]:
        if not self.running:
            return []
        self._preempt_if_needed()
        self._advance(self._steps_to_event())
        return self._collect()

    def sync_to(self, t: float) -> list[ChunkEnd]:
        ends: list[ChunkEnd] = []
        while self.running and self.clock < t:
            self._preempt_if_needed()
            s = min(self._steps_to_event(), self.cost.steps_within(len(self.running), self.kv_used, t - self.clock))
            self._advance(s)
            ends += self._collect()
        if not self.running:
            self.clock = max(self.clock, t)
        return ends

    def abort(self, request_id: str) -> int:
        for i, r in enumerate(self.running):
            if r.a.request_id == request_id:
                self.running.pop(i)
                self.kv_used -= r.ctx
                self._reserved -= r.res
                self._cache_put(r.a.lineage, r.ctx)
                self._admit_waiting()
                return r.done
        for r in list(self.waiting):
            if r.a.request_id == request_id:
                self.waiting.remove(r)
                return r.done
        return 0

    def update_weights(self, version: int, now: float) -> None:
        """Pause for the weight load; running sequences' KV is recomputed under the new weights."""
        self.sync_to(now)
        start = max(self.clock, now)
        recompute = sum(r.ctx for r in self.running)
        self.clock = start + self.cost.weight_update_s + self.cost.prefill_s(recompute)
        self.st.update_s += self.clock - start
        self.st.prefill_tokens += recompute
        self.version = version
        self.cache.clear()
        self.cache_tokens = 0
        for r in self.running:
            r.vmin = min(r.vmin, version) if r.done else version

    def stats(self) -> dict[str, float]:
        s = self.st
        return {
            "busy_s": s.busy_s,
            "decode_steps": float(s.steps),
            "tokens": float(s.tokens),
            "mean_batch": s.batch_steps / s.steps if s.steps else 0.0,
            "preemptions": float(s.preemptions),
            "prefill_tokens": float(s.prefill_tokens),
            "cached_tokens": float(s.cached_tokens),
            "transfer_tokens": float(s.transfer_tokens),
            "update_s": s.update_s,
        }

    # -- internals --------------------------------------------------------------------------------
    def _committed(self) -> int:
        """KV in use plus what bounded chunks may still add."""
        return self.kv_used + self._reserved

    def _overflowing(self) -> bool:
        return len(self.running) > 1 and self.kv_used + len(self.running) > self.cost.kv_capacity_tokens

    def _preempt_if_needed(self) -> None:
        while self._overflowing():  # the newest sequence gives its memory back (recomputed later)
            victim = max(self.running, key=lambda r: r.order)
            self.running.remove(victim)
            self.kv_used -= victim.ctx
            self._reserved -= victim.res
            victim.res = 0
            victim.recompute = True
            self.waiting.appendleft(victim)
            self.st.preemptions += 1

    def _steps_to_event(self) -> int:
        B = len(self.running)
        k = min(r.left for r in self.running)
        if B > 1:
            k = min(k, max(1, (self.cost.kv_capacity_tokens - self.kv_used) // B))
        return max(1, k)

    def _advance(self, s: int) -> None:
        B = len(self.running)
        dt = self.cost.steps_s(B, self.kv_used, s)
        self.clock += dt
        self.st.busy_s += dt
        self.st.steps += s
        self.st.tokens += B * s
        self.st.batch_steps += B * s
        for r in self.running:
            r.ctx += s
            r.left -= s
            r.done += s
            if r.res:
                dec = min(s, r.res)
                r.res -= dec
                self._reserved -= dec
        self.kv_used += B * s
        self._evict()

    def _collect(self) -> list[ChunkEnd]:
        ends = []
        keep = []
        for r in self.running:
            if r.left <= 0:
                self.kv_used -= r.ctx
                self._reserved -= r.res
                r.res = 0
                self._cache_put(r.a.lineage, r.ctx)
                ends.append(ChunkEnd(r.a.request_id, r.done, self.clock, r.vmin, self.version))
            else:
                keep.append(r)
        self.running = keep
        if ends:
            self._admit_waiting()
        return ends

    def _admit_waiting(self) -> None:
        c = self.cost
        while self.waiting and len(self.running) < c.max_batch:
            r = self.waiting[0]
            grow = max(0, r.a.reserve - r.done)
            if self.running and self._committed() + r.ctx + grow > ADMIT_WATERMARK * c.kv_capacity_tokens:
                break
            self.waiting.popleft()
            cached = 0 if r.recompute else self._cache_take(r.a.lineage)
            new = max(0, r.ctx - cached)
            transfer = 0
            if new and not r.recompute and not cached and self.migration == "transfer" and r.a.home not in (None, self.index):
                transfer = min(r.a.home_tokens, r.ctx)
            dt = c.prefill_s(new - transfer) + c.transfer_per_token_s * transfer
            r.recompute = False
            self.clock += dt
            self.st.busy_s += dt
            self.st.prefill_tokens += new - transfer
            self.st.cached_tokens += min(cached, r.ctx)
            self.st.transfer_tokens += transfer
            self._orders += 1
            r.order = self._orders
            r.vmin = self.version
            self.running.append(r)
            self.kv_used += r.ctx
            r.res = grow
            self._reserved += grow
            self._evict()

    def _cache_put(self, lineage: str, tokens: int) -> None:
        old = self.cache.pop(lineage, 0)
        self.cache[lineage] = tokens
        self.cache_tokens += tokens - old
        self._evict()

    def _cache_take(self, lineage: str) -> int:
        n = self.cache.pop(lineage, 0)
        self.cache_tokens -= n
        return n

    def _evict(self) -> None:
        cap = self.cost.kv_capacity_tokens
        while self.cache and self.kv_used + self.cache_tokens > cap:
            _, n = self.cache.popitem(last=False)
            self.cache_tokens -= n
