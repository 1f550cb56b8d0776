"""The rollout driver: one event loop that runs a workload on engine instances under a consumption
policy and a dispatch policy, with a trainer that consumes batches and publishes weights.

The instances are either simulated (``SimInstance``, a cost model: this is the simulator) or real
built-in engines (``EngineInstance``: each step really runs and its measured duration advances that
instance's clock, so two engines stepped in turn on one machine behave like two machines). The
policies are the classes of ``arborl.scheduling`` and are only ever called through their protocols.

Per event the driver: hands finished chunks back to the dispatcher, moves episodes to their next
turn (after the environment latency) or finishes them, tells the consumption policy when a whole
group is done (and its rewards, to a policy that reads them: dynamic sampling), starts new groups
while it allows, gives the trainer a batch when it is idle and the policy has one, and fills every
instance that has room from the dispatcher (round-robin).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from arborl.scheduling.policies import Assignment, Batch, RequestSpec
from arborl.scheduling.timeline import Timeline
from arborl.seeding import derive_seed
from arborl.sim.instance import Admit, ChunkEnd, Instance
from arborl.sim.workload import EpisodePlan, Workload


class SimDeadlock(RuntimeError):
    """Nothing can happen any more but the run is not done (a policy waits for something that never comes)."""


@dataclass(slots=True)
class _Ep:
    group: "_Grp"
    plan: EpisodePlan
    lineage: str
    turn: int = 0
    ctx: int = 0  # context tokens before the current turn's generation
    home: int | None = None
    home_tokens: int = 0


@dataclass(slots=True)
class _Req:
    rid: str
    ep: _Ep
    target: int
    generated: int = 0
    instance: int | None = None
    running: bool = False  # assigned to an instance and not back yet
    min_version: int | None = None
    max_version: int = 0


@dataclass(slots=True)
class _Grp:
    gid: str
    index: int
    step: int  # trainer version when it started
    started_at: float
    left: int
    tokens: int = 0
    mixed: bool = True  # its rewards differ: the trainer learns from it
    min_version: int | None = None
    cancelled: bool = False
    finished_at: float | None = None
    request_ends: list[float] = field(default_factory=list)


@dataclass
class RunResult:
    figures: dict[str, float]
    timeline: Timeline | None
    batches: list[dict]


class RolloutDriver:
    def __init__(
        self,
        workload: Workload,
        instances: Sequence[Instance],
        consume: Any,
        dispatch: Any,
        *,
        steps: int,
        train_s: Callable[[int], float],
        partial_rollout: str = "continue",
        timeline: Timeline | None = None,
        max_events: int = 50_000_000,
        on_turn: Callable[[str, int, int], None] | None = None,
        drop_equal: bool = True,
    ) -> None:
        if partial_rollout not in ("continue", "abort_resume"):
            raise ValueError(f"partial_rollout must be continue or abort_resume, got {partial_rollout!r}")
        self.workload = workload
        self.instances = list(instances)
        self.consume = consume
        self.dispatch = dispatch
        self.steps = steps
        self.train_s = train_s
        self.partial = partial_rollout
        self.timeline = timeline
        self.max_events = max_events
        self.on_turn = on_turn  # (lineage, turn, obs_tokens): real engines append observation tokens
        self.drop_equal = drop_equal  # the trainer skips groups with all-equal rewards (train.advantage.drop_zero_variance)
        self.now = 0.0
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._epoch = [0] * len(self.instances)
        self._rr = 0
        self._groups: dict[str, _Grp] = {}
        self._reqs: dict[str, _Req] = {}
        self._next_group = 0
        self._training: Batch | None = None
        self._trained = 0
        self._live_eps = 0
        self._groups_finished = 0
        self._rollout_s = 0.0
        self._last_t = 0.0
        self.batches: list[dict] = []
        self.generated = 0
        self.trained_tokens = 0
        self.wasted_tokens = 0
        self.events = 0

    def finished_groups(self) -> dict[str, int]:
        """Groups whose every episode finished (cancelled ones excluded), in start order: group id ->
        the group's index in the workload (``workload.group(index)``). Read-only."""
        return {g.gid: g.index for g in self._groups.values() if g.finished_at is not None and not g.cancelled}

    # -- event plumbing ---------------------------------------------------------------------------
    def _push(self, t: float, kind: str, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, data))

    def _touch(self, i: int) -> None:
        self._epoch[i] += 1
        t = self.instances[i].next_event_time()
        if t < math.inf:
            self._push(t, "inst", (i, self._epoch[i]))

    def _advance_clock(self, t: float) -> None:
        if self._live_eps > 0:
            self._rollout_s += t - self._last_t
        self._last_t = t
        self.now = t

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> RunResult:
        self._schedule()
        while self._trained < self.steps:
            if not self._heap:
                raise SimDeadlock(
                    f"no event left after {self._trained}/{self.steps} batches: consume={self.consume.stats()}, "
                    f"pending requests={self.dispatch.pending()}"
                )
            t, _, kind, data = heapq.heappop(self._heap)
            self.events += 1
            if self.events > self.max_events:
                raise SimDeadlock(f"more than {self.max_events} events")
            self._advance_clock(max(t, self.now))
            if kind == "inst":
                i, epoch = data
                if epoch != self._epoch[i]:
                    continue
                self._handle_ends(i, self.instances[i].run_next())
                self._touch(i)
            elif kind == "env":
                self._next_turn(data)
            elif kind == "train":
                self._train_done(data)
            self._schedule()
        return RunResult(self.figures(), self.timeline, self.batches)

    def _schedule(self) -> None:
        # again while a pass changed what the policy allows: taking a batch resolves finished groups (a
        # dynamic policy drops all-equal ones and may start more), and admitting a request syncs its
        # instance, which may finish a group
        while True:
            before = (self._next_group, self._groups_finished, len(self.batches))
            self._start_groups()
            self._try_train()
            self._fill()
            again = not self._enough_started() and self.consume.can_start()
            if not again and before == (self._next_group, self._groups_finished, len(self.batches)):
                return

    # -- groups, episodes, requests ---------------------------------------------------------------
    def _enough_started(self) -> bool:
        """Start nothing once every batch of the run is taken; until then the policy alone decides
        (so the last steps see the same competition for the engines as a longer run would)."""
        return len(self.batches) >= self.steps

    def _start_groups(self) -> None:
        while not self._enough_started() and self.consume.can_start():
            idx = self._next_group
            self._next_group += 1
            gid = f"g{idx}"
            plans = self.workload.group(idx)
            g = _Grp(gid, idx, self.consume.version, self.now, left=len(plans), mixed=self.workload.mixed(idx))
            self._groups[gid] = g
            self.consume.on_start(gid)
            if self.timeline is not None:
                self.timeline.mark(self.now, "group_start", group_id=gid, step=g.step)
            for plan in plans:
                ep = _Ep(g, plan, f"{gid}/m{plan.member}", ctx=self.workload.prompt_tokens)
                self._live_eps += 1
                self._submit_turn(ep)

    def _submit_turn(self, ep: _Ep) -> None:
        rid = f"{ep.lineage}/t{ep.turn}"
        r = _Req(rid, ep, ep.plan.turns[ep.turn].tokens)
        self._reqs[rid] = r
        self.dispatch.submit(RequestSpec(rid, ep.group.gid, self.workload.max_tokens), self.now)
        if self.timeline is not None:
            self.timeline.submit(self.now, rid, ep.group.gid)

    def _handle_ends(self, i: int, ends: list[ChunkEnd]) -> None:
        for e in ends:
            r = self._reqs[e.request_id]
            r.running = False
            g = r.ep.group
            self.generated += e.tokens
            if g.cancelled:
                self.wasted_tokens += e.tokens
                continue
            r.generated += e.tokens
            g.tokens += e.tokens
            r.ep.home, r.ep.home_tokens = i, r.ep.ctx + r.generated
            r.min_version = e.min_version if r.min_version is None else min(r.min_version, e.min_version)
            r.max_version = max(r.max_version, e.max_version)
            finished = r.generated >= r.target
            t = max(e.t, self.now)
            self.dispatch.on_chunk_done(r.rid, r.generated, finished, t)
            if self.timeline is not None:
                self.timeline.end(e.t, r.rid, e.tokens, "finish" if finished else "chunk")
            if finished:
                self._turn_done(r, e.t)

    def _turn_done(self, r: _Req, t: float) -> None:
        ep, g = r.ep, r.ep.group
        g.request_ends.append(t)
        if r.min_version is not None:
            g.min_version = r.min_version if g.min_version is None else min(g.min_version, r.min_version)
        ep.ctx += r.generated
        env = ep.plan.turns[ep.turn].env_s
        if env > 0:
            self._push(t + env, "env", ep)
        else:
            self._next_turn(ep)

    def _next_turn(self, ep: _Ep) -> None:
        g = ep.group
        if g.cancelled:
            return
        if ep.turn + 1 < len(ep.plan.turns):
            ep.turn += 1
            ep.ctx += self.workload.obs_tokens
            if self.on_turn is not None:
                self.on_turn(ep.lineage, ep.turn, self.workload.obs_tokens)
            self._submit_turn(ep)
            return
        self._live_eps -= 1
        g.left -= 1
        if g.left == 0:
            g.finished_at = self.now
            self._groups_finished += 1
            on_rewards = getattr(self.consume, "on_rewards", None)
            if on_rewards is not None:  # each group its own task: the simulated tasks do not repeat
                on_rewards(g.gid, g.gid, self.workload.rewards(g.index))
            self.consume.on_finish(g.gid, g.min_version)

    def _cancel_group(self, gid: str) -> None:
        g = self._groups[gid]
        if g.cancelled:
            return
        g.cancelled = True
        running = self.dispatch.cancel_group(gid)
        for rid in running:
            r = self._reqs[rid]
            i = r.instance
            if i is None:
                continue
            self._handle_ends(i, self.instances[i].sync_to(self.now))
            n = self.instances[i].abort(rid)
            r.running = False
            self.generated += n
            self.wasted_tokens += n
            if self.timeline is not None:
                self.timeline.end(self.now, rid, n, "cancel")
            self._touch(i)
        self.wasted_tokens += g.tokens
        self._live_eps -= g.left  # its unfinished episodes are no longer rollout work
        g.left = 0

    # -- trainer ----------------------------------------------------------------------------------
    def _try_train(self) -> None:
        if self._training is not None or self._trained >= self.steps:
            return
        b = self.consume.take_batch()
        if b is None:
            return
        for gid in b.cancel:
            self._cancel_group(gid)
        for gid in b.dropped:
            self.wasted_tokens += self._groups[gid].tokens
        tokens = sum(self._groups[g].tokens for g in b.items if self._groups[g].mixed or not self.drop_equal)
        self.trained_tokens += tokens
        steps = [self._groups[g].step for g in b.items]
        ends = sorted(t for g in b.items for t in self._groups[g].request_ends)
        starts = [self._groups[g].started_at for g in b.items]
        rec = {
            "version": b.version,
            "taken_at": self.now,
            "items": len(b.items),
            "trained_items": sum(1 for g in b.items if self._groups[g].mixed or not self.drop_equal),
            "tokens": tokens,
            "dropped": len(b.dropped),
            "cancelled": len(b.cancel),
            "max_gap": max(b.version - s for s in steps),
            "first_start": min(starts),
            "t90": ends[max(0, math.ceil(0.9 * len(ends)) - 1)] if ends else self.now,
            "t100": ends[-1] if ends else self.now,
        }
        dt = self.train_s(tokens)
        rec["train_s"] = dt
        self.batches.append(rec)
        self._training = b
        if self.timeline is not None:
            self.timeline.mark(self.now, "train", step=b.version, items=len(b.items))
        self._push(self.now + dt, "train", b)

    def _train_done(self, b: Batch) -> None:
        self._training = None
        self._trained += 1
        v = b.version + 1
        for gid in self.consume.on_version(v):
            self._cancel_group(gid)
        if self._trained >= self.steps:
            return
        for i, inst in enumerate(self.instances):
            self._handle_ends(i, inst.sync_to(self.now))
            if self.partial == "abort_resume":
                for rid in [r.rid for r in self._reqs.values() if r.instance == i and r.running]:
                    n = inst.abort(rid)
                    self._reqs[rid].running = False
                    self._resume(rid, n, i)
            inst.update_weights(v, self.now)
            self._touch(i)
        if self.timeline is not None:
            self.timeline.mark(self.now, "publish", step=v)

    def _resume(self, rid: str, tokens: int, i: int) -> None:
        """Partial rollout, abort-and-resume: the request keeps its tokens and goes back to the queue."""
        r = self._reqs[rid]
        r.generated += tokens
        r.ep.group.tokens += tokens
        self.generated += tokens
        r.ep.home, r.ep.home_tokens = i, r.ep.ctx + r.generated
        if self.timeline is not None:
            self.timeline.end(self.now, rid, tokens, "chunk")
        if r.generated >= r.target:
            self.dispatch.on_chunk_done(rid, r.generated, True, self.now)
            self._turn_done(r, self.now)
        else:
            self.dispatch.requeue(rid, r.generated, self.now)

    # -- dispatch ---------------------------------------------------------------------------------
    def _fill(self) -> None:
        n = len(self.instances)
        while self.dispatch.pending():
            progressed = False
            order = sorted(range(n), key=lambda i: (self.instances[i].load(), (i - self._rr) % n))
            for i in order:
                inst = self.instances[i]
                if not inst.has_room():
                    continue
                a = self.dispatch.next_for(i, self.now)
                if a is None:
                    continue
                self._admit(i, a)
                progressed = True
            self._rr = (self._rr + 1) % n
            if not progressed:
                break

    def _admit(self, i: int, a: Assignment) -> None:
        inst = self.instances[i]
        self._handle_ends(i, inst.sync_to(self.now))
        r = self._reqs[a.request_id]
        ep = r.ep
        stop = min(a.max_new_tokens, r.target - r.generated)
        r.instance = i
        r.running = True
        inst.admit(
            Admit(r.rid, ep.lineage, ep.ctx + r.generated, stop, home=ep.home, home_tokens=ep.home_tokens,
                  priority=a.priority, seed=derive_seed(r.rid, bits=31), reserve=0),
            self.now,
        )
        if self.timeline is not None:
            self.timeline.start(max(self.now, inst.clock), r.rid, ep.group.gid, i, version=inst.version,
                                probe=a.probe, step=ep.group.step)
        self._touch(i)

    # -- figures ----------------------------------------------------------------------------------
    def figures(self) -> dict[str, float]:
        end = self.now
        inst = [x.stats() for x in self.instances]
        busy = sum(s["busy_s"] for s in inst)
        steps = sum(s["decode_steps"] for s in inst)
        makespans = [b["t100"] - b["first_start"] for b in self.batches]
        tails = [b["t100"] - b["t90"] for b in self.batches]
        f = {
            "time_s": end,
            "steps": float(self._trained),
            "step_s": end / max(1, self._trained),
            "groups_started": float(self._next_group),
            "generated_tokens": float(self.generated),
            "trained_tokens": float(self.trained_tokens),
            "wasted_tokens": float(self.wasted_tokens),
            "rollout_s": self._rollout_s,
            "rollout_tokens_per_s": self.generated / self._rollout_s if self._rollout_s else 0.0,
            "train_tokens_per_s": self.trained_tokens / end if end else 0.0,
            "batch_makespan_s": sum(makespans) / len(makespans) if makespans else 0.0,
            "tail_s": sum(tails) / len(tails) if tails else 0.0,
            "utilization": busy / (len(self.instances) * end) if end else 0.0,
            "mean_batch": sum(s["mean_batch"] * s["decode_steps"] for s in inst) / steps if steps else 0.0,
            "preemptions": sum(s["preemptions"] for s in inst),
            "prefill_tokens": sum(s["prefill_tokens"] for s in inst),
            "cached_prefill_tokens": sum(s["cached_tokens"] for s in inst),
            "transfer_tokens": sum(s["transfer_tokens"] for s in inst),
            "events": float(self.events),
        }
        f.update({f"consume_{k}": v for k, v in self.consume.stats().items()})
        f.update({f"dispatch_{k}": v for k, v in self.dispatch.stats().items()})
        return f
