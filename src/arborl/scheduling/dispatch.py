"""Dispatch policies (S5, S6): which request runs next on an engine instance that has room.

``scheduling.dispatch=affinity`` (the default) is not one of them: it is the engine pool's own
session placement (``engine/affinity.py``), whole requests with no queue; the names below are the
policies the dispatcher (``engine/dispatcher.py``) and the simulator drive, with one meaning in both.

* ``pinned`` (veRL-like baseline): each group is pinned to one instance when its first request
  arrives (the instance with the fewest outstanding requests, lowest index on ties); the instance
  serves its groups' requests first come first served, each to the end in one go.
* ``seer`` (Seer, Moonshot): one global queue.
  - Divided rollout: a request runs for at most ``chunk_tokens`` new tokens, then comes back to the
    queue and its next chunk may run on any instance (the prefix cache makes the re-prefill cheap on
    the same instance; elsewhere its KV is recomputed or transferred).
  - Context-aware scheduling: the first request of every group is its *probe* and runs first, at
    high priority (probes in arrival order). A group's length estimate is its longest finished
    member (refined upward by the longest a member has generated so far); a group with no finished
    member is estimated at the maximum length. Other requests run longest-estimate first, ties in
    queue order.
  - Anti-starvation: a request that has waited ``starvation_s`` seconds in the queue goes before
    everything else (oldest first).
  - Over-sampling lives in the consumption policy; ``cancel_group`` drops a group's queued requests
    and returns its running ones for the caller to abort.
  With ``context_aware=False`` the queue is plain FIFO (divided rollout only).

The decision for instance ``i`` is, in this order: the oldest starved request; the oldest probe;
the longest estimate (earliest queued on ties). ``tests/test_seer.py`` checks every decision against
a brute-force reading of that rule.
"""

from __future__ import annotations

import abc
import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from arborl.config.scheduling import AFFINITY
from arborl.registry import Registry
from arborl.scheduling.policies import PRIORITY_PROBE, PRIORITY_STARVED, Assignment, DispatchPolicy, RequestSpec

if TYPE_CHECKING:
    from arborl.config import SchedulingConfig

PENDING, RUNNING, DONE, CANCELLED = "pending", "running", "done", "cancelled"
MAX_IDLE_GROUPS = 65536  # groups with no request left that keep their statistics (forget())


@dataclass(slots=True)
class _Req:
    request_id: str
    group_id: str
    max_tokens: int
    generated: int
    order: int  # submission order
    probe: bool
    state: str = PENDING
    instance: int | None = None  # where its last chunk ran
    enqueued_at: float = 0.0
    enq: int = 0  # enqueue counter: queue order, and validity of queue entries
    key_ticket: int = 0  # validity of priority-heap entries


@dataclass(slots=True)
class _Group:
    requests: list[str] = field(default_factory=list)
    longest_finished: int | None = None
    longest_generated: int = 0
    max_tokens: int = 0
    forgotten: int = 0  # requests dropped by ``forget``


class _Dispatch(abc.ABC):
    name = "base"

    def __init__(self) -> None:
        self._reqs: dict[str, _Req] = {}
        self._groups: dict[str, _Group] = {}
        self._orders = 0
        self._enqs = 0
        self._pending = 0
        self._idle: OrderedDict[str, None] = OrderedDict()  # groups whose requests were all forgotten, oldest first
        self.counts = {"assignments": 0, "chunks": 0, "migrations": 0, "probes": 0, "starved": 0, "cancelled": 0}

    def pending(self) -> int:
        return self._pending

    def remove_instance(self, instance: int) -> None:
        """Instance ``instance`` is gone for good (its engine shut down): nothing more goes there."""

    def restore_instance(self, instance: int) -> None:
        """Instance ``instance`` is back (a restarted engine): it may be assigned work again."""

    def request(self, request_id: str) -> _Req:
        return self._reqs[request_id]

    def known_requests(self) -> tuple[str, ...]:
        """Ids of the requests this policy keeps a record of (queued, running, or ended and not yet
        ``forget``-ten), in submission order. Read-only."""
        return tuple(self._reqs)

    def known_groups(self) -> tuple[str, ...]:
        """Groups whose length statistics this policy keeps (with requests, or idle and not yet let
        go). Read-only."""
        return tuple(self._groups)

    def submit(self, spec: RequestSpec, now: float) -> None:
        if spec.request_id in self._reqs:
            raise ValueError(f"request {spec.request_id!r} submitted twice")
        g = self._groups.setdefault(spec.group_id, _Group())
        self._idle.pop(spec.group_id, None)
        r = _Req(spec.request_id, spec.group_id, spec.max_tokens, spec.generated, self._orders,
                 probe=not (g.requests or g.forgotten))
        self._orders += 1
        g.requests.append(r.request_id)
        g.max_tokens = max(g.max_tokens, spec.max_tokens)
        self._reqs[r.request_id] = r
        self._enqueue(r, now)

    def on_chunk_done(self, request_id: str, generated: int, finished: bool, now: float) -> None:
        r = self._reqs[request_id]
        if r.state != RUNNING:  # cancelled meanwhile
            return
        r.generated = generated
        self.counts["chunks"] += 1
        g = self._groups[r.group_id]
        if finished or generated >= r.max_tokens:
            r.state = DONE
            self._on_done(r, g)
        else:
            self._enqueue(r, now)
        self._on_progress(r, g)

    def requeue(self, request_id: str, generated: int, now: float) -> None:
        r = self._reqs[request_id]
        if r.state != RUNNING:
            return
        r.generated = generated
        self._enqueue(r, now, front=True)
        self._on_progress(r, self._groups[r.group_id])

    def cancel_group(self, group_id: str) -> list[str]:
        return [rid for rid in self._groups.get(group_id, _Group()).requests if self.cancel(rid)]

    def cancel(self, request_id: str) -> bool:
        """Drop one request; True when it is running (the caller aborts it on its instance)."""
        r = self._reqs.get(request_id)
        if r is None or r.state in (DONE, CANCELLED):
            return False
        running = r.state == RUNNING
        if not running:
            self._pending -= 1
            self._on_unqueue(r)
        r.state = CANCELLED
        self.counts["cancelled"] += 1
        return running

    def forget(self, request_id: str) -> None:
        """Free a finished or cancelled request's record (a long-running server would keep them all);
        its group keeps its length statistics."""
        r = self._reqs.get(request_id)
        if r is None or r.state not in (DONE, CANCELLED):
            return
        del self._reqs[request_id]
        g = self._groups[r.group_id]
        g.requests.remove(request_id)
        g.forgotten += 1
        if not g.requests:  # keep its length statistics a while (more turns may come), then let it go
            self._idle[r.group_id] = None
            while len(self._idle) > MAX_IDLE_GROUPS:
                gid, _ = self._idle.popitem(last=False)
                del self._groups[gid]
                self._on_group_dropped(gid)

    def _on_group_dropped(self, group_id: str) -> None:
        pass

    def _assign(self, r: _Req, instance: int, chunk: int, *, starved: bool = False) -> Assignment:
        left = r.max_tokens - r.generated
        n = min(chunk, left) if chunk > 0 else left
        r.state = RUNNING
        self._pending -= 1
        if r.instance is not None and r.instance != instance:
            self.counts["migrations"] += 1
        r.instance = instance
        self.counts["assignments"] += 1
        probe = self._is_probe(r)
        self.counts["probes"] += probe
        self.counts["starved"] += starved
        prio = PRIORITY_PROBE if probe else PRIORITY_STARVED if starved else 0
        return Assignment(r.request_id, r.group_id, instance, n, prio, probe, starved)

    def _is_probe(self, r: _Req) -> bool:
        return False

    # hooks
    @abc.abstractmethod
    def _enqueue(self, r: _Req, now: float, front: bool = False) -> None:
        """Put a request (back) into this policy's queue."""

    def _on_unqueue(self, r: _Req) -> None:
        pass

    def _on_done(self, r: _Req, g: _Group) -> None:
        pass

    def _on_progress(self, r: _Req, g: _Group) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counts.items()}


class PinnedDispatch(_Dispatch):
    """veRL-like: a group's requests all run on the instance it was pinned to, each in one go."""

    name = "pinned"

    def __init__(self, instances: int) -> None:
        super().__init__()
        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances}")
        self.instances = instances
        self._pin: dict[str, int] = {}
        self._queues: list[deque[str]] = [deque() for _ in range(instances)]
        self._load = [0] * instances  # outstanding (queued + running) requests
        self._removed: set[int] = set()

    def instance_of(self, group_id: str) -> int | None:
        return self._pin.get(group_id)

    def load(self, instance: int) -> int:
        """Outstanding (queued + running) requests pinned to ``instance``. Read-only."""
        return self._load[instance]

    def _alive(self) -> list[int]:
        return [i for i in range(self.instances) if i not in self._removed]

    def submit(self, spec: RequestSpec, now: float) -> None:
        if spec.group_id not in self._pin:
            alive = self._alive() or list(range(self.instances))
            self._pin[spec.group_id] = min(alive, key=lambda i: (self._load[i], i))
        super().submit(spec, now)

    def remove_instance(self, instance: int) -> None:
        """Re-pin the groups of a gone instance to the least loaded others, queued requests with them."""
        self._removed.add(instance)
        alive = self._alive()
        if not alive:
            return
        for gid, i in list(self._pin.items()):
            if i != instance:
                continue
            j = min(alive, key=lambda k: (self._load[k], k))
            n = sum(self._reqs[rid].state in (PENDING, RUNNING) for rid in self._groups[gid].requests)
            self._load[instance] -= n
            self._load[j] += n
            self._pin[gid] = j
        q = self._queues[instance]
        while q:
            r = self._reqs.get(q.popleft())
            if r is not None and r.state == PENDING:
                self._queues[self._pin[r.group_id]].append(r.request_id)

    def restore_instance(self, instance: int) -> None:
        """New groups may be pinned there again (groups re-pinned elsewhere stay where they are)."""
        self._removed.discard(instance)

    def _on_group_dropped(self, group_id: str) -> None:
        self._pin.pop(group_id, None)

    def _enqueue(self, r: _Req, now: float, front: bool = False) -> None:
        i = self._pin[r.group_id]
        if r.state != RUNNING:  # a new request (not one coming back)
            self._load[i] += 1
        r.state = PENDING
        r.enqueued_at = now
        self._pending += 1
        (self._queues[i].appendleft if front else self._queues[i].append)(r.request_id)

    def next_for(self, instance: int, now: float) -> Assignment | None:
        q = self._queues[instance]
        while q:
            r = self._reqs.get(q.popleft())
            if r is not None and r.state == PENDING:
                return self._assign(r, instance, 0)
        return None

    def _on_done(self, r: _Req, g: _Group) -> None:
        self._load[self._pin[r.group_id]] -= 1

    def cancel(self, request_id: str) -> bool:
        r = self._reqs.get(request_id)
        if r is not None and r.state in (PENDING, RUNNING):
            self._load[self._pin[r.group_id]] -= 1
        return super().cancel(request_id)


class SeerDispatch(_Dispatch):
    """Seer: divided rollout over a global queue, probes first, then longest estimate first."""

    name = "seer"

    def __init__(self, *, chunk_tokens: int = 4096, context_aware: bool = True, starvation_s: float = math.inf) -> None:
        super().__init__()
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0 (0 = whole requests), got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.context_aware = context_aware
        self.starvation_s = starvation_s if starvation_s and starvation_s > 0 else math.inf
        self._fifo: deque[tuple[float, int, str]] = deque()  # (enqueued_at, enq, rid), enqueue order
        self._probes: list[tuple[int, str]] = []  # (enq, rid)
        self._heap: list[tuple[int, int, int, str]] = []  # (-estimate, enq, key_ticket, rid)

    # -- estimates --------------------------------------------------------------------------------
    def estimate(self, group_id: str) -> int:
        """The group's length estimate: longest finished member (raised by the longest generated so
        far); no finished member yet: the maximum length."""
        g = self._groups[group_id]
        if g.longest_finished is None:
            return g.max_tokens
        return max(g.longest_finished, g.longest_generated)

    def _is_probe(self, r: _Req) -> bool:
        return self.context_aware and r.probe and self._groups[r.group_id].longest_finished is None

    def submit(self, spec: RequestSpec, now: float) -> None:
        g = self._groups.get(spec.group_id)
        before = self.estimate(spec.group_id) if g is not None and g.requests else None
        super().submit(spec, now)
        if self.context_aware and before is not None and self.estimate(spec.group_id) != before:
            self._rekey(self._groups[spec.group_id])  # a larger max_tokens raised an unknown group's estimate

    def _rekey(self, g: _Group) -> None:
        for rid in g.requests:  # re-key the group's queued requests (and un-probe them)
            o = self._reqs[rid]
            if o.state == PENDING and not self._is_probe(o):
                self._push(o)

    # -- queue ------------------------------------------------------------------------------------
    def _enqueue(self, r: _Req, now: float, front: bool = False) -> None:
        # ``front`` (preempted / resumed) is not needed here: the priority rule decides
        r.state = PENDING
        r.enqueued_at = now
        self._enqs += 1
        r.enq = self._enqs
        self._pending += 1
        self._fifo.append((now, r.enq, r.request_id))
        if self.context_aware:
            if self._is_probe(r):
                heapq.heappush(self._probes, (r.enq, r.request_id))
            else:
                self._push(r)

    def _push(self, r: _Req) -> None:
        r.key_ticket += 1
        heapq.heappush(self._heap, (-self.estimate(r.group_id), r.enq, r.key_ticket, r.request_id))

    def _on_progress(self, r: _Req, g: _Group) -> None:
        before = self.estimate(r.group_id)
        first_finish = r.state == DONE and g.longest_finished is None  # a queued probe stops being one
        g.longest_generated = max(g.longest_generated, r.generated)
        if r.state == DONE:
            g.longest_finished = max(g.longest_finished or 0, r.generated)
        if self.context_aware and (first_finish or self.estimate(r.group_id) != before):
            self._rekey(g)

    def next_for(self, instance: int, now: float) -> Assignment | None:
        if self._pending == 0:
            return None
        fifo = self._fifo
        while fifo:  # drop entries of requests that left the queue (or were forgotten) or were re-queued since
            r = self._reqs.get(fifo[0][2])
            if r is not None and r.state == PENDING and r.enq == fifo[0][1]:
                break
            fifo.popleft()
        if not self.context_aware:
            _, _, rid = fifo.popleft()
            return self._assign(self._reqs[rid], instance, self.chunk_tokens)
        if fifo and now - fifo[0][0] >= self.starvation_s:
            _, _, rid = fifo.popleft()
            return self._assign(self._reqs[rid], instance, self.chunk_tokens, starved=True)
        while self._probes:
            enq, rid = heapq.heappop(self._probes)
            r = self._reqs.get(rid)
            if r is not None and r.state == PENDING and r.enq == enq:
                if self._is_probe(r):
                    return self._assign(r, instance, self.chunk_tokens)
                self._push(r)  # no longer a probe: it stays queued, by its estimate (one valid entry)
        while self._heap:
            _, enq, ticket, rid = heapq.heappop(self._heap)
            r = self._reqs.get(rid)
            if r is not None and r.state == PENDING and r.enq == enq and r.key_ticket == ticket:
                return self._assign(r, instance, self.chunk_tokens)
        raise AssertionError("seer dispatch: pending requests but none queued")  # pragma: no cover


class DispatchFactory(Protocol):
    """A dispatch policy by name (``scheduling.dispatch``): built from the scheduling knobs and the
    number of engine instances."""

    def __call__(self, sched: "SchedulingConfig", instances: int) -> DispatchPolicy: ...


DISPATCH_POLICIES: Registry[DispatchFactory] = Registry("dispatch policy")


@DISPATCH_POLICIES.register(AFFINITY)
def _affinity(sched: "SchedulingConfig", instances: int) -> DispatchPolicy:
    raise ValueError(f"scheduling.dispatch={AFFINITY} is the engine pool's session placement (engine/affinity.py), not a "
                     "dispatch policy: the simulator and partial_rollout=abort_resume take pinned (each group whole "
                     "on one engine instance) or seer")


@DISPATCH_POLICIES.register("pinned")
def _pinned(sched: "SchedulingConfig", instances: int) -> PinnedDispatch:
    return PinnedDispatch(instances)


@DISPATCH_POLICIES.register("seer")
def _seer(sched: "SchedulingConfig", instances: int) -> SeerDispatch:
    return SeerDispatch(chunk_tokens=sched.chunk_tokens, context_aware=sched.context_aware,
                        starvation_s=sched.starvation_s or math.inf)


def make_dispatch(sched: "SchedulingConfig", instances: int, *, name: str | None = None) -> DispatchPolicy:
    """The dispatch policy ``name`` (default ``sched.dispatch``) over ``instances`` engine instances."""
    return DISPATCH_POLICIES.get(name or sched.dispatch)(sched, instances)
