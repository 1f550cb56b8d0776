"""Consumption policies: each invariant as a property over random event sequences (hypothesis)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborl.config import SchedulingConfig
from arborl.registry import RegistryError
from arborl.scheduling.consume import (
    AsyncRatioConsume,
    SyncConsume,
    VersionGapFilter,
    WindowedFIFOConsume,
    make_consume,
)
from arborl.scheduling.policies import ConsumePolicy, window_items

# an event sequence: (op, selector); s = start, f = finish the selected running item, o / n = finish
# the oldest / newest running item (n lets old items fall behind), x = fail the selected one,
# t = the trainer finishes its batch and publishes
OPS = st.lists(st.tuples(st.sampled_from("ssssffonnxtt"), st.integers(0, 10**6)), min_size=40, max_size=300)


class World:
    """Drives a policy like a controller would, and keeps its own account of every item."""

    def __init__(self, policy, *, min_version=None) -> None:
        self.p = policy
        self.version = policy.version
        self.training = None
        self.n = 0
        self.start_v: dict[str, int] = {}
        self.seq: dict[str, int] = {}
        self.min_v: dict[str, int] = {}
        self.running: list[str] = []
        self.unresolved: set[str] = set()  # started, not consumed / dropped / cancelled / failed
        self.batches = []
        self.consumed: set[str] = set()  # taken into a batch (forming, training or trained)
        self.trained: set[str] = set()  # in a batch whose training has ended
        self.reported_drops = 0  # drops the policy has told about (a batch lists those made while forming it)
        self.max_ahead = 0  # most items ever started and not yet trained nor dropped (counted by this world)
        self.consumptions = []  # (item, older unresolved items at the moment it was consumed)
        self.min_version = min_version  # f(item, world) -> oldest token version reported at finish

    def run(self, ops) -> "World":
        for op, k in ops:
            self.step(op, k)
        return self

    def step(self, op: str, k: int) -> None:
        p = self.p
        if op == "s":
            if p.can_start():
                iid = f"i{self.n}"
                self.n += 1
                assert p.on_start(iid) == self.seq.setdefault(iid, len(self.seq))
                self.start_v[iid] = self.version
                self.running.append(iid)
                self.unresolved.add(iid)
        elif op in "fonx" and self.running:
            iid = self.running.pop(0 if op == "o" else -1 if op == "n" else k % len(self.running))
            if op == "x":
                p.on_fail(iid)
                self.unresolved.discard(iid)
            else:
                mv = self.min_version(iid, self) if self.min_version else None
                self.min_v[iid] = self.start_v[iid] if mv is None else mv
                p.on_finish(iid, mv)
        elif op == "t" and self.training is not None:
            self.trained.update(self.training.items)
            self.training = None
            self.version += 1
            for iid in p.on_version(self.version):
                self._resolve(iid)
        if self.training is None:
            self._take()
        # started and not yet trained: running or finished (unresolved), or taken and not trained yet;
        # less the items already dropped that the next batch will list
        unreported = int(self.p.stats()["dropped"]) - self.reported_drops
        ahead = len(self.unresolved) + len(self.consumed - self.trained) - unreported
        self.max_ahead = max(self.max_ahead, ahead)

    def _resolve(self, iid: str) -> None:
        self.unresolved.discard(iid)
        if iid in self.running:
            self.running.remove(iid)

    def _take(self) -> None:
        before = self.p.forming
        b = self.p.take_batch()
        now = b.items if b is not None else self.p.forming
        assert now[: len(before)] == before  # consumption is never undone
        dropped = set(b.dropped) if b is not None else set()
        self.reported_drops += len(dropped)
        for iid in dropped:
            self._resolve(iid)
        for iid in now[len(before):]:
            older = sum(1 for o in self.unresolved if self.seq[o] < self.seq[iid])
            self.consumptions.append((iid, older))
            assert iid not in self.running, "consumed an item that has not finished"
            self.unresolved.discard(iid)
            self.consumed.add(iid)
        if b is not None:
            assert b.version == self.version
            assert len(b.items) == self.p.batch_size and len(set(b.items)) == len(b.items)
            for iid in b.cancel:
                self._resolve(iid)
            self.batches.append(b)
            self.training = b


@settings(max_examples=300, deadline=None)
@given(ops=OPS, n=st.integers(1, 6), alpha=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]))
def test_async_ratio_never_trains_a_sample_older_than_alpha(ops, n, alpha):
    """Every trained item started at most ceil(α) versions before the version that trains it, and the
    look-ahead (items started and not yet trained, the batch in training included, counted by the
    world itself) never exceeds floor((1 + α) N)."""
    w = World(AsyncRatioConsume(n, alpha=alpha)).run(ops)
    bound = math.ceil(alpha)
    for b in w.batches:
        for iid in b.items:
            assert b.version - w.start_v[iid] <= bound
    assert w.max_ahead <= math.floor((1 + alpha) * n + 1e-9), (w.max_ahead, n, alpha)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("sssoot"), st.integers(0, 9)), max_size=250),
       n=st.integers(1, 6), alpha=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
def test_async_ratio_starts_nothing_that_cannot_finish_within_the_bound(ops, n, alpha):
    """Items that finish in start order are never dropped nor cancelled: admission already bounds them."""
    w = World(AsyncRatioConsume(n, alpha=alpha)).run(ops)
    st_ = w.p.stats()
    assert st_["dropped"] == 0 and st_["cancelled"] == 0


@pytest.mark.parametrize("alpha,expect", [(0.0, 2), (0.5, 3), (1.0, 4), (2.0, 6)])
def test_async_ratio_look_ahead(alpha, expect):
    p = AsyncRatioConsume(2, alpha=alpha)
    started = 0
    while p.can_start():
        p.on_start(f"i{started}")
        started += 1
    assert started == expect  # floor((1 + α) N)


def test_async_ratio_fractional_alpha_keeps_one_version_stale_fraction():
    """α = 0.5, N = 4: 6 items start at version 0; batch 0 trains 4 of them; 2 more start at version 1
    and batch 1 trains the 2 leftovers of version 0 (gap 1 = ceil(α)) with 2 fresh ones."""
    p = AsyncRatioConsume(4, alpha=0.5)
    for i in range(6):
        assert p.can_start()
        p.on_start(f"a{i}")
    assert not p.can_start()
    for i in range(6):
        p.on_finish(f"a{i}")
    b0 = p.take_batch()
    assert b0.items == ("a0", "a1", "a2", "a3") and b0.version == 0
    assert not p.can_start()  # 4 in training + 2 finished = 6 = floor(1.5 * 4)
    assert p.on_version(1) == []
    started = []
    while p.can_start():
        started.append(f"b{len(started)}")
        p.on_start(started[-1])
    assert len(started) == 4  # 2 leftovers + 4 new = 6
    for s in started:
        p.on_finish(s)
    b1 = p.take_batch()
    assert b1.items == ("a4", "a5", "b0", "b1") and b1.version == 1
    assert p.stats()["max_version_gap"] == 1


def test_async_ratio_drops_and_cancels_what_falls_behind():
    p = AsyncRatioConsume(1, alpha=1.0)
    p.on_start("old")  # version 0
    p.on_start("x")
    p.on_finish("x")
    assert p.take_batch().items == ("x",)
    assert p.on_version(1) == []
    p.on_start("y")
    p.on_finish("y")
    assert p.take_batch().items == ("y",)
    assert p.on_version(2) == ["old"]  # gap 2 > 1: can never be trained -> abort it
    p.on_finish("old")  # a late result of a cancelled item is ignored
    assert p.stats()["cancelled"] == 1 and p.stats()["trained"] == 2


@settings(max_examples=150, deadline=None)
@given(ops=OPS, n=st.integers(1, 8), window=st.sampled_from([0.1, 0.3, 0.5, 1.0]), alpha=st.sampled_from([0.5, 1.0, 2.0]))
def test_windowed_fifo_never_consumes_outside_the_window(ops, n, window, alpha):
    w = World(WindowedFIFOConsume(n, window=window, alpha=alpha)).run(ops)
    W = window_items(window, n)
    for iid, older in w.consumptions:
        assert older <= W - 1, (iid, older, W)  # inside [H, H + W): at most W - 1 older unfinished
    assert w.p.stats()["max_out_of_order"] <= W - 1


def test_windowed_fifo_waits_for_the_head():
    p = WindowedFIFOConsume(3, window=0.34, alpha=2.0)  # W = 2
    for i in range(6):
        p.on_start(f"i{i}")
    for i in (1, 2, 3, 4):  # i0 (the head) is still running
        p.on_finish(f"i{i}")
    assert p.take_batch() is None
    assert p.forming == ("i1",)  # only i1 is inside [0, 2)
    p.on_finish("i0")
    b = p.take_batch()
    assert b.items == ("i1", "i0", "i2")  # then the window slides: first finished first
    assert p.stats()["max_out_of_order"] == 1


@settings(max_examples=100, deadline=None)
@given(ops=OPS, n=st.integers(1, 6), oversample=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
def test_sync_trains_only_its_own_version_and_cancels_the_surplus(ops, n, oversample):
    p = SyncConsume(n, oversample=oversample)
    w = World(p)
    for op, k in ops:
        if w.training is not None and op == "s":
            assert not p.can_start()  # nothing starts while the trainer trains
        w.step(op, k)
    for b in w.batches:
        assert all(w.start_v[i] == b.version for i in b.items)
        # everything else started for that version is cancelled or dropped as surplus
        rest = {i for i, v in w.start_v.items() if v == b.version} - set(b.items)
        assert rest <= set(b.cancel) | set(b.dropped) | {i for i in rest if i not in w.unresolved}


@settings(max_examples=100, deadline=None)
@given(ops=OPS, n=st.integers(1, 5), name=st.sampled_from(["sync", "async_ratio", "windowed_fifo"]),
       gap=st.integers(0, 2), back=st.integers(0, 3))
def test_version_gap_filter_composes_with_every_policy(ops, n, name, gap, back):
    """slime S4: whatever the policy, no trained item's oldest token is more than max_gap versions old."""
    p = make_consume(SchedulingConfig(consume=name, async_ratio=2.0, max_version_gap=gap), n)
    w = World(p, min_version=lambda iid, w: max(0, w.start_v[iid] - back)).run(ops)
    for b in w.batches:
        for iid in b.items:
            assert b.version - w.min_v[iid] <= gap
    assert isinstance(p, ConsumePolicy)


def test_version_gap_filter_alone():
    from arborl.scheduling.consume import Item

    f = VersionGapFilter(1)
    assert not f.reject(Item("a", 0, start_version=3, min_version=3), 4)
    assert f.reject(Item("a", 0, start_version=3, min_version=2), 4)  # a token of v2 is 2 versions old


def test_make_consume_builds_the_configured_policy_and_rejects_bad_values():
    p = make_consume(SchedulingConfig(consume="windowed_fifo", window=0.5, async_ratio=2.0), 4, version=3)
    assert isinstance(p, WindowedFIFOConsume) and p.window == 2 and p.version == 3
    with pytest.raises(RegistryError, match="unknown consumption policy 'fifo'"):
        make_consume(SchedulingConfig(), 4, name="fifo")
    with pytest.raises(ValueError):
        AsyncRatioConsume(4, alpha=-1)
    with pytest.raises(ValueError):
        make_consume(SchedulingConfig(), 0)
    with pytest.raises(ValueError):
        WindowedFIFOConsume(4, window=0)


def test_policies_form_batches_under_random_events():
    """The property tests above are not vacuous: random event sequences do train batches."""
    import random

    rng = random.Random(0)
    for name in ("sync", "async_ratio", "windowed_fifo"):
        w = World(make_consume(SchedulingConfig(consume=name, async_ratio=1.0), 3)).run([(rng.choice("ssssffoxtt"), rng.randrange(10**6)) for _ in range(300)])
        assert len(w.batches) >= 5, name


@pytest.mark.parametrize("name", ["sync", "async_ratio", "windowed_fifo", "dynamic"])
def test_a_snapshot_restores_counters_and_open_items_in_order_into_a_fresh_policy(name):
    import json

    sched = SchedulingConfig(consume=name, async_ratio=1.0, window=0.5)
    p = make_consume(sched, 2)
    for i in range(p._cap if name != "dynamic" else 2):
        p.on_start(f"g{i}")
    p.on_finish("g0", 0)
    if name == "dynamic":
        p.on_rewards("g1", "t1", [0.0, 1.0])
    p.on_finish("g1", 0)
    batch = p.take_batch()
    assert batch is not None and batch.items == ("g0", "g1")
    p.on_version(1)
    if name != "sync" and name != "dynamic":
        p.on_start("late")  # started at version 1, open at the checkpoint
    snap = json.loads(json.dumps(p.snapshot()))  # what a checkpoint stores is JSON
    fresh = make_consume(sched, 2, version=1)
    reopened = fresh.restore(snap)
    assert reopened == [it.item_id for it in p.open_items()]
    assert fresh.counts == p.counts and fresh.stats()["max_version_gap"] == p.stats()["max_version_gap"]
    assert [fresh.item(i).start_version for i in reopened] == [p.item(i).start_version for i in reopened]
    if name == "dynamic":
        assert fresh.pass_rates() == p.pass_rates() == {"t1": 0.5}
    if reopened:
        with pytest.raises(ValueError, match="started nothing"):
            fresh.restore(snap)
    # the restored items finish and are trained as they would have been
    for i in reopened:
        fresh.on_finish(i, fresh.item(i).start_version)
    while fresh.can_start():
        fresh.on_start(f"new{fresh.counts['started']}")
        fresh.on_finish(f"new{fresh.counts['started'] - 1}", 1)
    nxt = fresh.take_batch()
    assert nxt is not None and nxt.version == 1
