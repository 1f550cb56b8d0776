"""Consumption policies (S1, S2, S4): which finished items the trainer may take, and when to start more.

Vocabulary. Items start in *generation order* (their ``seq``: 0, 1, 2, ...). The trainer has
trained ``version`` batches (its weights are version ``version``); a batch returned by
``take_batch`` is trained at that version, then ``on_version(version + 1)`` is called. The *gap* of
an item is ``trainer version - version that started it``.

* ``sync``: on-policy. Items start only while the trainer waits, all at the trainer's version; the
  step waits for ``batch_size`` of them. With ``oversample`` r > 0, ceil((1 + r) N) start and the
  first N to finish are trained; the surplus is cancelled (running) or dropped (finished).
* ``async_ratio`` (ROLL): generation runs at most α batches ahead of training: an item may start
  only while the items started and not yet trained (the batch in training included) number fewer
  than floor((1 + α) N). A finished item is trained only if its gap is <= ceil(α) (= α for integer
  α); staler ones are dropped and counted, and running ones that can no longer make it are cancelled
  at the version bump. Integer α: every trained sample is at most α versions old. Fractional α
  (ROLL's "ratio of ahead generation"): α N items of look-ahead, so at most a fraction α of a batch
  is one version stale. Under these admission rules an item never needs to be dropped if items
  finish in start order: no item is started that could not finish within the bound.
* ``windowed_fifo`` (Forge): with H the oldest unresolved item in generation order, the trainer
  may take only finished items with seq in [H, H + W); inside the window, first finished is first
  taken. Consuming the head advances the window; an item is consumed ahead of at most W - 1 older
  unresolved ones. W = ceil(window x N) (Forge: 0.3 N). Look-ahead as async_ratio's admission.
* ``VersionGapFilter`` (slime S4): drops a finished item whose oldest token is more than
  ``max_gap`` versions behind the trainer; composes with any policy (``filters=``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

from arborl.registry import Registry
from arborl.scheduling.policies import Batch, ConsumePolicy, ahead_items, window_items

if TYPE_CHECKING:
    from arborl.config import SchedulingConfig

RUNNING, FINISHED, TAKEN, DROPPED, CANCELLED, FAILED = "running", "finished", "taken", "dropped", "cancelled", "failed"
_OPEN = (RUNNING, FINISHED)


@dataclass(slots=True)
class Item:
    item_id: str
    seq: int  # generation order
    start_version: int
    state: str = RUNNING
    min_version: int = 0  # oldest policy version among its tokens (partial rollout spans versions)


class SampleFilter(Protocol):
    name: str

    def reject(self, item: Item, version: int) -> bool: ...


@dataclass(frozen=True)
class VersionGapFilter:
    """slime S4: drop a sample whose oldest token is more than ``max_gap`` versions old."""

    max_gap: int
    name: str = "version_gap"

    def reject(self, item: Item, version: int) -> bool:
        return version - item.min_version > self.max_gap


class _Consume:
    name = "base"
    overlaps_training = True  # generation may run while the trainer trains (False: the step waits for its batch)

    def __init__(self, batch_size: int, *, cap: int, filters: Sequence[SampleFilter] = (), version: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.version = version
        self.filters = tuple(filters)
        self._cap = cap
        self._taken = version  # batches handed out; taken - version is 1 while the trainer trains
        self._items: dict[str, Item] = {}
        self._by_seq: list[Item] = []
        self._head = 0  # index (= seq) of the oldest unresolved item
        self._finished: dict[str, Item] = {}  # finished, not yet taken, in finish order
        self._forming: list[str] = []  # taken into the next batch
        self._open = 0  # running + finished
        self._dropped_since: list[str] = []
        self.counts = {"started": 0, "finished": 0, "trained": 0, "cancelled": 0, "failed": 0, "batches": 0}
        self.dropped: dict[str, int] = {}
        self.max_gap = 0
        self.gap_sum = 0
        self.max_lag = 0  # most older unresolved items an item was consumed ahead of

    # -- events -----------------------------------------------------------------------------------
    def can_start(self) -> bool:
        return self._ahead() < self._cap

    def _ahead(self) -> int:
        """Items started and not yet trained: the batch in training, the forming one, running, finished."""
        return (self._taken - self.version) * self.batch_size + len(self._forming) + self._open

    def on_start(self, item_id: str) -> int:
        if item_id in self._items:
            raise ValueError(f"item {item_id!r} started twice")
        it = Item(item_id, len(self._by_seq), self.version, min_version=self.version)
        self._items[item_id] = it
        self._by_seq.append(it)
        self._open += 1
        self.counts["started"] += 1
        return it.seq

    def on_finish(self, item_id: str, min_version: int | None = None) -> None:
        it = self._items[item_id]
        if it.state != RUNNING:  # cancelled meanwhile: its late result is ignored
            return
        it.state = FINISHED
        it.min_version = it.start_version if min_version is None else min_version
        self._finished[item_id] = it
        self.counts["finished"] += 1

    def on_fail(self, item_id: str) -> None:
        it = self._items[item_id]
        if it.state in _OPEN:
            self._resolve(it, FAILED)
            self.counts["failed"] += 1

    def on_version(self, version: int) -> list[str]:
        """The trainer now holds ``version``. Returns running items to abort (never trainable)."""
        self.version = version
        self._taken = max(self._taken, version)
        cancel = []
        for it in self._by_seq[self._head:]:
            if it.state == RUNNING and self._hopeless(it):
                self._resolve(it, CANCELLED)
                self.counts["cancelled"] += 1
                cancel.append(it.item_id)
        return cancel

    def on_batch_skipped(self) -> None:
        """The batch taken last was not trained (no learning signal in it): the trainer keeps its
        version and is ready for the next batch."""
        self._taken = self.version

    def take_batch(self) -> Batch | None:
        if self._taken > self.version:
            return None  # the previous batch is still being trained
        while len(self._forming) < self.batch_size:
            it = self._candidate()
            if it is None:
                break
            reason = self._reject(it)
            if reason is not None:
                self._drop(it, reason)
                continue
            self._consume(it)
        if len(self._forming) < self.batch_size:
            return None
        cancel = self._batch_full()
        batch = Batch(self.version, tuple(self._forming), tuple(self._dropped_since), tuple(cancel))
        self._forming, self._dropped_since = [], []
        self._taken += 1
        self.counts["batches"] += 1
        return batch

    # -- policy hooks -----------------------------------------------------------------------------
    def _candidate(self) -> Item | None:
        """The next finished item to consider (default: first finished)."""
        return next(iter(self._finished.values()), None)

    def _reject(self, it: Item) -> str | None:
        for f in self.filters:
            if f.reject(it, self.version):
                return f.name
        return None

    def _hopeless(self, it: Item) -> bool:
        return False

    def _batch_full(self) -> list[str]:
        return []

    # -- bookkeeping ------------------------------------------------------------------------------
    def _resolve(self, it: Item, state: str) -> None:
        if it.state == FINISHED:
            self._finished.pop(it.item_id, None)
        if it.state in _OPEN:
            self._open -= 1
        it.state = state
        while self._head < len(self._by_seq) and self._by_seq[self._head].state not in _OPEN:
            self._head += 1

    def _drop(self, it: Item, reason: str) -> None:
        self._resolve(it, DROPPED)
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self._dropped_since.append(it.item_id)

    def _consume(self, it: Item) -> None:
        lag = sum(1 for o in self._by_seq[self._head : it.seq] if o.state in _OPEN)
        self.max_lag = max(self.max_lag, lag)
        gap = self.version - it.start_version
        self.max_gap = max(self.max_gap, gap)
        self.gap_sum += gap
        self._resolve(it, TAKEN)
        self._forming.append(it.item_id)
        self.counts["trained"] += 1

    # -- checkpoint --------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What a checkpoint keeps (between steps): the counters and the open items in generation order.
        The batch just trained is resolved; nothing is forming."""
        return {"counts": dict(self.counts), "dropped": dict(self.dropped), "max_gap": self.max_gap,
                "gap_sum": self.gap_sum, "max_lag": self.max_lag,
                "open": [{"item_id": it.item_id, "start_version": it.start_version} for it in self.open_items()]}

    def restore(self, snap: dict) -> list[str]:
        """A fresh policy (at the checkpoint's version) takes a snapshot's state; its open items start
        again, running, in their generation order. Returns their ids."""
        if self._items:
            raise ValueError("restore() needs a policy that has started nothing")
        self.counts.update(snap["counts"])
        self.dropped.update(snap["dropped"])
        self.max_gap, self.gap_sum, self.max_lag = snap["max_gap"], snap["gap_sum"], snap["max_lag"]
        for o in snap["open"]:
            it = Item(o["item_id"], len(self._by_seq), o["start_version"], min_version=o["start_version"])
            self._items[it.item_id] = it
            self._by_seq.append(it)
            self._open += 1
        return [o["item_id"] for o in snap["open"]]

    # -- read-only views --------------------------------------------------------------------------
    def item(self, item_id: str) -> Item:
        return self._items[item_id]

    @property
    def head(self) -> int:
        return self._head

    @property
    def forming(self) -> tuple[str, ...]:
        """Items already taken into the next batch, in consumption order."""
        return tuple(self._forming)

    def open_items(self) -> Iterable[Item]:
        return (it for it in self._by_seq[self._head :] if it.state in _OPEN)

    def stats(self) -> dict[str, float]:
        n = self.counts["trained"]
        return {
            **{k: float(v) for k, v in self.counts.items()},
            "dropped": float(sum(self.dropped.values())),
            **{f"dropped_{k}": float(v) for k, v in self.dropped.items()},
            "max_version_gap": float(self.max_gap),
            "mean_version_gap": self.gap_sum / n if n else 0.0,
            "max_out_of_order": float(self.max_lag),
        }


class SyncConsume(_Consume):
    """On-policy: start ceil((1 + oversample) N) items per version, train the first N finished."""

    name = "sync"
    overlaps_training = False

    def __init__(self, batch_size: int, *, oversample: float = 0.0, filters: Sequence[SampleFilter] = (),
                 version: int = 0) -> None:
        if oversample < 0:
            raise ValueError(f"oversample must be >= 0, got {oversample}")
        super().__init__(batch_size, cap=math.ceil((1 + oversample) * batch_size - 1e-9), filters=filters, version=version)

    def can_start(self) -> bool:
        return self._taken == self.version and len(self._forming) + self._open < self._cap

    def _reject(self, it: Item) -> str | None:
        if it.start_version != self.version:
            return "stale"
        return super()._reject(it)

    def _hopeless(self, it: Item) -> bool:
        return it.start_version < self.version

    def _batch_full(self) -> list[str]:
        """Surplus of an over-sampled step: cancel the running, drop the finished."""
        cancel = []
        for it in list(self.open_items()):
            if it.start_version != self.version:
                continue
            if it.state == RUNNING:
                self._resolve(it, CANCELLED)
                self.counts["cancelled"] += 1
                cancel.append(it.item_id)
            else:
                self._drop(it, "surplus")
        return cancel


class AsyncRatioConsume(_Consume):
    """ROLL's asynchronous ratio α: look-ahead floor((1 + α) N) items, trained gap <= ceil(α)."""

    name = "async_ratio"

    def __init__(self, batch_size: int, *, alpha: float = 1.0, filters: Sequence[SampleFilter] = (),
                 version: int = 0) -> None:
        if alpha < 0:
            raise ValueError(f"async ratio must be >= 0, got {alpha}")
        self.alpha = alpha
        self.bound = math.ceil(alpha - 1e-9)
        super().__init__(batch_size, cap=ahead_items(alpha, batch_size), filters=filters, version=version)

    def _reject(self, it: Item) -> str | None:
        if self.version - it.start_version > self.bound:
            return "async_ratio"
        return super()._reject(it)

    def _hopeless(self, it: Item) -> bool:
        return self.version - it.start_version > self.bound


class WindowedFIFOConsume(_Consume):
    """Forge's windowed FIFO: only finished items inside [H, H + W) of generation order are taken."""

    name = "windowed_fifo"

    def __init__(self, batch_size: int, *, window: float = 0.3, alpha: float = 1.0,
                 filters: Sequence[SampleFilter] = (), version: int = 0) -> None:
        if not 0 < window:
            raise ValueError(f"window must be > 0 (a fraction of the batch), got {window}")
        self.window = window_items(window, batch_size)
        super().__init__(batch_size, cap=ahead_items(alpha, batch_size), filters=filters, version=version)

    def _candidate(self) -> Item | None:
        end = self._head + self.window
        for it in self._finished.values():
            if it.seq < end:
                return it
        return None


class ConsumeFactory(Protocol):
    """A consumption policy by name (``scheduling.consume``): built from the scheduling knobs, the
    batch size (items per training step), the trainer's version and the sample filters."""

    def __call__(self, sched: "SchedulingConfig", batch_size: int, *, version: int,
                 filters: Sequence[SampleFilter]) -> ConsumePolicy: ...


CONSUME_POLICIES: Registry[ConsumeFactory] = Registry("consumption policy")


@CONSUME_POLICIES.register("sync")
def _sync(sched: "SchedulingConfig", batch_size: int, *, version: int, filters: Sequence[SampleFilter]) -> SyncConsume:
    return SyncConsume(batch_size, oversample=sched.oversample, filters=filters, version=version)


@CONSUME_POLICIES.register("async_ratio")
def _async_ratio(sched: "SchedulingConfig", batch_size: int, *, version: int,
                 filters: Sequence[SampleFilter]) -> AsyncRatioConsume:
    return AsyncRatioConsume(batch_size, alpha=sched.async_ratio, filters=filters, version=version)


@CONSUME_POLICIES.register("windowed_fifo")
def _windowed_fifo(sched: "SchedulingConfig", batch_size: int, *, version: int,
                   filters: Sequence[SampleFilter]) -> WindowedFIFOConsume:
    return WindowedFIFOConsume(batch_size, window=sched.window, alpha=sched.async_ratio, filters=filters, version=version)


def make_consume(sched: "SchedulingConfig", batch_size: int, *, name: str | None = None, version: int = 0) -> ConsumePolicy:
    """The consumption policy ``name`` (default ``sched.consume``) for ``batch_size`` items per step;
    the version-gap filter (``sched.max_version_gap``, S4) composes with any policy."""
    filters = [VersionGapFilter(sched.max_version_gap)] if sched.max_version_gap is not None else []
    return CONSUME_POLICIES.get(name or sched.consume)(sched, batch_size, version=version, filters=filters)
