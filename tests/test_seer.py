"""Dispatch policies: Seer's rule checked decision by decision against a brute-force reading of it,
and pinned's invariants, over random event sequences (hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborl.scheduling.policies import PRIORITY_PROBE, DispatchPolicy, RequestSpec
from arborl.config import SchedulingConfig
from arborl.registry import RegistryError
from arborl.scheduling.dispatch import PinnedDispatch, SeerDispatch, make_dispatch

MAX = 64


class Shadow:
    """The test's own account of every request: enough to compute what Seer must pick."""

    def __init__(self) -> None:
        self.req: dict[str, dict] = {}
        self.groups: dict[str, dict] = {}
        self.enqs = 0

    def submit(self, rid: str, gid: str, t: float) -> None:
        g = self.groups.setdefault(gid, {"first": rid, "finished": None, "generated": 0, "reqs": []})
        g["reqs"].append(rid)
        self.req[rid] = {"gid": gid, "gen": 0, "state": "pending"}
        self.enqueue(rid, t)

    def enqueue(self, rid: str, t: float) -> None:
        self.enqs += 1
        self.req[rid].update(state="pending", enq=self.enqs, t=t)

    def estimate(self, gid: str) -> int:
        g = self.groups[gid]
        return MAX if g["finished"] is None else max(g["finished"], g["generated"])

    def is_probe(self, rid: str) -> bool:
        g = self.groups[self.req[rid]["gid"]]
        return g["first"] == rid and g["finished"] is None

    def expected(self, now: float, starvation_s: float, context_aware: bool) -> tuple[set[str], str]:
        """The requests Seer may pick now (all equally right), and which rule applies."""
        pend = [r for r, s in self.req.items() if s["state"] == "pending"]
        if not pend:
            return set(), "none"
        oldest = min(pend, key=lambda r: self.req[r]["enq"])
        if not context_aware:
            return {oldest}, "fifo"
        if now - self.req[oldest]["t"] >= starvation_s:
            return {oldest}, "starved"
        probes = [r for r in pend if self.is_probe(r)]
        if probes:
            return {min(probes, key=lambda r: self.req[r]["enq"])}, "probe"
        best = max(self.estimate(self.req[r]["gid"]) for r in pend)
        top = [r for r in pend if self.estimate(self.req[r]["gid"]) == best]
        return {min(top, key=lambda r: self.req[r]["enq"])}, "longest"


# events: (op, a, b): n = new group of a % 4 + 1 requests, m = one more request for an existing group
# (a later turn), d = dispatch to instance a % 3, c = chunk done (+b % 24 + 1 tokens, finished if a is
# odd), r = requeue a running request, x = cancel a group; every event advances the clock by b % 5 s
EVENTS = st.lists(st.tuples(st.sampled_from("nnmddddddccccrx"), st.integers(0, 1000), st.integers(0, 1000)),
                  min_size=20, max_size=200)


def drive_seer(events, *, chunk: int, starvation_s: float, context_aware: bool):
    p = SeerDispatch(chunk_tokens=chunk, context_aware=context_aware, starvation_s=starvation_s)
    sh = Shadow()
    now, n = 0.0, 0
    running: list[str] = []
    picks = []
    for op, a, b in events:
        now += b % 5
        if op == "n" or (op == "m" and not sh.groups):
            gid = f"g{len(sh.groups)}"
            for _ in range(a % 4 + 1):
                rid = f"r{n}"
                n += 1
                p.submit(RequestSpec(rid, gid, MAX), now)
                sh.submit(rid, gid, now)
        elif op == "m":
            gid = sorted(sh.groups)[a % len(sh.groups)]
            rid = f"r{n}"
            n += 1
            p.submit(RequestSpec(rid, gid, MAX), now)
            sh.submit(rid, gid, now)
        elif op == "d":
            want, rule = sh.expected(now, starvation_s, context_aware)
            got = p.next_for(a % 3, now)
            if not want:
                assert got is None
                continue
            assert got is not None and got.request_id in want, (rule, got, want)
            s = sh.req[got.request_id]
            assert got.max_new_tokens == (min(chunk, MAX - s["gen"]) if chunk else MAX - s["gen"])
            assert got.probe == (context_aware and sh.is_probe(got.request_id)) and got.starved == (rule == "starved")
            assert (got.priority == PRIORITY_PROBE) == got.probe
            s["state"] = "running"
            s["max_new"] = got.max_new_tokens
            running.append(got.request_id)
            picks.append((rule, got.request_id))
        elif op == "c" and running:
            rid = running.pop(a % len(running))
            s = sh.req[rid]
            s["gen"] = min(MAX, s["gen"] + min(s["max_new"], b % 24 + 1))
            finished = a % 2 == 1 or s["gen"] >= MAX
            p.on_chunk_done(rid, s["gen"], finished, now)
            g = sh.groups[s["gid"]]
            g["generated"] = max(g["generated"], s["gen"])
            if finished:
                s["state"] = "done"
                g["finished"] = max(g["finished"] or 0, s["gen"])
            else:
                sh.enqueue(rid, now)
        elif op == "r" and running:
            rid = running.pop(a % len(running))
            p.requeue(rid, sh.req[rid]["gen"], now)
            sh.enqueue(rid, now)
        elif op == "x" and sh.groups:
            gid = sorted(sh.groups)[a % len(sh.groups)]
            back = p.cancel_group(gid)
            mine = [r for r in sh.groups[gid]["reqs"] if sh.req[r]["state"] == "running"]
            assert sorted(back) == sorted(mine)
            for r in sh.groups[gid]["reqs"]:
                if sh.req[r]["state"] in ("pending", "running"):
                    sh.req[r]["state"] = "cancelled"
            running = [r for r in running if r not in mine]
        assert p.pending() == sum(1 for s in sh.req.values() if s["state"] == "pending")
    return picks


@settings(max_examples=200, deadline=None)
@given(events=EVENTS, chunk=st.sampled_from([0, 8, 16]), starvation=st.sampled_from([math.inf, 6.0, 20.0]))
def test_seer_decisions_follow_its_rule(events, chunk, starvation):
    """Oldest starved request, else oldest probe, else longest group estimate (earliest queued on ties):
    every decision of SeerDispatch equals this brute-force reading of the rule."""
    drive_seer(events, chunk=chunk, starvation_s=starvation, context_aware=True)


@settings(max_examples=100, deadline=None)
@given(events=EVENTS, chunk=st.sampled_from([0, 8]))
def test_seer_without_context_awareness_is_a_fifo_queue(events, chunk):
    drive_seer(events, chunk=chunk, starvation_s=math.inf, context_aware=False)


def test_seer_runs_probes_first_then_longest_first():
    p = SeerDispatch(chunk_tokens=0)
    for g in range(3):
        for m in range(3):
            p.submit(RequestSpec(f"g{g}m{m}", f"g{g}", 100), 0.0)
    probes = [p.next_for(0, 0.0) for _ in range(3)]
    assert [a.request_id for a in probes] == ["g0m0", "g1m0", "g2m0"] and all(a.probe for a in probes)
    # probe lengths: g0 short, g2 long; g1's probe still runs (unknown -> max length)
    p.on_chunk_done("g0m0", 10, True, 1.0)
    p.on_chunk_done("g2m0", 60, True, 1.0)
    order = [p.next_for(0, 2.0).request_id for _ in range(6)]
    assert order == ["g1m1", "g1m2", "g2m1", "g2m2", "g0m1", "g0m2"]
    assert p.next_for(0, 2.0) is None


def test_seer_divides_requests_into_chunks_and_requeues_them():
    p = SeerDispatch(chunk_tokens=16, context_aware=False)
    p.submit(RequestSpec("a", "g", 40), 0.0)
    sizes = []
    gen = 0
    while (x := p.next_for(len(sizes) % 2, 0.0)) is not None:
        sizes.append(x.max_new_tokens)
        gen += x.max_new_tokens
        p.on_chunk_done("a", gen, False, 0.0)
    assert sizes == [16, 16, 8] and gen == 40
    assert p.stats()["migrations"] == 2  # instances 0, 1, 0


def test_seer_anti_starvation_beats_probes():
    p = SeerDispatch(chunk_tokens=0, starvation_s=10.0)
    p.submit(RequestSpec("a0", "a", 50), 0.0)
    p.submit(RequestSpec("a1", "a", 50), 0.0)
    assert p.next_for(0, 0.0).request_id == "a0"  # a's probe
    p.submit(RequestSpec("b0", "b", 50), 5.0)  # a new group's probe
    x = p.next_for(0, 12.0)  # a1 has waited 12 s >= 10 s
    assert x.request_id == "a1" and x.starved and not x.probe


@settings(max_examples=100, deadline=None)
@given(events=EVENTS, instances=st.integers(1, 4))
def test_pinned_keeps_groups_on_one_instance_in_fifo_order(events, instances):
    p = PinnedDispatch(instances)
    where: dict[str, int] = {}
    queues: dict[int, list[str]] = {i: [] for i in range(instances)}
    gen: dict[str, int] = {}
    group_of: dict[str, str] = {}
    running: list[str] = []
    n = 0
    for op, a, b in events:
        if op in "nm":
            gid = f"g{a % 6}"
            for _ in range(a % 3 + 1):
                rid = f"r{n}"
                n += 1
                p.submit(RequestSpec(rid, gid, MAX), 0.0)
                where.setdefault(gid, p.instance_of(gid))
                assert p.instance_of(gid) == where[gid]  # pinned for good
                queues[where[gid]].append(rid)
                gen[rid], group_of[rid] = 0, gid
        elif op == "d":
            i = a % instances
            x = p.next_for(i, 0.0)
            if not queues[i]:
                assert x is None
                continue
            assert x.request_id == queues[i].pop(0) and x.instance == i
            assert x.max_new_tokens == MAX - gen[x.request_id]  # whole requests
            running.append(x.request_id)
        elif op == "c" and running:
            rid = running.pop(a % len(running))
            gen[rid] = MAX
            p.on_chunk_done(rid, MAX, True, 0.0)
        elif op == "r" and running:
            rid = running.pop(a % len(running))
            gen[rid] = b % MAX
            p.requeue(rid, gen[rid], 0.0)
            queues[where[group_of[rid]]].insert(0, rid)  # back at the head of its instance
        elif op == "x" and where:
            gid = sorted(where)[a % len(where)]
            back = p.cancel_group(gid)
            assert sorted(back) == sorted(r for r in running if group_of[r] == gid)
            running = [r for r in running if group_of[r] != gid]
            for q in queues.values():
                q[:] = [r for r in q if group_of[r] != gid]
        assert p.pending() == sum(map(len, queues.values()))


def test_pinned_spreads_groups_over_the_least_loaded_instances():
    p = PinnedDispatch(3)
    for g in range(6):
        for m in range(2):
            p.submit(RequestSpec(f"g{g}m{m}", f"g{g}", 10), 0.0)
    assert [p.instance_of(f"g{g}") for g in range(6)] == [0, 1, 2, 0, 1, 2]


def test_factory_and_protocol():
    seer = make_dispatch(SchedulingConfig(dispatch="seer", chunk_tokens=9, context_aware=False), 2)
    assert isinstance(seer, SeerDispatch) and isinstance(seer, DispatchPolicy)
    assert seer.chunk_tokens == 9 and seer.context_aware is False  # the knobs reach the policy
    assert isinstance(make_dispatch(SchedulingConfig(dispatch="pinned"), 2), PinnedDispatch)
    with pytest.raises(ValueError, match="affinity is the engine pool's session placement"):
        make_dispatch(SchedulingConfig(), 2)  # the default, affinity, is no dispatch policy
    with pytest.raises(RegistryError, match="unknown dispatch policy 'random'"):
        make_dispatch(SchedulingConfig(), 2, name="random")
    with pytest.raises(ValueError):
        SeerDispatch(chunk_tokens=-1)
    p = SeerDispatch()
    p.submit(RequestSpec("a", "g", 5), 0.0)
    with pytest.raises(ValueError, match="twice"):
        p.submit(RequestSpec("a", "g", 5), 0.0)


def test_a_queued_probe_stays_queued_when_its_group_first_finishes_at_the_cap():
    """Regression: the probe is back in the queue (preempted) when another member finishes at exactly
    max_tokens; the group's estimate does not change, but the probe is no longer one and must still be
    dispatched (it was once dropped from every queue)."""
    p = SeerDispatch(chunk_tokens=8)
    p.submit(RequestSpec("a0", "a", 8), 0.0)
    p.submit(RequestSpec("a1", "a", 8), 0.0)
    assert p.next_for(0, 0.0).request_id == "a0"
    assert p.next_for(1, 0.0).request_id == "a1"
    p.requeue("a0", 3, 1.0)
    p.on_chunk_done("a1", 8, True, 2.0)
    x = p.next_for(0, 3.0)
    assert x is not None and x.request_id == "a0" and not x.probe and x.max_new_tokens == 5
    assert p.pending() == 0 and p.next_for(0, 4.0) is None


def test_forget_frees_finished_requests_and_idle_groups(monkeypatch):
    import arborl.scheduling.dispatch as seer

    monkeypatch.setattr(seer, "MAX_IDLE_GROUPS", 2)
    for p in (SeerDispatch(chunk_tokens=0), PinnedDispatch(2)):
        for g in range(4):
            rid = f"r{g}"
            p.submit(RequestSpec(rid, f"g{g}", 4), 0.0)
            a = p.next_for(p.instance_of(f"g{g}") if isinstance(p, PinnedDispatch) else 0, 0.0)
            assert a.request_id == rid
            p.on_chunk_done(rid, 4, True, 1.0)
            p.forget(rid)
        assert not p.known_requests() and sorted(p.known_groups()) == ["g2", "g3"]  # the two most recent idle groups kept
        if isinstance(p, PinnedDispatch):
            assert [g for g in ("g0", "g1", "g2", "g3") if p.instance_of(g) is not None] == ["g2", "g3"]
            assert [p.load(i) for i in range(2)] == [0, 0]


def test_pinned_moves_a_gone_instances_groups():
    p = PinnedDispatch(2)
    for g in range(4):
        p.submit(RequestSpec(f"r{g}", f"g{g}", 4), 0.0)
    on1 = [g for g in range(4) if p.instance_of(f"g{g}") == 1]
    assert on1
    p.remove_instance(1)
    assert all(p.instance_of(f"g{g}") == 0 for g in range(4))
    got = [p.next_for(0, 0.0).request_id for _ in range(4)]
    assert sorted(got) == ["r0", "r1", "r2", "r3"] and p.next_for(1, 0.0) is None
    p.submit(RequestSpec("r9", "g9", 4), 0.0)
    assert p.instance_of("g9") == 0


def test_a_larger_max_tokens_rekeys_an_unknown_groups_queued_requests():
    p = SeerDispatch(chunk_tokens=0)
    for rid, gid, m in (("a0", "a", 10), ("a1", "a", 10), ("b0", "b", 50), ("b1", "b", 50)):
        p.submit(RequestSpec(rid, gid, m), 0.0)
    assert {p.next_for(0, 0.0).request_id, p.next_for(0, 0.0).request_id} == {"a0", "b0"}  # the probes
    p.submit(RequestSpec("a2", "a", 100), 1.0)  # a's estimate (no member finished) is now 100
    assert [p.next_for(0, 2.0).request_id for _ in range(3)] == ["a1", "a2", "b1"]
